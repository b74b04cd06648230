"""A reward scored by an HTTP server, so that large reward models can run on other GPUs or machines.

Protocol (JSON over ``POST``, see ``examples/reward_server.py``)::

    request:  {"prompts": [str, ...], "images": [base64 PNG, ...], "metadata": {column: [value, ...]}}
    response: {"scores": [float, ...]}            (or {"error": str} with an HTTP error status)
"""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from PIL import Image

from trl_jagg.rewards.lazy import check_pairs, to_rgb

SERVER_HINT = "Start one with: python examples/reward_server.py --rewards pickscore --port 8000"


def encode_image(image: Image.Image) -> str:
    """``image`` as a base64 PNG string (lossless, so the server scores exactly the generated pixels)."""
    buffer = io.BytesIO()
    to_rgb(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(data: str) -> Image.Image:
    """Inverse of :func:`encode_image`."""
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


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


class RemoteReward:
    """Posts (prompts, images) to ``url`` and returns the server's scores. Connection failures, timeouts and
    HTTP 5xx answers are retried with exponential backoff; HTTP 4xx answers are not (resending cannot help)."""

    def __init__(
        self,
        url: str,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 1.0,
        batch_size: int | None = None,
        name: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"The reward server URL must start with http:// or https://, got {url!r}.")
        if retries < 0 or timeout <= 0:
            raise ValueError("timeout must be > 0 and retries >= 0.")
        self.url = url
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.batch_size = batch_size
        last_segment = urllib.parse.urlparse(url).path.rstrip("/").rsplit("/", 1)[-1]
        self.__name__ = name or (f"remote_{last_segment}" if last_segment else "remote")

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(payload).encode("utf-8")
        server_error: str | None = None  # the last HTTP 5xx answer: the server is up but the reward failed
        connection_error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read().decode("utf-8"))
            except urllib.error.HTTPError as error:  # caught before URLError, its base class
                detail = error.read().decode("utf-8", "replace")[:2000]
                if error.code < 500:
                    raise RuntimeError(
                        f"Reward server {self.url} rejected the request (HTTP {error.code}): {detail}"
                    ) from error
                server_error, connection_error = f"HTTP {error.code}: {detail}", None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                server_error, connection_error = None, error
        attempts = f"{self.retries + 1} attempt(s)"
        if server_error is not None:
            raise RuntimeError(f"Reward server {self.url} failed to score after {attempts}: {server_error}")
        raise ConnectionError(
            f"Could not reach the reward server {self.url} after {attempts} ({connection_error}). "
            f"Is it running and reachable? {SERVER_HINT}"
        )

    def _score(self, prompts: list[str], images: list[Image.Image], metadata: dict[str, Any]) -> list[float | None]:
        answer = self._post({"prompts": prompts, "images": [encode_image(im) for im in images], "metadata": metadata})
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != len(images):
            raise RuntimeError(f"Reward server {self.url} sent a malformed answer for {len(images)} images: {answer}")
        return [None if score is None else float(score) for score in scores]

    def __call__(self, prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float | None]:
        """Score each (prompt, image) pair on the server; JSON-serialisable ``kwargs`` go along as metadata."""
        check_pairs(prompts, images)
        step = self.batch_size or max(len(images), 1)
        columns = _json_columns(kwargs)
        scores: list[float | None] = []
        for start in range(0, len(images), step):
            # Per-sample columns (lists as long as the batch) are split with the batch; others are sent whole.
            metadata = {
                key: value[start : start + step] if isinstance(value, list) and len(value) == len(images) else value
                for key, value in columns.items()
            }
            scores.extend(
                self._score(list(prompts[start : start + step]), list(images[start : start + step]), metadata)
            )
        return scores

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.url!r}, name={self.__name__!r})"


def remote(
    url: str,
    timeout: float = 120.0,
    retries: int = 3,
    backoff: float = 1.0,
    batch_size: int | None = None,
    name: str | None = None,
) -> RemoteReward:
    """A reward computed by an HTTP server (e.g. ``examples/reward_server.py``).

    Args:
        url: The scoring endpoint, e.g. ``"http://localhost:8000/score/pickscore"``. In a config, the URL itself
            can be given in ``reward_funcs``.
        timeout: Seconds to wait for one answer.
        retries: Extra attempts after a connection failure, timeout or HTTP 5xx; waits ``backoff * 2**k`` s.
        batch_size: Images per request (``None``: all at once).
        name: Metric name; default ``"remote_<last URL segment>"``.
    """
    return RemoteReward(url, timeout=timeout, retries=retries, backoff=backoff, batch_size=batch_size, name=name)
