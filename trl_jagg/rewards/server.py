"""The reward server: trl_jagg rewards served over the JSON protocol of :mod:`~trl_jagg.rewards.remote` by the
Starlette app of :mod:`~trl_jagg.rewards.server_app` on uvicorn (``pip install "trl-jagg[server]"``). Run it with
``examples/reward_server.py``; in code::

    server = build_server({"pickscore": pickscore()}, port=8000, limits=Limits(token="..."))
    server.serve_forever()  # or server.start() ... server.close() to serve from a background thread

What each limit of :class:`~trl_jagg.rewards.server_app.Limits` is enforced by:

- uvicorn's own settings: the request line and headers in at most 64 KiB (``h11_max_incomplete_event_size``, else
  HTTP 400); a malformed request, a bad or doubled ``Content-Length`` (h11: HTTP 400); no WebSocket upgrade, no
  proxy header trusted;
- this module's protocol, on uvicorn's h11 protocol, for what uvicorn has no setting for (its ``timeout_keep_alive``
  only times idle connections between requests): the request line and headers must arrive within
  ``header_timeout`` of the connection (else HTTP 408 and the connection closed), and at most ``max_pending``
  connections may be sending headers (past it the oldest is closed). A connection waiting for its headers costs
  no thread and no request slot; it tells the app when it arrived, from which the app counts ``request_timeout``;
- the app (:mod:`~trl_jagg.rewards.server_app`): the token, the request slots, the body's size and deadline, the
  JSON fields, the image formats and pixels, the pixel budget and the reward's output.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

SERVER_STACK = ("starlette", "uvicorn", "h11")
"""The packages of the ``[server]`` extra (h11 comes with uvicorn)."""

try:
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from trl_jagg.rewards.server_app import ARRIVED, Limits, build_app
except ModuleNotFoundError as missing:  # the [server] extra is not installed: say so in one line
    package = (missing.name or "").partition(".")[0]
    if package not in SERVER_STACK:
        raise
    raise ModuleNotFoundError(
        f'The reward server runs on Starlette and uvicorn, and {package} is not installed: pip install "trl-jagg[server]"',
        name=package,
    ) from None

__all__ = ["Limits", "RewardServer", "build_server"]

MAX_HEAD_BYTES = 64 * 2**10
"""Request line and headers."""


def connection_limits(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for the request line and headers (``limits.header_timeout``, at most
    ``limits.request_timeout``) and at most ``limits.max_pending`` connections sending them."""
    pending: dict[H11Protocol, None] = {}  # connections whose headers are still arriving, the oldest first
    header_timeout = min(limits.header_timeout, limits.request_timeout)
    late = json.dumps({"error": f"The headers did not arrive within {header_timeout:g} s."}).encode()
    # Written as is: the request was never parsed, so h11 (which answers parsed requests only) cannot send it.
    late_answer = (
        b"HTTP/1.0 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(late)}\r\n\r\n".encode()
        + late
    )

    class ConnectionLimits(H11Protocol):
        def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any], _loop: Any = None):
            # Each request's scope["state"] copies app_state: the app reads the connection's arrival there.
            super().__init__(config, server_state, {**app_state, ARRIVED: time.monotonic()}, _loop)
            self._header_deadline: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._header_deadline = self.loop.call_later(header_timeout, self._refuse_late_headers)
            pending[self] = None
            if len(pending) > limits.max_pending:
                oldest = next(iter(pending))
                oldest._headers_done()
                oldest.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in (or were refused)
                self._headers_done()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            super().connection_lost(exc)

        def _headers_done(self) -> None:
            pending.pop(self, None)
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _refuse_late_headers(self) -> None:
            self._headers_done()
            self.transport.write(late_answer)
            self.transport.close()

    return ConnectionLimits


class RewardServer:
    """uvicorn serving a reward app on a socket bound and listening from construction (so that ``port=0`` has its
    port at once, in :attr:`server_address`)."""

    def __init__(self, app: Callable[..., Any], host: str, port: int, limits: Limits) -> None:
        config = uvicorn.Config(
            app, host=host, port=port, http=connection_limits(limits), ws="none", lifespan="off",
            h11_max_incomplete_event_size=MAX_HEAD_BYTES, proxy_headers=False, log_config=None,
        )  # fmt: skip
        self.socket = config.bind_socket()
        self.socket.listen(config.backlog)  # connections queue from now on, before the event loop starts
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`close` (from another thread), or SIGINT / SIGTERM in the main thread
        (the requests in flight are answered first)."""
        self._server.run(sockets=[self.socket])

    def start(self) -> RewardServer:
        """Serve from a daemon thread; returns the server."""
        self._thread = threading.Thread(target=self.serve_forever, name="reward-server", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving (waiting at most ``timeout`` seconds for the requests in flight) and close the socket."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.socket.close()


def build_server(
    rewards: Mapping[str, Callable[..., Any]], host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None
) -> RewardServer:
    """A server for ``rewards`` (name -> reward function) on ``host`` (loopback by default); ``port=0`` picks a free
    port (see ``server.server_address``)."""
    limits = limits if limits is not None else Limits()
    return RewardServer(build_app(rewards, limits), host, port, limits)
