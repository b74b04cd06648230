"""The reward server's ASGI app (Starlette): ``POST /score/<name>`` and ``GET /health`` of the JSON protocol of
:mod:`~trl_jagg.rewards.remote`, within :class:`Limits`. :mod:`~trl_jagg.rewards.server` serves it on uvicorn and
adds what is checked before the app sees a request (the header deadline, the connections sending headers).

What the app enforces, in the order a request meets it:

- the token (:class:`RequestGuard`, constant-time, from the headers before any body byte is read): HTTP 401;
- the request slots, ``max_connections`` requests past their headers and token at once (:class:`RequestGuard`):
  HTTP 503 with ``Retry-After: 1`` at once when all are taken. uvicorn's ``limit_concurrency`` is not used: it
  counts open connections, so clients trickling headers would take the slots this limit keeps for real requests;
- the path (404) and the body's headers, before the body is read: ``Content-Type: application/json`` (415), a
  ``Content-Length`` (411) of at most ``max_body_bytes`` (413). The body is then streamed into one buffer, refused
  (413) once it passes ``max_body_bytes``: a chunked body's ``Content-Length`` means nothing to h11. (Starlette's
  ``max_body_size`` would answer its own plain-text 413, not the protocol's JSON error.);
- one deadline, ``request_timeout`` from the connection's arrival, for the body to arrive (HTTP 408) and for the
  pixel budget to free the request's share (HTTP 503);
- the JSON fields and each image's format and pixels, read from the image headers before any pixel is decoded
  (:func:`parse_request`): HTTP 400, 413, 415;
- the pixels decoded at once over all requests, ``max_decoded_pixels`` (:class:`PixelBudget`);
- the reward's output (:func:`~trl_jagg.rewards.check_rewards`): a failing reward, a NaN or a wrong count answers
  HTTP 500 with a generic message, the details going to the server's log only.

Parsing, decoding and scoring run in worker threads (at most ``max_connections`` at once), never on the event loop
that reads the other connections.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import anyio
import anyio.to_thread
from PIL import Image
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trl_jagg.rewards.base import REWARD_KEYWORDS, check_rewards
from trl_jagg.rewards.remote import TOKEN_ENV
from trl_jagg.rewards.server_limits import MAX_PIXELS, RejectedImage, load_image, open_image

logger = logging.getLogger("reward_server")

ARRIVED = "arrived"
"""Key of ``scope["state"]`` holding the connection's arrival (``time.monotonic()``), set by the server's
protocol; an app served elsewhere counts from the request's start."""


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
    """Seconds for a whole request (line, headers and body) to arrive, from the connection's arrival."""
    header_timeout: float = 5.0
    """Seconds for the request line and headers to arrive, before a request slot is taken (at most
    ``request_timeout``)."""
    max_connections: int = 8
    """Requests served at once (past their headers and token)."""
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


def error(status: int, message: str, **headers: str) -> JSONResponse:
    """The protocol's error answer: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


@dataclass
class Batch:
    """One request's prompts, images (headers checked, pixels not decoded yet), the source images of an edit
    (``None`` if not sent) and metadata."""

    prompts: list[str]
    images: list[Image.Image]
    sources: list[Image.Image] | None
    metadata: dict[str, Any]

    @property
    def pixels(self) -> int:
        return sum(image.width * image.height for image in self.images + (self.sources or []))


def parse_request(body: bytes | bytearray, limits: Limits) -> Batch:
    """The batch a request ``body`` holds, its fields checked and its images' headers read (no pixel decoded).

    Raises:
        ClientError: a field the client must fix (400), an image of another format (415) or too many pixels (413).
    """
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
            except RejectedImage as rejected:
                raise ClientError(rejected.status, f"{key}[{index}] {rejected}.") from None
            pixels += opened[key][-1].width * opened[key][-1].height
            if pixels > limits.max_request_pixels:
                raise ClientError(
                    413,
                    f"The images up to {key}[{index}] have {pixels} pixels, more than the "
                    f"{limits.max_request_pixels} allowed per request: send fewer images per request "
                    "(remote(..., batch_size=...)).",
                )
    return Batch(prompts, opened["images"], opened.get("source_images"), metadata)


def score_batch(name: str, reward: Callable[..., Any], batch: Batch) -> tuple[int, dict[str, Any]]:
    """Decode ``batch``'s images and score them with ``reward``: the HTTP status and JSON answer. Never raises."""
    try:
        images = [load_image(image) for image in batch.images]
        metadata = batch.metadata
        if batch.sources is not None:  # an edit: the reward compares each image with its source
            metadata = {**metadata, "source_images": [load_image(image) for image in batch.sources]}
        values = reward(batch.prompts, images, **metadata)
        check_rewards(name, values, len(images))  # a NaN or a wrong count is an error, never sent
        # Full precision (the check casts to float32); None (not applicable) travels as null.
        return 200, {"scores": [None if value is None else float(value) for value in values]}
    except RejectedImage as rejected:
        return rejected.status, {"error": f"An image {rejected}."}
    except Exception:  # the reward failed: log the details here, send none of them (they may be private)
        logger.exception("Reward %s failed", name)
        return 500, {
            "error": f"Reward {name!r} failed or returned invalid (non-finite, wrong count) scores; see the server log."
        }


class PixelBudget:
    """Pixels decoded at once over all requests: a request takes its share before decoding and gives it back once
    answered. Used on the event loop only (no lock)."""

    def __init__(self, total: int) -> None:
        self.free = total
        self._released = anyio.Event()

    async def acquire(self, pixels: int, timeout: float) -> bool:
        """Take ``pixels`` (at most the total), waiting at most ``timeout`` seconds; False if not."""
        with anyio.move_on_after(timeout):
            while self.free < pixels:
                await self._released.wait()
            self.free -= pixels
            return True
        return False

    def release(self, pixels: int) -> None:
        self.free += pixels
        self._released.set()  # wakes every waiter; each checks its share again
        self._released = anyio.Event()


class RequestGuard:
    """ASGI middleware around the app: the token and a request slot, from the headers alone; every answer closes
    its connection (one request per connection: its deadlines count from the connection's arrival, and a refused
    body is never read)."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app, self.limits = app, limits
        self.busy = 0
        self._token = None if limits.token is None else f"Bearer {limits.token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if self._token is not None:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self._token):
                message = f"Missing or wrong token: send 'Authorization: Bearer <token>' ({TOKEN_ENV})."
                await error(401, message)(scope, receive, send_closing)
                return
        if self.busy >= self.limits.max_connections:
            await error(503, "The server is busy; retry later.", **{"Retry-After": "1"})(scope, receive, send_closing)
            return
        self.busy += 1
        try:
            await self.app(scope, receive, send_closing)
        finally:
            self.busy -= 1


async def read_body(request: Request, limits: Limits, timeout: float) -> bytearray:
    """The body of ``request``, its headers checked first; it must arrive within ``timeout`` seconds.

    Raises:
        ClientError: not JSON (415), no ``Content-Length`` (411), a larger one or a longer body than the limit
            (413).
        TimeoutError: the body did not arrive in time.
        ClientDisconnect: the client closed the connection first.
    """
    if request.headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json":
        raise ClientError(415, "Send the body as JSON, with 'Content-Type: application/json'.")
    length = request.headers.get("content-length")  # h11 has checked that it is a number
    if length is None:
        raise ClientError(411, "Send a Content-Length header.")
    too_large = ClientError(413, f"The body exceeds {limits.max_body_bytes} bytes: send fewer images per request.")
    if int(length) > limits.max_body_bytes:
        raise too_large
    body = bytearray()
    with anyio.fail_after(timeout):
        async for chunk in request.stream():
            body += chunk
            if len(body) > limits.max_body_bytes:  # a chunked body, whatever its Content-Length says
                raise too_large
    return body


def build_app(rewards: Mapping[str, Callable[..., Any]], limits: Limits) -> Starlette:
    """The ASGI app serving ``rewards`` (name -> reward function) within ``limits``."""
    rewards = dict(rewards)
    budget = PixelBudget(limits.max_decoded_pixels)
    workers = anyio.CapacityLimiter(limits.max_connections)
    paths = f"use GET /health or POST /score/<{'|'.join(sorted(rewards))}>"

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"rewards": sorted(rewards)})

    async def score(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        if name not in rewards:
            return error(404, f"Unknown reward path; served: /score/<{'|'.join(sorted(rewards))}>.")
        deadline = request.scope.get("state", {}).get(ARRIVED, time.monotonic()) + limits.request_timeout
        try:
            body = await read_body(request, limits, deadline - time.monotonic())
            batch = await anyio.to_thread.run_sync(parse_request, body, limits, limiter=workers)
        except ClientError as refused:
            return error(refused.status, str(refused))
        except TimeoutError:
            return error(408, f"The request did not arrive within {limits.request_timeout} s.")
        except ClientDisconnect:  # nobody to answer; uvicorn drops what is sent
            return error(400, "The client closed the connection before its body arrived.")
        del body
        pixels = batch.pixels
        if not await budget.acquire(pixels, deadline - time.monotonic()):
            return error(503, "The server is busy decoding other requests; retry later.")
        try:
            status, answer = await anyio.to_thread.run_sync(score_batch, name, rewards[name], batch, limiter=workers)
        finally:
            del batch  # the decoded pixels go before their share of the budget is given back
            budget.release(pixels)
        return JSONResponse(answer, status_code=status)

    async def unknown(request: Request, exc: HTTPException) -> JSONResponse:  # Starlette's 404 and 405
        return error(exc.status_code, f"Unknown path or method; {paths}.")

    return Starlette(
        routes=[Route("/health", health, methods=["GET"]), Route("/score/{name}", score, methods=["POST"])],
        middleware=[Middleware(RequestGuard, limits=limits)],
        exception_handlers={HTTPException: unknown},
    )
