"""A process lost on another node stops the run with an error that names it, the last complete checkpoint and the
resume.

When a process of a multi-process job dies (its node crashes or reboots, the OOM killer, a SIGKILL), the others are
left in their next collective. gloo raises as soon as the dead process's connections close (within tens of
milliseconds of a SIGKILL, measured on one host); a frozen process or an unreachable machine closes nothing, and the
collective waits for the process group's timeout, 30 minutes by default (transformers passes ``ddp_timeout`` to it
on GPUs, not under ``use_cpu``). Neither error says which process is gone.

So while ``train()`` runs, :class:`PeerWatch` makes every process add to its own counter in the rendezvous store (the
c10d ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` that torchrun and ``accelerate launch`` start) from a thread, every
:data:`HEARTBEAT_INTERVAL` seconds, and read the counter of the next rank:

- when ``train()`` raises, :func:`peers_watched` reads every counter for :data:`SILENCE_WINDOW` seconds: the processes
  whose counter did not move and that did not sign off are the lost ones, and it raises
  :class:`~trl_jagg.utils.errors.PeerLost` naming them with their node;
- when the next rank's counter stays still for ``ddp_timeout`` seconds (it froze, or its machine is unreachable, and
  this process may be waiting for it in a collective that nothing ends), the thread prints the same error and ends
  the process; the others' collectives then fail, and they name the frozen rank as above.

If the store itself is gone, the lost node is the one that hosted it, node 0 (torchrun's agent there, or rank 0
without torchrun). Nothing is saved on these paths: every save starts with a collective, which the lost process
never joins, and a ``checkpoint-N`` folder appears only once complete
(:func:`~trl_jagg.trainer.checkpointing.atomic_checkpoint`), so the last one on disk is whole.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from transformers.trainer_utils import get_last_checkpoint

from trl_jagg.utils.errors import PeerLost

HEARTBEAT_INTERVAL = 0.5
"""Seconds between two beats of a process."""

SILENCE_WINDOW = 3.0
"""Seconds every counter is watched after ``train()`` raised: a process that did not beat in that time (six beats)
and did not sign off is lost. It is also the timeout of each store request."""

FINISHED, FAILED, LEFT = 1, 2, 3
"""How a process signs off: ``train()`` returned; it raised an error of its own; it left because it lost others."""

LOST_EXIT_CODE = 1
"""The exit status of a process that its heartbeat thread ends (as ``trl-jagg``'s for an error)."""

_CALLS = itertools.count()  # train() calls of this process: every process makes the same ones, in the same order


class PeerWatch:
    """The heartbeat of this process, and the view of the others' (one per ``train()`` call).

    Args:
        store: a client of the job's rendezvous store.
        rank: this process's global rank.
        world_size: the processes of the job.
        local_world_size: the processes per node (torchrun numbers the ranks node by node).
        prefix: the store keys of this ``train()`` call.
        silence_timeout: seconds the next rank's counter (or the store) may stay silent before ``on_silence`` is
            called with the ranks lost (``None``: never).
        on_silence: what to do then, in the heartbeat thread (:func:`peers_watched` ends the process).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        local_world_size: int,
        prefix: str,
        silence_timeout: float | None = None,
        on_silence: Callable[[list[int]], None] | None = None,
    ):
        self.store, self.rank, self.world_size, self.local_world_size = store, rank, world_size, local_world_size
        self.prefix, self.silence_timeout, self.on_silence = prefix, silence_timeout, on_silence
        self.store_error: Exception | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="trl-jagg-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls, silence_timeout: float | None = None, on_silence: Callable[[list[int]], None] | None = None
    ) -> PeerWatch | None:
        """The watch of this process's ``train()`` (see :class:`PeerWatch` for the arguments), or ``None`` without
        several processes or without a store address (``MASTER_ADDR`` / ``MASTER_PORT``, which torchrun and
        ``accelerate launch`` set)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if not address or not port.isdigit():
            return None
        try:
            store = dist.TCPStore(
                address, int(port), is_master=False, timeout=timedelta(seconds=SILENCE_WINDOW), wait_for_workers=False
            )
        except Exception as error:  # e.g. a process group started from a file: whatever listens there is no store
            warnings.warn(
                f"No rendezvous store answers at MASTER_ADDR:MASTER_PORT ({address}:{port}: {type(error).__name__}): "
                "a process lost during training will not be named.",
                stacklevel=2,
            )
            return None
        world_size = dist.get_world_size()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        prefix = f"trl_jagg/peers/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_CALLS)}"
        return cls(store, dist.get_rank(), world_size, local_world_size, prefix, silence_timeout, on_silence)

    def node(self, rank: int) -> int:
        """The node of ``rank``: torchrun gives node ``n`` the ranks ``n * local_world_size ...``."""
        return rank // self.local_world_size

    def _beat(self) -> None:
        """Beat; watch the next rank's counter (two reads a beat, whatever the number of processes) and the store."""
        watched = (self.rank + 1) % self.world_size
        seen: tuple[int, int] | None = None
        heard = store_heard = time.monotonic()
        while True:
            now = time.monotonic()
            if self.store_error is None:
                try:
                    self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
                    marks = self._marks_of(watched)
                except Exception as error:  # the store's host is gone, or does not answer
                    self.store_error = error
                else:
                    store_heard = now
                    if marks != seen:
                        seen, heard = marks, now
            lost = self._silent(now - heard, now - store_heard, watched, signed_off=bool(seen and seen[1]))
            if lost:
                self.on_silence(lost)
                return
            if self._stopped.wait(HEARTBEAT_INTERVAL):
                return

    def _silent(self, quiet: float, store_quiet: float, watched: int, signed_off: bool) -> list[int]:
        """The ranks lost once ``watched`` (or the store) has been quiet for longer than ``silence_timeout``."""
        if self.silence_timeout is None or self.on_silence is None:
            return []
        if self.store_error is not None:
            return self.store_host_ranks() if store_quiet > self.silence_timeout else []
        return [watched] if quiet > self.silence_timeout and not signed_off else []

    def sign_off(self, status: int) -> None:
        """Say how this process leaves (:data:`FINISHED`, :data:`FAILED` or :data:`LEFT`), so that the others do not
        count it as lost when it leaves before them."""
        if self.store_error is None:
            with contextlib.suppress(Exception):
                self.store.add(f"{self.prefix}/done/{self.rank}", status)

    def stop(self, status: int) -> None:
        """Stop beating and :meth:`sign_off` with ``status``."""
        self._stopped.set()
        self._thread.join()
        self.sign_off(status)

    def _marks_of(self, rank: int) -> tuple[int, int]:
        """``rank``'s ``(beats, sign-off status)`` (``add(key, 0)`` reads a counter without waiting for it)."""
        return self.store.add(f"{self.prefix}/beat/{rank}", 0), self.store.add(f"{self.prefix}/done/{rank}", 0)

    def store_host_ranks(self) -> list[int]:
        """The other ranks lost with the store: node 0's under torchrun (its agent hosts it), else rank 0."""
        host = range(self.local_world_size if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 1)
        return [r for r in host if r != self.rank]

    def peers_down(self, window: float | None = None) -> tuple[list[int], list[int]]:
        """``(lost, failed)``: the other processes that neither beat during ``window`` seconds (default:
        :data:`SILENCE_WINDOW`) nor signed off, and those that had already signed off after an error of their own;
        :meth:`store_host_ranks` when the store cannot be reached."""
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            if self.store_error is not None:
                raise self.store_error
            first = {r: self._marks_of(r) for r in others}
            time.sleep(SILENCE_WINDOW if window is None else window)
            last = {r: self._marks_of(r) for r in others}
        except Exception:
            return self.store_host_ranks(), []
        lost = [r for r in others if first[r][0] == last[r][0] and not last[r][1]]
        # Signed off FAILED before this process raised: the error here follows from it (one raised alike on every
        # process, e.g. a reward's, signs off after the window, and is no one's fault but its own).
        return lost, [r for r in others if first[r][1] == FAILED]


def lost_message(
    watch: PeerWatch, lost: list[int], failed: list[int], step: int, output_dir: str, saves: bool, cause: str
) -> str:
    """The one line :class:`~trl_jagg.utils.errors.PeerLost` says: which ranks (and nodes) were lost or failed
    during which step, what this process saw (``cause``), the last complete checkpoint and the resume."""

    def named(ranks: list[int]) -> str:
        return ", ".join(f"rank {r} (node {watch.node(r)})" for r in ranks)

    what = []
    if lost:
        what.append(f"lost {named(lost)}: its process ended or stopped answering")
    if failed:
        what.append(f"{named(failed)} stopped with an error of its own (its output says which)")
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is not None:
        checkpoint = (
            f"last complete checkpoint: {last}; resume with `--resume_from_checkpoint {last}` "
            f"(`trainer.train(resume_from_checkpoint={last!r})`) on every node, with the same config"
        )
    elif saves:
        checkpoint = f"no checkpoint was saved in {output_dir} yet: start the run again"
    else:  # checkpoints are written on node 0 only (save_on_each_node=False), maybe on a disk this node cannot see
        checkpoint = f"the last complete checkpoint is the latest checkpoint-N of {output_dir} on node 0"
    cause = " ".join(cause.split())[:240]
    return f"{'; '.join(what)}, during optimizer step {step + 1} ({cause}); {checkpoint}."


@contextlib.contextmanager
def peers_watched(args: Any, global_step: Callable[[], int]) -> Iterator[None]:
    """Run the block (``Trainer.train``) with this process's heartbeat. If it raises while another process is lost
    (or failed first), raise :class:`~trl_jagg.utils.errors.PeerLost` instead, after :data:`SILENCE_WINDOW` seconds
    of watching (the other errors pass unchanged, as late); if the next rank stays silent for ``args.ddp_timeout``
    seconds, print that error and end the process (status :data:`LOST_EXIT_CODE`), whatever the block waits for.

    Args:
        args: the run's ``TrainingArguments``: ``output_dir`` (where the last complete checkpoint is looked for),
            ``should_save`` (whether this process writes checkpoints) and ``ddp_timeout``.
        global_step: the optimizer steps completed so far.
    """

    def message(lost: list[int], failed: list[int], cause: str) -> str:
        return lost_message(watch, lost, failed, global_step(), args.output_dir, args.should_save, cause)

    def end_process(lost: list[int]) -> None:  # in the heartbeat thread: the main one may wait in C++ for ever
        cause = f"no heartbeat for ddp_timeout={args.ddp_timeout} s; this process was waiting for it"
        print(f"{PeerLost.__name__}: {message(lost, [], cause)}", file=sys.stderr, flush=True)
        watch.sign_off(LEFT)
        os._exit(LOST_EXIT_CODE)

    watch = PeerWatch.start(args.ddp_timeout, end_process)
    status = FAILED
    try:
        yield
        status = FINISHED
    except Exception as error:
        lost, failed = watch.peers_down() if watch is not None else ([], [])
        if not (lost or failed):
            raise
        status = LEFT
        cause = f"this process got {type(error).__name__}: {error}"
        raise PeerLost(message(lost, failed, cause), lost + failed, [watch.node(r) for r in lost + failed]) from error
    finally:
        if watch is not None:
            watch.stop(status)
