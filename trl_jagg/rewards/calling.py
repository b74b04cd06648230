"""Calling one reward: ``async def`` rewards on one shared event loop, retries, and a deadline.

A reward that never returns would otherwise hang the run forever and lose every step since the last checkpoint. Every
reward has a deadline (``GRPOJaggConfig.reward_timeout``, by default :data:`DEFAULT_REWARD_TIMEOUT`; ``None`` turns
it off): a call that is still running when it expires is abandoned and :class:`RewardTimeout` is raised instead:

- an async reward's coroutine (an ``async def`` reward's, or the ``acall`` of the remote reward and the VLM judges,
  whose request in flight is then closed) is cancelled (it stops at its next ``await``);
- a synchronous reward cannot be interrupted in Python, so under a deadline it runs in a daemon thread of its own and
  the caller stops waiting. The abandoned call keeps running until it returns (its result is dropped) or the process
  exits; a daemon thread does not hold the exit up.

Without a deadline a synchronous reward runs in the caller's thread, as it always did.

A stop signal (SIGINT / SIGTERM, :mod:`~trl_jagg.trainer.interrupts`) that arrives while a reward runs abandons it the
same way, with :class:`RewardInterrupted`: the trainer then saves the steps trained so far, as after a deadline. A
synchronous reward without a deadline (``reward_timeout=None``) runs in the caller's thread and cannot be abandoned:
the run stops when it returns, or at a second signal.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future, wait
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_REWARD_TIMEOUT = 900.0
"""The default deadline (seconds) of every reward's scoring of one batch (``reward_timeout``). Generous: longer than
the remote reward's and the VLM judges' own default attempts take in all (4 x 120 s plus backoffs), so their own, more
precise error comes first; shorter than the process group's 30-minute timeout, so that on several processes the
others, waiting for the one whose reward hangs, stop at its deadline instead of at the collective's timeout."""

TIMEOUT_FIX = (
    "Fix what the reward waits on (a server, a lock, a device), make it faster or score fewer images per call "
    "(sample_batch_size, per_device_eval_batch_size), or raise reward_timeout."
)


SIGNAL_POLL_S = 0.1
"""How often a wait on a reward looks for a stop signal (signal handlers may only set a flag, not wake a waiter)."""


class RewardAbandoned(Exception):
    """A reward's call was abandoned (its deadline passed, or a stop signal arrived while it ran). Not retried
    (``reward_retries``): the abandoned call may still be running, and a retry would wait as long again."""


class RewardTimeout(RewardAbandoned, TimeoutError):
    """A reward did not return within its deadline (see :class:`RewardAbandoned`)."""

    def __init__(self, name: str, timeout: float):
        super().__init__(
            f"Reward {name!r} did not return within reward_timeout={timeout:g} s; its call was abandoned (an async "
            f"reward is cancelled, a synchronous one is left running in a daemon thread). {TIMEOUT_FIX}"
        )
        self.name, self.timeout = name, timeout


class RewardInterrupted(RewardAbandoned):
    """A stop signal (``signal_number``) arrived while a reward ran: its call was abandoned as at a deadline."""

    def __init__(self, name: str, signal_number: int):
        super().__init__(
            f"Reward {name!r} was abandoned: {signal.Signals(signal_number).name} arrived while it was scoring."
        )
        self.name, self.signal_number = name, signal_number


_stop_signals = 0
"""Stop signals received so far: a wait abandons its reward when this grows (only assigned in a signal handler)."""
_last_stop_signal = 0


def abandon_rewards_in_flight(signal_number: int) -> None:
    """Abandon every reward call now in flight, with :class:`RewardInterrupted` naming ``signal_number``. Safe in a
    signal handler: it only assigns two numbers, which the waits read."""
    global _stop_signals, _last_stop_signal
    _last_stop_signal = signal_number
    _stop_signals += 1


def _finished(future: Future, name: str, remaining: float | None, signals_before: int) -> bool:
    """Whether ``future`` finished within ``remaining`` seconds (``None``: no limit); a stop signal received since
    ``signals_before`` cancels it and raises :class:`RewardInterrupted`."""
    deadline = None if remaining is None else time.monotonic() + remaining
    poll = SIGNAL_POLL_S if remaining is None else min(SIGNAL_POLL_S, remaining)
    # `wait`, not `result(timeout)`: a reward's own TimeoutError (a server's) must not read as the deadline.
    while not wait([future], timeout=poll).done:
        if _stop_signals != signals_before:
            future.cancel()  # cancels an async reward's task; a thread's call runs on
            raise RewardInterrupted(name, _last_stop_signal)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        poll = SIGNAL_POLL_S if left is None else min(SIGNAL_POLL_S, left)
    return True


def reward_deadline(func: Callable[..., Any], reward_timeout: float | None) -> float | None:
    """The deadline of ``func`` in seconds: ``reward_timeout`` (the same for every reward, local callables included;
    ``None``: no deadline)."""
    return None if reward_timeout is None else float(reward_timeout)


def coroutine_function(func: Callable[..., Any]) -> Callable[..., Awaitable[Any]] | None:
    """What an async caller awaits to score with ``func``: ``func`` itself when calling it returns a coroutine (an
    ``async def`` function, a ``functools.partial`` of one, or an object with an ``async def __call__``: the forms
    ``trl.trainer.utils.is_async_callable`` accepts; importing trl here would cost every reward user its import
    time); the ``async def acall`` of a reward that also has a synchronous ``__call__`` (the remote reward and the
    VLM judges); ``None`` for a synchronous reward."""
    acall = getattr(func, "acall", None)
    if inspect.iscoroutinefunction(acall):
        return acall
    inner = func
    while isinstance(inner, functools.partial):
        inner = inner.func
    return func if inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(type(inner).__call__) else None


def is_async_reward(func: Callable[..., Any]) -> bool:
    """Whether ``func`` can be awaited (:func:`coroutine_function`): it then runs on the shared event loop, and a
    deadline cancels it."""
    return coroutine_function(func) is not None


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for every async reward of the process, running in a daemon thread (as TRL's GRPOTrainer
    does): clients that bind to a loop (an ``AsyncOpenAI`` connection pool) keep working across steps, and a caller
    inside its own running loop (a notebook) is not blocked by ``asyncio.run``."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="trl-jagg-async-rewards", daemon=True).start()
            _loop = loop
        return _loop


def run_on_event_loop(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """``coroutine``'s result, run on the shared event loop, for a synchronous caller (a reward with both forms,
    called); interrupting the wait cancels it.

    Raises:
        RuntimeError: when called from the loop's own thread (an async reward calling one synchronously would wait on
            itself forever): await its ``acall`` there instead.
    """
    loop = _event_loop()
    try:
        inside = asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        inside = False
    if inside:
        coroutine.close()
        raise RuntimeError("A reward was called synchronously inside an async reward: `await reward.acall(...)`.")
    future = asyncio.run_coroutine_threadsafe(coroutine, loop)
    try:
        return future.result()
    except BaseException:
        future.cancel()  # a KeyboardInterrupt must not leave the request running on the loop
        raise


def _in_daemon_thread(func: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> Future:
    """``func(**kwargs)`` started in a daemon thread of its own, which nothing joins (an executor's threads are joined
    at exit, so a call that never returns would hold the exit up); the grad mode is the caller's (it is per thread)."""
    outcome: Future = Future()
    grad_enabled = torch.is_grad_enabled()

    def run() -> None:
        if not outcome.set_running_or_notify_cancel():  # abandoned before it started
            return
        try:
            with torch.set_grad_enabled(grad_enabled):
                outcome.set_result(func(**kwargs))
        except BaseException as error:  # handed to the caller, as an executor does
            outcome.set_exception(error)

    threading.Thread(target=run, name=f"reward-{name}", daemon=True).start()
    return outcome


def call_within(
    func: Callable[..., Any], name: str, remaining: float | None, timeout: float | None = None, /, **kwargs: Any
) -> Any:
    """``func(**kwargs)`` (an async reward's coroutine run to its end on the shared event loop), or
    :class:`RewardTimeout` naming ``name`` and ``timeout`` (default ``remaining``) when it has not returned after
    ``remaining`` seconds (``None``: no deadline); see the module docstring for what happens to the abandoned call."""
    timeout = remaining if timeout is None else timeout
    signals_before = _stop_signals
    awaited = coroutine_function(func)
    if awaited is not None:
        future: Future = asyncio.run_coroutine_threadsafe(awaited(**kwargs), _event_loop())
    elif remaining is None:
        return func(**kwargs)
    else:
        future = _in_daemon_thread(func, name, kwargs)
    if not _finished(future, name, remaining, signals_before):
        future.cancel()  # cancels an async reward's task; a thread's call runs on
        raise RewardTimeout(name, timeout if timeout is not None else math.inf)
    return future.result()


def call_with_retries(
    func: Callable[..., Any], name: str, retries: int, timeout: float | None, /, **kwargs: Any
) -> Any:
    """``func(**kwargs)``, called again up to ``retries`` times when it raises (each retry logged), all attempts
    within ``timeout`` seconds from now (``None``: no deadline). An abandoned call (:class:`RewardAbandoned`: a
    deadline, a stop signal) is not retried."""
    deadline = None if timeout is None else time.monotonic() + timeout
    attempt = 0
    while True:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            return call_within(func, name, remaining, timeout, **kwargs)
        except RewardAbandoned:
            raise
        except Exception as error:
            if attempt == retries:
                raise
            attempt += 1
            logger.warning("Reward %r raised %s: %s. Retry %d of %d.", name, type(error).__name__, error, attempt,
                           retries)  # fmt: skip
