"""A reward scored by an HTTP server, so that large reward models can run on other GPUs or machines; its client
(:class:`RemoteReward`, on ``httpx``) is also the VLM judges' (:mod:`~trl_jagg.rewards.vlm_judge`).

Protocol (JSON over ``POST``, see ``examples/reward_server.py``)::

    request:  {"prompts": [str, ...], "images": [base64 PNG, ...], "metadata": {column: [value, ...]},
               "source_images": [base64 PNG, ...]}   (editing models only: the image each sample edits)
    response: {"scores": [float, ...]}            (or {"error": str} with an HTTP error status)

Both sides bound what the other can make them do: the client gives each attempt one deadline for connecting,
sending and reading the whole answer (a server trickling bytes cannot hold it longer) and streams a bounded answer
(a longer one is refused without reading the rest); the server (``examples/reward_server.py``, Starlette on uvicorn:
:mod:`~trl_jagg.rewards.server`) limits the body, the time to receive it, the requests it serves at once, the image
formats (PNG, JPEG, WEBP) and the pixels per image. A shared token (``Authorization: Bearer``, from
``TRL_JAGG_REWARD_TOKEN`` by default) keeps other local users out.

Retries are one loop (:meth:`RemoteReward._post`): connection errors, timeouts, HTTP 429 and 5xx, honouring
``Retry-After``. httpx's transport retries (of failed connects only) stay off, their default, so that ``retries``
counts every attempt and each waits its backoff.

The client is asynchronous: the trainer awaits :meth:`RemoteReward.acall` on the event loop every async reward
shares (:mod:`~trl_jagg.rewards.calling`), so that ``reward_timeout`` cancels a request in flight; calling the
reward (``reward(prompts, images)``) runs the same coroutine there and waits for its scores.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import functools
import io
import json
import math
import os
import ssl
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
from PIL import Image

from trl_jagg.config.field_types import has_kind
from trl_jagg.rewards.calling import run_on_event_loop
from trl_jagg.rewards.lazy import check_pairs, to_rgb
from trl_jagg.utils.redaction import check_url_without_credentials, redact_url

SERVER_HINT = "Start one with: python examples/reward_server.py --rewards pickscore --port 8000"
TOKEN_ENV = "TRL_JAGG_REWARD_TOKEN"
"""Environment variable holding the shared token, read by the client and the example server."""
MAX_RESPONSE_BYTES = 4 * 2**20
RETRIED_STATUSES = frozenset({429}) | frozenset(range(500, 600))
"""HTTP answers worth resending: rate limited (429) or a server-side failure (5xx); other 4xx cannot change."""


def retry_after_seconds(value: str | None) -> float | None:
    """The wait a ``Retry-After`` header asks for (RFC 9110 10.2.3: delta-seconds or an HTTP date), ``None`` when
    absent or unreadable (then the client's own backoff applies)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def encode_image(image: Image.Image) -> str:
    """``image`` as a base64 PNG string (lossless, so the server scores exactly the generated pixels)."""
    buffer = io.BytesIO()
    to_rgb(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _json_columns(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The extra dataset columns that survive JSON; others (tensors, objects) stay local, since a reward must
    ignore columns it does not know anyway."""
    columns = {}
    for key, value in kwargs.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        columns[key] = value
    return columns


# The system's trust store, as the standard library verifies with; loaded once (milliseconds), a client is built per call.
_ssl_context = functools.cache(ssl.create_default_context)


class RemoteReward:
    """Posts (prompts, images) to ``url`` and returns the server's scores. Connection failures, timeouts, HTTP 429
    (rate limited) and 5xx answers are retried with exponential backoff, or after the wait the answer's
    ``Retry-After`` header asks for (at most ``timeout``); other HTTP 4xx answers are not (resending cannot help)."""

    per_sample = True
    """Each image is scored on its own (the requests already split a batch), so a batch may be scored in parts."""

    def __init__(
        self,
        url: str,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 1.0,
        batch_size: int | None = None,
        name: str | None = None,
        token: str | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        check_url_without_credentials(
            url, "remote reward", f"pass the shared token with token=... or, better, the {TOKEN_ENV} variable."
        )
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            parsed = None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"The reward server URL must be http(s)://host[:port]/path, got {redact_url(url)!r}.")
        # Checked here, not at the first request: each would fail only after a whole rollout.
        for field_name, value, valid, fix in (
            ("timeout", timeout, has_kind(timeout, float) and 0 < timeout < math.inf, "a finite number of seconds > 0"),
            ("retries", retries, has_kind(retries, int) and retries >= 0, "an integer >= 0"),
            ("backoff", backoff, has_kind(backoff, float) and 0 <= backoff < math.inf, "a finite number of seconds >= 0"),
            ("batch_size", batch_size, batch_size is None or (has_kind(batch_size, int) and batch_size >= 1),
             "None (all images in one request) or an integer >= 1"),
            ("max_response_bytes", max_response_bytes, has_kind(max_response_bytes, int) and max_response_bytes >= 1,
             "an integer >= 1"),
        ):  # fmt: skip
            if not valid:
                raise ValueError(f"remote({redact_url(url)!r}): {field_name} is {value!r}. Use {fix}.")
        self.url = url
        self.shown_url = redact_url(url)  # in messages and repr: a key in its query string stays out
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.batch_size = batch_size
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.max_response_bytes = max_response_bytes
        last_segment = parsed.path.rstrip("/").rsplit("/", 1)[-1]
        self.__name__ = name or (f"remote_{last_segment}" if last_segment else "remote")

    def _client(self) -> httpx.AsyncClient:
        """The client of one call (its requests share connections; closed when the call ends or is cancelled). No
        proxy or ``.netrc`` from the environment: the request goes where ``url`` says, with ``token`` only."""
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}  # the size bound is the body's
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return httpx.AsyncClient(headers=headers, timeout=self.timeout, verify=_ssl_context(), trust_env=False)

    async def _attempt(self, client: httpx.AsyncClient, body: str | bytes) -> tuple[int, bytes, float | None]:
        """One attempt: send ``body``, read the status, a bounded answer and its ``Retry-After`` wait
        (:func:`retry_after_seconds`). The answer is streamed, so a longer one is refused at the bound."""
        async with client.stream("POST", self.url, content=body) as response:
            data = bytearray()
            async for chunk in response.aiter_raw():
                data += chunk
                if len(data) > self.max_response_bytes:
                    raise RuntimeError(
                        f"Reward server {self.shown_url} sent more than max_response_bytes={self.max_response_bytes} bytes: "
                        "not a score list."
                    )
            return response.status_code, bytes(data), retry_after_seconds(response.headers.get("Retry-After"))

    async def _post(self, client: httpx.AsyncClient, body: str | bytes) -> Any:
        """The JSON answer to ``body``, each attempt within ``timeout`` seconds in all (connect, send, score, read),
        retried as the class docstring says."""
        server_error: str | None = None  # the last HTTP 429 / 5xx answer: the server is up but did not score
        connection_error: Exception | None = None
        retry_after: float | None = None  # what the last answer asked to wait
        for attempt in range(self.retries + 1):
            if attempt:
                # The server's own wait when it gave one, bounded by one attempt's deadline (a long Retry-After
                # would stall the step past what `timeout` allows); the backoff otherwise.
                backoff = self.backoff * 2 ** (attempt - 1)
                await asyncio.sleep(backoff if retry_after is None else min(retry_after, self.timeout))
            try:
                # httpx's timeouts bound each wait; this deadline bounds them all (a server trickling bytes).
                status, data, retry_after = await asyncio.wait_for(self._attempt(client, body), self.timeout)
            except (asyncio.TimeoutError, httpx.TransportError, OSError) as error:  # httpx's timeouts included
                server_error, connection_error, retry_after = None, error, None
                continue
            detail = _error_detail(data)
            if status == 200:
                return self._parse(data)
            if status not in RETRIED_STATUSES:
                raise RuntimeError(f"Reward server {self.shown_url} rejected the request (HTTP {status}): {detail}")
            server_error, connection_error = f"HTTP {status}: {detail}", None
        attempts = f"{self.retries + 1} attempt(s)"
        if server_error is not None:
            raise RuntimeError(f"Reward server {self.shown_url} failed to score after {attempts}: {server_error}")
        if isinstance(connection_error, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException)):
            raise TimeoutError(
                f"Reward server {self.shown_url} did not answer within timeout={self.timeout} s (the deadline of each "
                f"attempt: connect, send, score, read) after {attempts}. Raise timeout or lower batch_size."
            )
        raise ConnectionError(
            f"Could not reach the reward server {self.shown_url} after {attempts} ({type(connection_error).__name__}: "
            f"{connection_error}). Is it running and reachable? {SERVER_HINT}"
        )

    def _parse(self, data: bytes) -> Any:
        """The JSON of a 200 answer, or a named error: not JSON, or JSON Python cannot read (nested deeper than its
        recursion limit, an integer of more digits than ``int`` parses)."""
        try:
            return json.loads(data.decode("utf-8"))
        except RecursionError:
            raise RuntimeError(
                f"Reward server {self.shown_url} sent JSON nested too deep to read (past Python's recursion limit, "
                f'{sys.getrecursionlimit()}): a server bug. Answer {{"scores": [...]}} with one number per image.'
            ) from None
        except ValueError as error:  # UnicodeDecodeError and JSONDecodeError too
            raise RuntimeError(f"Reward server {self.shown_url} sent an answer that is not JSON ({error}).") from None

    def _scores(self, answer: Any, count: int) -> list[float | None]:
        """The ``count`` scores of a server's JSON ``answer``, checked."""
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != count:
            shown = repr(answer)[:200]
            raise RuntimeError(f"Reward server {self.shown_url} sent a malformed answer for {count} images: {shown}")
        # A number or null (not applicable), never coerced: "0.5" or true is a server bug, not a score.
        bad = [i for i, score in enumerate(scores) if score is not None and not has_kind(score, float)]
        if bad:
            raise RuntimeError(
                f"Reward server {self.shown_url} sent scores that are not numbers at positions {bad[:10]}: "
                f"{[scores[i] for i in bad[:3]]!r}. Scores must be JSON numbers (or null for not applicable)."
            )
        # An integer too large for a float (400 digits) is no score either (float() would raise a bare OverflowError).
        bad = [i for i, score in enumerate(scores) if score is not None and not _fits_a_float(score)]
        if bad:
            shown = [f"{str(scores[i])[:20]}..." if len(str(scores[i])) > 20 else scores[i] for i in bad[:3]]
            raise RuntimeError(
                f"Reward server {self.shown_url} sent integers too large for a float at positions {bad[:10]}: "
                f"{shown}. Scores must be JSON numbers within a float's range (or null for not applicable)."
            )
        return [None if score is None else float(score) for score in scores]

    async def acall(self, prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float | None]:
        """Score each (prompt, image) pair on the server; JSON-serialisable ``kwargs`` go along as metadata, and an
        editing model's ``source_images`` as base64 PNGs beside the images. The batches of ``batch_size`` images
        are sent one after the other (the server's limits are per request)."""
        check_pairs(prompts, images)
        sources = kwargs.pop("source_images", None)
        kwargs.pop("trainer_state", None)  # not a column: None outside a trainer would reach the server, refused
        if sources is not None and len(sources) != len(images):
            raise ValueError(f"Got {len(sources)} source images for {len(images)} images: give one per image.")
        step = self.batch_size or max(len(images), 1)
        columns = _json_columns(kwargs)
        # Per-sample columns (lists as long as the batch) are split with the batch; others are sent whole.
        split = {key for key, value in columns.items() if isinstance(value, list) and len(value) == len(images)}
        scores: list[float | None] = []
        async with self._client() as client:
            for start in range(0, len(images), step):
                batch = slice(start, start + step)
                metadata = {key: value[batch] if key in split else value for key, value in columns.items()}
                payload = {"prompts": list(prompts[batch]), "images": list(images[batch]), "metadata": metadata}
                if sources is not None:
                    payload["source_images"] = list(sources[batch])
                # Images become base64 PNGs (CPU work) in a worker thread: the shared event loop serves on meanwhile.
                body = await asyncio.to_thread(json.dumps, payload, default=encode_image)
                scores += self._scores(await self._post(client, body), len(payload["images"]))
        return scores

    def __call__(self, prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float | None]:
        """:meth:`acall`'s scores, for a synchronous caller (run on the shared event loop)."""
        return run_on_event_loop(self.acall(prompts, images, **kwargs))

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.shown_url!r}, name={self.__name__!r})"


def _fits_a_float(score: float) -> bool:
    """Whether ``score`` (a JSON number) converts to a float (NaN and infinities do: the output checks name them)."""
    try:
        float(score)
    except OverflowError:
        return False
    return True


def _error_detail(data: bytes) -> str:
    """The server's ``{"error": ...}`` text, shortened; the raw start of the body otherwise."""
    text = data.decode("utf-8", "replace")
    try:
        answer = json.loads(text)
        text = answer["error"] if isinstance(answer, dict) and isinstance(answer.get("error"), str) else text
    except (ValueError, RecursionError):  # not JSON, or JSON too deep to read: its raw start
        pass
    return text[:500]


def remote(
    url: str,
    timeout: float = 120.0,
    retries: int = 3,
    backoff: float = 1.0,
    batch_size: int | None = None,
    name: str | None = None,
    token: str | None = None,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> RemoteReward:
    """A reward computed by an HTTP server (e.g. ``examples/reward_server.py``).

    Args:
        url: The scoring endpoint, e.g. ``"http://localhost:8000/score/pickscore"``. In a config, the URL itself
            can be given in ``reward_funcs``.
        timeout: Seconds one attempt may take in all (connect, send, score, read the answer): a deadline, not a
            per-read timeout.
        retries: Extra attempts after a connection failure, timeout, HTTP 429 or 5xx; waits ``backoff * 2**k`` s,
            or the answer's ``Retry-After`` (at most ``timeout``).
        batch_size: Images per request (``None``: all at once); keep requests under the server's body and pixel
            limits.
        name: Metric name; default ``"remote_<last URL segment>"``.
        token: Shared token sent as ``Authorization: Bearer``; default the ``TRL_JAGG_REWARD_TOKEN`` variable.
        max_response_bytes: Largest answer read; a longer one is an error.
    """
    return RemoteReward(
        url, timeout=timeout, retries=retries, backoff=backoff, batch_size=batch_size, name=name, token=token,
        max_response_bytes=max_response_bytes,
    )  # fmt: skip
