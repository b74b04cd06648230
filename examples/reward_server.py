"""A small HTTP server that scores images with trl_jagg rewards, for ``trl_jagg.rewards.remote``.

Run the reward models on their own GPU (or machine) and point training at them:

    pip install "trl-jagg[server]"        # Starlette and uvicorn
    python examples/reward_server.py --rewards pickscore hpsv2.1 --port 8000 --device cuda:1
    # training config: reward_funcs=["http://localhost:8000/score/pickscore", "http://localhost:8000/score/hpsv2.1"]

Endpoints: ``POST /score/<name>`` with ``{"prompts": [...], "images": [base64 PNG...], "metadata": {...}}``
(and ``"source_images": [base64 PNG...]`` for an editing model, passed to the reward as ``source_images=``)
answers ``{"scores": [...]}``; ``GET /health`` answers ``{"rewards": [names]}``. Models load once, on the first
request or at start with ``--preload``. The app runs on Starlette and uvicorn (``trl_jagg/rewards/server.py`` and
``server_app.py``, which say what enforces each limit).

The server does not trust its clients: it listens on 127.0.0.1 unless told otherwise; gives each connection
``--header_timeout`` seconds for its request line and headers (HTTP 408; at most ``--max_pending`` connections may
be sending them, the oldest closed past it), so that connections trickling headers hold no request slot; checks the
token (``--token`` or ``TRL_JAGG_REWARD_TOKEN``, HTTP 401) from the headers, then takes one of the
``--max_connections`` request slots (a full server answers HTTP 503, which the client retries); gives each request
``--request_timeout`` seconds in all to arrive (HTTP 408); refuses bodies over ``--max_body_mb``, non-JSON bodies,
images that are not PNG, JPEG or WEBP, more than ``--max_pixels`` pixels per image and ``--max_request_pixels`` per
request (read from the image headers before any pixel is decoded), and decodes at most ``--max_decoded_pixels``
pixels for all requests together (a request waits for its share until its deadline, then gets 503). Client mistakes
get a 4xx status (not retried); a failing reward gets HTTP 500 with a generic message, the details going to the
server's log only.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

try:
    from trl_jagg.rewards.server import Limits, build_server
except ModuleNotFoundError as missing:  # the [server] extra is not installed: one line, not a traceback
    sys.exit(f"reward_server.py: {missing}")

from trl_jagg.rewards import load_reward_funcs
from trl_jagg.rewards.remote import TOKEN_ENV

logger = logging.getLogger("reward_server")


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
    parser.add_argument("--max_connections", type=int, default=Limits.max_connections, help="requests at once")
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
    host, port = server.server_address
    if limits.token is None and host not in ("127.0.0.1", "::1", "localhost"):
        logger.warning("Listening on %s without --token: anyone who reaches this port can use the GPU.", host)
    logger.info("Serving %s on http://%s:%d/score/<name>", ", ".join(rewards), host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # uvicorn stops on the signal, then raises it again
        pass
    finally:
        server.close()


if __name__ == "__main__":
    main()
