"""A small HTTP server that scores images with trl_jagg rewards, for ``trl_jagg.rewards.remote``.

Run the reward models on their own GPU (or machine) and point training at them:

    python examples/reward_server.py --rewards pickscore hpsv2.1 --port 8000 --device cuda:1
    # training config: reward_funcs=["http://localhost:8000/score/pickscore", "http://localhost:8000/score/hpsv2.1"]

Endpoints: ``POST /score/<name>`` with ``{"prompts": [...], "images": [base64 PNG...], "metadata": {...}}``
(and ``"source_images": [base64 PNG...]`` for an editing model, passed to the reward as ``source_images=``)
answers ``{"scores": [...]}``; ``GET /health`` answers ``{"rewards": [names]}``. Standard library only; models
load once, on the first request or at start with ``--preload``.

The server does not trust its clients: it listens on 127.0.0.1 unless told otherwise; reads each connection's
request line and headers in one reception thread within ``--header_timeout`` seconds and checks the token
(``--token`` or ``TRL_JAGG_REWARD_TOKEN``) there, before the connection takes one of the ``--max_connections``
request slots (a full server answers HTTP 503, which the client retries), so connections that trickle headers or
lack the token cannot hold slots; gives each request ``--request_timeout`` seconds in all to arrive; refuses
bodies over ``--max_body_mb``, non-JSON bodies, images that are not PNG, JPEG or WEBP, more than ``--max_pixels``
pixels per image and ``--max_request_pixels`` per request (read from the image headers before any pixel is
decoded), and decodes at most ``--max_decoded_pixels`` pixels for all requests together (a request waits for its
share until its deadline, then gets 503). Client mistakes get a 4xx status (not retried); a failing reward gets
HTTP 500 with a generic message, the details going to the server's log only.
"""

from __future__ import annotations

import argparse
import collections
import hmac
import http.client
import io
import json
import logging
import math
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from PIL import Image

from trl_jagg.rewards import check_rewards, load_reward_funcs
from trl_jagg.rewards.base import REWARD_KEYWORDS
from trl_jagg.rewards.remote import TOKEN_ENV
from trl_jagg.rewards.server_limits import MAX_PIXELS, DeadlineReader, RejectedImage, load_image, open_image

logger = logging.getLogger("reward_server")


@dataclass(frozen=True)
class Limits:
    """What one client can make the server do."""

    max_body_bytes: int = 64 * 2**20
    max_pixels: int = MAX_PIXELS
    """Per image (width x height)."""
    max_request_pixels: int = 2 * MAX_PIXELS
    """All images of one request together."""
    max_decoded_pixels: int = 4 * MAX_PIXELS
    """Decoded at once over all requests: with the body limit, what bounds the server's memory."""
    request_timeout: float = 30.0
    """Seconds for a whole request (line, headers and body) to arrive."""
    header_timeout: float = 5.0
    """Seconds for the request line and headers to arrive, before a request slot is taken (at most
    ``request_timeout``)."""
    max_connections: int = 8
    max_pending: int = 256
    """Connections whose headers are still arriving; past it, the oldest one is closed."""
    token: str | None = None

    def __post_init__(self) -> None:
        # A limit of 0 would start a server that refuses every request.
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name != "token" and not (isinstance(value, (int, float)) and 0 < value < math.inf):
                if item.name == "max_body_bytes":
                    raise ValueError(f"--max_body_mb is {value / 2**20:g}: use a positive size in MiB.")
                raise ValueError(f"--{item.name} is {value}: use a positive (finite) value.")
        for smaller, larger in (("max_pixels", "max_request_pixels"), ("max_request_pixels", "max_decoded_pixels")):
            if getattr(self, smaller) > getattr(self, larger):
                raise ValueError(
                    f"--{smaller} ({getattr(self, smaller)}) is larger than --{larger} ({getattr(self, larger)}): "
                    f"use --{smaller} <= --{larger}."
                )


class ClientError(Exception):
    """A request the client must fix (HTTP 4xx): not retried by the remote reward."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _parse_request(
    body: bytes, limits: Limits
) -> tuple[list[str], list[Image.Image], list[Image.Image] | None, dict[str, Any]]:
    """The prompts, the images and the source images of an edit (``None`` if not sent; headers checked, not decoded
    yet) and the metadata of a request body."""
    try:
        payload = json.loads(body)
    except RecursionError:  # a deeply nested document: json's C parser recurses
        raise ClientError(400, "The JSON body is nested too deeply.") from None
    except ValueError:
        raise ClientError(400, "The body is not JSON.") from None
    if not isinstance(payload, dict) or not {"prompts", "images"} <= set(payload):
        raise ClientError(400, "Expected a JSON object with 'prompts' and 'images' (base64 PNG), and 'metadata'.")
    prompts, encoded, metadata = payload["prompts"], payload["images"], payload.get("metadata") or {}
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ClientError(400, "'prompts' must be a list of strings.")
    lists = {"images": encoded}
    if payload.get("source_images") is not None:
        lists["source_images"] = payload["source_images"]
    for key, value in lists.items():
        if not isinstance(value, list) or len(value) != len(prompts):
            raise ClientError(400, f"'{key}' must be a list as long as 'prompts'.")
    if not isinstance(metadata, dict):
        raise ClientError(400, "'metadata' must be an object of dataset columns.")
    reserved = sorted(set(metadata) & {"prompts", "images", "source_images", *REWARD_KEYWORDS})
    if reserved:
        raise ClientError(400, f"'metadata' keys {reserved} are reward keywords: rename those dataset columns.")
    opened: dict[str, list[Image.Image]] = {}
    pixels = 0  # the source images count against the request's pixels too
    for key, value in lists.items():
        opened[key] = []
        for index, data in enumerate(value):
            try:
                opened[key].append(open_image(data, max_pixels=limits.max_pixels))
            except RejectedImage as error:
                raise ClientError(error.status, f"{key}[{index}] {error}.") from None
            pixels += opened[key][-1].width * opened[key][-1].height
            if pixels > limits.max_request_pixels:
                raise ClientError(
                    413,
                    f"The images up to {key}[{index}] have {pixels} pixels, more than the "
                    f"{limits.max_request_pixels} allowed per request: send fewer images per request "
                    "(remote(..., batch_size=...)).",
                )
    return prompts, opened["images"], opened.get("source_images"), metadata


class PixelBudget:
    """Pixels decoded at once over all requests: a request takes its share before decoding and gives it back once
    answered."""

    def __init__(self, total: int) -> None:
        self.free = total
        self._changed = threading.Condition()

    def acquire(self, pixels: int, deadline: float) -> bool:
        """Take ``pixels`` (at most the total), waiting until ``deadline`` (``time.monotonic()``); False if not."""
        with self._changed:
            while self.free < pixels:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
            self.free -= pixels
            return True

    def release(self, pixels: int) -> None:
        with self._changed:
            self.free += pixels
            self._changed.notify_all()


def make_handler(rewards: Mapping[str, Callable[..., Any]], limits: Limits) -> type[BaseHTTPRequestHandler]:
    """A request-handler class serving ``rewards`` (name -> reward function) within ``limits``."""

    class RewardHandler(BaseHTTPRequestHandler):
        server: RewardServer

        def setup(self) -> None:
            super().setup()
            # The headers the reception read come first; then one deadline for the rest of the request, counted
            # from the connection's arrival: a client trickling bytes is cut off.
            head, self.deadline = self.server.received.pop(self.connection)
            self.rfile = io.BufferedReader(_Replay(head, DeadlineReader(self.connection, self.deadline)))

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _read_body(self) -> bytes:
            if self.headers.get_content_type() != "application/json":
                raise ClientError(415, "Send the body as JSON, with 'Content-Type: application/json'.")
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
            if self.path.rstrip("/") != "/health":
                self._send(404, {"error": "Unknown path; use GET /health or POST /score/<name>."})
            else:
                self._send(200, {"rewards": sorted(rewards)})

        def do_POST(self) -> None:  # noqa: N802
            self.close_connection = True
            try:
                name = self.path.rstrip("/").removeprefix("/score/")
                if not self.path.startswith("/score/") or name not in rewards:
                    raise ClientError(404, f"Unknown reward path; served: /score/<{'|'.join(sorted(rewards))}>.")
                prompts, images, sources, metadata = _parse_request(self._read_body(), limits)
            except ClientError as error:
                self._send(error.status, {"error": str(error)})
                return
            except TimeoutError:
                self._send(408, {"error": f"The request did not arrive within {limits.request_timeout} s."})
                return
            pixels = sum(image.width * image.height for image in images + (sources or []))
            if not self.server.budget.acquire(pixels, self.deadline):
                self._send(503, {"error": "The server is busy decoding other requests; retry later."})
                return
            try:
                self._score(name, prompts, images, sources, metadata)
            finally:
                del images, sources  # the decoded pixels go before their share of the budget is given back
                self.server.budget.release(pixels)

        def _score(
            self, name: str, prompts: list[str], images: list[Image.Image], sources: list[Image.Image] | None,
            metadata: dict[str, Any],
        ) -> None:  # fmt: skip
            try:
                images = [load_image(image) for image in images]
                if sources is not None:  # an edit: the reward compares each image with its source
                    metadata = {**metadata, "source_images": [load_image(image) for image in sources]}
            except RejectedImage as error:
                self._send(error.status, {"error": f"An image {error}."})
                return
            try:
                values = rewards[name](prompts, images, **metadata)
                check_rewards(name, values, len(images))  # a NaN or a wrong count is an error, never sent
                # Full precision (the check casts to float32); None (not applicable) travels as null.
                scores = [None if value is None else float(value) for value in values]
            except Exception:  # the reward failed: log the details here, send none of them (they may be private)
                logger.exception("Reward %s failed", name)
                self._send(500, {"error": f"Reward {name!r} failed or returned invalid (non-finite, wrong count) "
                                 "scores; see the server log."})  # fmt: skip
            else:
                self._send(200, {"scores": scores})

        def log_message(self, format: str, *args: Any) -> None:  # route access logs through logging
            logger.info("%s " + format, self.address_string(), *args)

    return RewardHandler


class _Replay(io.RawIOBase):
    """``head`` (the bytes the reception already read), then the rest of the connection from ``reader``."""

    def __init__(self, head: bytes, reader: io.RawIOBase) -> None:
        super().__init__()
        self._head, self._reader = memoryview(head), reader

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self._head:
            return self._reader.readinto(buffer)
        count = min(len(buffer), len(self._head))
        buffer[:count] = self._head[:count]
        self._head = self._head[count:]
        return count


MAX_HEAD_BYTES = 64 * 2**10
"""Request line and headers (http.server's line limit)."""


@dataclass
class _Pending:
    """A connection in the reception: when it arrived, from where, and its bytes so far."""

    arrived: float
    address: Any
    head: bytes = b""


def _refuse(sock: socket.socket, status: int, reason: str, message: str) -> None:
    """Answer ``status`` with a JSON error and close, without waiting on the peer (the answer fits the send
    buffer of a fresh connection)."""
    body = json.dumps({"error": message}).encode()
    head = f"HTTP/1.0 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    if status == 503:
        head += "Retry-After: 1\r\n"
    try:
        sock.settimeout(0)
        sock.send(head.encode() + b"\r\n" + body)
    except OSError:
        pass
    sock.close()


class RewardServer(HTTPServer):
    """An HTTP server whose request threads, at most ``limits.max_connections``, serve only connections whose
    request line and headers have arrived within ``limits.header_timeout`` with the right token.

    One reception thread reads the headers of every new connection (at most ``limits.max_pending``; past it the
    oldest is closed) with a selector, so slow or unauthorised connections cost no thread and no request slot. A
    connection past the headers with every slot busy is answered HTTP 503 at once and closed.
    """

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limits: Limits):
        super().__init__(address, handler)
        self.limits = limits
        self.budget = PixelBudget(limits.max_decoded_pixels)
        self.received: dict[socket.socket, tuple[bytes, float]] = {}
        """Connection -> (the bytes read by the reception, the request deadline), taken by the handler."""
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._arrivals: collections.deque[tuple[socket.socket, Any]] = collections.deque()
        self._wake_read, self._wake_write = socket.socketpair()
        self._closing = False
        self._reception = threading.Thread(target=self._receive, name="reception", daemon=True)
        self._reception.start()

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        # Called by serve_forever for each accepted connection: hand it to the reception, never block here.
        self._arrivals.append((request, client_address))
        self._wake_write.send(b"x")

    def server_close(self) -> None:
        self._closing = True
        self._wake_write.send(b"x")
        self._reception.join(5)
        super().server_close()
        self._wake_read.close()
        self._wake_write.close()

    def _receive(self) -> None:
        """The reception loop: read headers of pending connections until each completes or its deadline passes."""
        selector = selectors.DefaultSelector()
        selector.register(self._wake_read, selectors.EVENT_READ)
        pending: dict[socket.socket, _Pending] = {}  # in arrival order: the oldest first
        header_timeout = min(self.limits.header_timeout, self.limits.request_timeout)
        while not self._closing:
            now = time.monotonic()
            wait = min([0.5] + [entry.arrived + header_timeout - now for entry in pending.values()])
            for key, _ in selector.select(max(wait, 0.0)):
                if key.fileobj is self._wake_read:
                    self._wake_read.recv(4096)
                    while self._arrivals:
                        sock, address = self._arrivals.popleft()
                        sock.setblocking(False)
                        pending[sock] = _Pending(time.monotonic(), address)
                        selector.register(sock, selectors.EVENT_READ)
                        if len(pending) > self.limits.max_pending:
                            oldest = next(iter(pending))
                            selector.unregister(oldest)
                            del pending[oldest]
                            oldest.close()
                    continue
                sock = key.fileobj
                try:
                    data = sock.recv(MAX_HEAD_BYTES)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                entry = pending[sock]
                entry.head += data
                if data and b"\r\n\r\n" not in entry.head and len(entry.head) <= MAX_HEAD_BYTES:
                    continue
                selector.unregister(sock)
                del pending[sock]
                try:
                    self._admit(sock, entry, closed=not data)
                except Exception:  # one bad connection must not stop the reception of the others
                    logger.exception("Refused a connection from %s", entry.address)
                    sock.close()
            now = time.monotonic()
            for sock in [sock for sock, entry in pending.items() if entry.arrived + header_timeout <= now]:
                selector.unregister(sock)
                del pending[sock]
                _refuse(sock, 408, "Request Timeout", f"The headers did not arrive within {header_timeout} s.")
        for sock in pending:
            sock.close()
        selector.close()

    def _admit(self, sock: socket.socket, entry: _Pending, closed: bool) -> None:
        """A connection whose headers have arrived (or whose peer ``closed`` first): check the headers and the
        token, then serve it in a free slot (or answer 503)."""
        if closed:
            sock.close()
            return
        block = entry.head.partition(b"\r\n\r\n")[0]
        if len(block) > MAX_HEAD_BYTES:
            _refuse(sock, 431, "Request Header Fields Too Large", "The request headers are too large.")
            return
        if self.limits.token is not None:
            lines = block.split(b"\r\n", 1)
            try:
                headers = http.client.parse_headers(io.BytesIO(lines[1] + b"\r\n\r\n" if len(lines) > 1 else b"\r\n"))
            except http.client.HTTPException:  # more than 100 headers, or a line over the limit
                _refuse(sock, 431, "Request Header Fields Too Large", "Too many or too long request headers.")
                return
            given = headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.limits.token}".encode()):
                _refuse(sock, 401, "Unauthorized",
                        f"Missing or wrong token: send 'Authorization: Bearer <token>' ({TOKEN_ENV}).")  # fmt: skip
                return
        if not self._slots.acquire(blocking=False):
            _refuse(sock, 503, "Service Unavailable", "The server is busy; retry later.")
            return
        sock.setblocking(True)
        self.received[sock] = (entry.head, entry.arrived + self.limits.request_timeout)
        threading.Thread(target=self._serve, args=(sock, entry.address), daemon=True).start()

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.received.pop(request, None)
            self.shutdown_request(request)
            self._slots.release()


def build_server(
    rewards: Mapping[str, Callable[..., Any]], host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None
) -> RewardServer:
    """A server for ``rewards`` on ``host`` (loopback by default); ``port=0`` picks a free port (see
    ``server.server_address``)."""
    limits = limits if limits is not None else Limits()
    return RewardServer((host, port), make_handler(dict(rewards), limits), limits)


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
    parser.add_argument("--max_request_pixels", type=int, default=Limits.max_request_pixels, help="per request")
    parser.add_argument("--max_decoded_pixels", type=int, default=Limits.max_decoded_pixels,
                        help="decoded at once over all requests (bounds the memory)")  # fmt: skip
    parser.add_argument("--request_timeout", type=float, default=Limits.request_timeout)
    parser.add_argument("--header_timeout", type=float, default=Limits.header_timeout)
    parser.add_argument("--max_connections", type=int, default=Limits.max_connections)
    parser.add_argument("--max_pending", type=int, default=Limits.max_pending, help="connections sending headers")
    args = parser.parse_args(argv)
    try:  # before any model loads
        limits = Limits(
            max_body_bytes=int(args.max_body_mb * 2**20), max_pixels=args.max_pixels,
            max_request_pixels=args.max_request_pixels, max_decoded_pixels=args.max_decoded_pixels,
            request_timeout=args.request_timeout, header_timeout=args.header_timeout,
            max_connections=args.max_connections, max_pending=args.max_pending, token=args.token or None,
        )  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    funcs = load_reward_funcs(args.rewards, device=args.device, dtype=args.dtype)
    rewards = dict(zip(args.rewards, funcs))
    if args.preload:
        for func in funcs:
            getattr(func, "load", lambda: None)()
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
