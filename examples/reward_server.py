"""A small HTTP server that scores images with trl_jagg rewards, for ``trl_jagg.rewards.remote``.

Run the reward models on their own GPU (or machine) and point training at them:

    python examples/reward_server.py --rewards pickscore hpsv2.1 --port 8000 --device cuda:1
    # training config: reward_funcs=["http://localhost:8000/score/pickscore", "http://localhost:8000/score/hpsv2.1"]

Endpoints: ``POST /score/<name>`` with ``{"prompts": [...], "images": [base64 PNG...], "metadata": {...}}``
answers ``{"scores": [...]}``; ``GET /health`` answers ``{"rewards": [names]}``. Standard library only; models
load once, on the first request or at start with ``--preload``.

The server does not trust its clients: it listens on 127.0.0.1 unless told otherwise, serves at most
``--max_connections`` requests at once (others get HTTP 503, which the client retries), gives each request
``--request_timeout`` seconds in all to arrive, refuses bodies over ``--max_body_mb``, images that are not PNG,
JPEG or WEBP or have more than ``--max_pixels`` pixels, and, with ``--token`` (or ``TRL_JAGG_REWARD_TOKEN``),
requests without it. Client mistakes get a 4xx status (not retried); a failing reward gets HTTP 500 with a
generic message, the details going to the server's log only.
"""

from __future__ import annotations

import argparse
import hmac
import io
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from trl_jagg.rewards import check_rewards, load_reward_funcs
from trl_jagg.rewards.remote import MAX_PIXELS, TOKEN_ENV, DeadlineReader, RejectedImage, decode_image

logger = logging.getLogger("reward_server")


@dataclass(frozen=True)
class Limits:
    """What one client can make the server do."""

    max_body_bytes: int = 64 * 2**20
    max_pixels: int = MAX_PIXELS
    request_timeout: float = 30.0
    """Seconds for a whole request (line, headers and body) to arrive."""
    max_connections: int = 8
    token: str | None = None


class ClientError(Exception):
    """A request the client must fix (HTTP 4xx): not retried by the remote reward."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _parse_request(body: bytes, max_pixels: int) -> tuple[list[str], list[Any], dict[str, Any]]:
    try:
        payload = json.loads(body)
    except ValueError:
        raise ClientError(400, "The body is not JSON.") from None
    if not isinstance(payload, dict) or not {"prompts", "images"} <= set(payload):
        raise ClientError(400, "Expected a JSON object with 'prompts' and 'images' (base64 PNG), and 'metadata'.")
    prompts, encoded, metadata = payload["prompts"], payload["images"], payload.get("metadata") or {}
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ClientError(400, "'prompts' must be a list of strings.")
    if not isinstance(encoded, list) or len(encoded) != len(prompts):
        raise ClientError(400, "'images' must be a list as long as 'prompts'.")
    if not isinstance(metadata, dict):
        raise ClientError(400, "'metadata' must be an object of dataset columns.")
    images = []
    for index, data in enumerate(encoded):
        try:
            images.append(decode_image(data, max_pixels=max_pixels))
        except RejectedImage as error:
            raise ClientError(error.status, f"images[{index}] {error}.") from None
    return prompts, images, metadata


def make_handler(rewards: Mapping[str, Callable[..., Any]], limits: Limits) -> type[BaseHTTPRequestHandler]:
    """A request-handler class serving ``rewards`` (name -> reward function) within ``limits``."""

    class RewardHandler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()
            # One deadline for the request line, the headers and the body: a client trickling bytes is cut off.
            self.rfile = io.BufferedReader(DeadlineReader(self.connection, time.monotonic() + limits.request_timeout))

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _check_token(self) -> None:
            if limits.token is None:
                return
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {limits.token}".encode()):
                raise ClientError(401, f"Missing or wrong token: send 'Authorization: Bearer <token>' ({TOKEN_ENV}).")

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                raise ClientError(411, "Send a Content-Length header.")
            if not length.isdigit():
                raise ClientError(400, "Content-Length is not a number of bytes.")
            if int(length) > limits.max_body_bytes:
                raise ClientError(
                    413, f"The body exceeds {limits.max_body_bytes} bytes: send fewer images per request."
                )
            body = self.rfile.read(int(length))
            if len(body) < int(length):
                raise ClientError(400, "The body is shorter than its Content-Length.")
            return body

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            try:
                self._check_token()
                if self.path.rstrip("/") != "/health":
                    raise ClientError(404, "Unknown path; use GET /health or POST /score/<name>.")
            except ClientError as error:
                self._send(error.status, {"error": str(error)})
            else:
                self._send(200, {"rewards": sorted(rewards)})

        def do_POST(self) -> None:  # noqa: N802
            try:
                self._check_token()
                name = self.path.rstrip("/").removeprefix("/score/")
                if not self.path.startswith("/score/") or name not in rewards:
                    raise ClientError(404, f"Unknown reward path; served: /score/<{'|'.join(sorted(rewards))}>.")
                prompts, images, metadata = _parse_request(self._read_body(), limits.max_pixels)
            except ClientError as error:
                self.close_connection = True
                self._send(error.status, {"error": str(error)})
                return
            except TimeoutError:
                self.close_connection = True
                self._send(408, {"error": f"The request did not arrive within {limits.request_timeout} s."})
                return
            try:
                values = rewards[name](prompts, images, **metadata)
                check_rewards(name, values, len(images))  # a NaN or a wrong count is an error, never sent
                scores = [float(value) for value in values]  # full precision (the check casts to float32)
            except Exception:  # the reward failed: log the details here, send none of them (they may be private)
                logger.exception("Reward %s failed", name)
                self._send(500, {"error": f"Reward {name!r} failed or returned invalid (non-finite, wrong count) "
                                 "scores; see the server log."})  # fmt: skip
            else:
                self._send(200, {"scores": scores})

        def log_message(self, format: str, *args: Any) -> None:  # route access logs through logging
            logger.info("%s " + format, self.address_string(), *args)

    return RewardHandler


class RewardServer(HTTPServer):
    """An HTTP server with at most ``max_connections`` request threads: a further connection is answered HTTP 503
    at once and closed, so idle or slow clients cannot pile up threads."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = b'{"error": "The server is busy; retry later."}'
            try:
                request.settimeout(1.0)
                request.sendall(
                    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
            except OSError:
                pass
            self.shutdown_request(request)
            return
        threading.Thread(target=self._serve, args=(request, client_address), daemon=True).start()

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()


def build_server(
    rewards: Mapping[str, Callable[..., Any]], host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None
) -> RewardServer:
    """A server for ``rewards`` on ``host`` (loopback by default); ``port=0`` picks a free port (see
    ``server.server_address``)."""
    limits = limits if limits is not None else Limits()
    return RewardServer((host, port), make_handler(dict(rewards), limits), limits.max_connections)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewards", nargs="+", required=True, help="registry names, e.g. pickscore hpsv2.1 ocr")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all: set --token)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default=None, help="e.g. cuda:1 (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: float32)")
    parser.add_argument("--preload", action="store_true", help="load the models before serving")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"shared token (default: ${TOKEN_ENV})")
    parser.add_argument("--max_body_mb", type=float, default=Limits.max_body_bytes / 2**20)
    parser.add_argument("--max_pixels", type=int, default=Limits.max_pixels, help="per image (width x height)")
    parser.add_argument("--request_timeout", type=float, default=Limits.request_timeout)
    parser.add_argument("--max_connections", type=int, default=Limits.max_connections)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    funcs = load_reward_funcs(args.rewards, device=args.device, dtype=args.dtype)
    rewards = dict(zip(args.rewards, funcs))
    if args.preload:
        for func in funcs:
            getattr(func, "load", lambda: None)()
    limits = Limits(
        max_body_bytes=int(args.max_body_mb * 2**20), max_pixels=args.max_pixels,
        request_timeout=args.request_timeout, max_connections=args.max_connections, token=args.token or None,
    )  # fmt: skip
    server = build_server(rewards, args.host, args.port, limits)
    host, port = server.server_address[:2]
    if limits.token is None and host not in ("127.0.0.1", "::1", "localhost"):
        logger.warning("Listening on %s without --token: anyone who reaches this port can use the GPU.", host)
    logger.info("Serving %s on http://%s:%d/score/<name>", ", ".join(rewards), host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
