"""A tiny HTTP server that scores images with trl_jagg rewards, for ``trl_jagg.rewards.remote``.

Run the reward models on their own GPU (or machine) and point training at them:

    python examples/reward_server.py --rewards pickscore hpsv2.1 --port 8000 --device cuda:1
    # training config: reward_funcs=["http://localhost:8000/score/pickscore", "http://localhost:8000/score/hpsv2.1"]

Endpoints: ``POST /score/<name>`` with ``{"prompts": [...], "images": [base64 PNG...], "metadata": {...}}``
answers ``{"scores": [...]}``; ``GET /health`` answers ``{"rewards": [names]}``. Standard library only; requests
are handled in threads (models load once, on the first request or at start with ``--preload``).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trl_jagg.rewards import check_rewards, load_reward_funcs
from trl_jagg.rewards.remote import decode_image

logger = logging.getLogger("reward_server")


class ClientError(Exception):
    """A request the client must fix (HTTP 4xx): not retried by the remote reward."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _parse_request(body: bytes) -> tuple[list[str], list[Any], dict[str, Any]]:
    try:
        payload = json.loads(body)
        prompts, images = payload["prompts"], [decode_image(data) for data in payload["images"]]
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise ClientError(
            400,
            f"Bad request ({type(error).__name__}: {error}); expected JSON with 'prompts' and 'images' (base64 PNG).",
        ) from error
    metadata = payload.get("metadata") or {}
    if not isinstance(prompts, list) or len(prompts) != len(images) or not isinstance(metadata, dict):
        raise ClientError(400, "'prompts' must be a list as long as 'images', and 'metadata' an object.")
    return prompts, images, metadata


def make_handler(rewards: Mapping[str, Callable[..., Any]]) -> type[BaseHTTPRequestHandler]:
    """A request-handler class serving ``rewards`` (name -> reward function)."""

    class RewardHandler(BaseHTTPRequestHandler):
        def _send(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") == "/health":
                self._send(200, {"rewards": sorted(rewards)})
            else:
                self._send(404, {"error": f"Unknown path {self.path}; use GET /health or POST /score/<name>."})

        def do_POST(self) -> None:  # noqa: N802
            try:
                name = self.path.rstrip("/").removeprefix("/score/")
                if not self.path.startswith("/score/") or name not in rewards:
                    raise ClientError(404, f"Unknown reward path {self.path}; served: /score/<{'|'.join(rewards)}>.")
                length = int(self.headers.get("Content-Length", 0))
                prompts, images, metadata = _parse_request(self.rfile.read(length))
                values = rewards[name](prompts=prompts, images=images, completions=images, **metadata)
                check_rewards(name, values, len(images))  # a NaN or a wrong count is an error, never sent
                # Full precision (the check casts to float32); None (not applicable) travels as JSON null.
                scores = [None if value is None else float(value) for value in values]
            except ClientError as error:
                self._send(error.status, {"error": str(error)})
            except Exception as error:  # the reward failed: report it (HTTP 500) instead of dropping the connection
                logger.exception("Reward %s failed", self.path)
                self._send(500, {"error": f"{type(error).__name__}: {error}"})
            else:
                self._send(200, {"scores": scores})

        def log_message(self, format: str, *args: Any) -> None:  # route access logs through logging
            logger.info("%s " + format, self.address_string(), *args)

    return RewardHandler


def build_server(
    rewards: Mapping[str, Callable[..., Any]], host: str = "127.0.0.1", port: int = 8000
) -> ThreadingHTTPServer:
    """A threaded HTTP server for ``rewards``; ``port=0`` picks a free port (see ``server.server_address``)."""
    server = ThreadingHTTPServer((host, port), make_handler(dict(rewards)))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewards", nargs="+", required=True, help="registry names, e.g. pickscore hpsv2.1 ocr")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default=None, help="e.g. cuda:1 (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: float32)")
    parser.add_argument("--preload", action="store_true", help="load the models before serving")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    funcs = load_reward_funcs(args.rewards, device=args.device, dtype=args.dtype)
    rewards = dict(zip(args.rewards, funcs))
    if args.preload:
        for func in funcs:
            getattr(func, "load", lambda: None)()
    server = build_server(rewards, args.host, args.port)
    host, port = server.server_address[:2]
    logger.info("Serving %s on http://%s:%d/score/<name>", ", ".join(rewards), host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
