"""A process lost on another node stops the run with an error that names it, the last complete checkpoint and the
resume.

When a process of a multi-process job dies (its node crashes or reboots, the OOM killer, a SIGKILL), the others are
left in their next collective. gloo raises as soon as the dead process's connections close (within tens of
milliseconds of a SIGKILL, measured on one host); a frozen process or an unreachable machine keeps them waiting until
the process group's timeout, ``ddp_timeout`` (1800 s by default), after which torch raises. Neither error says which
process is gone. So while ``train()`` runs, :class:`PeerWatch` makes every process add to its own counter in the
rendezvous store (the c10d ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` that torchrun and ``accelerate launch`` start)
from a thread, every :data:`HEARTBEAT_INTERVAL` seconds. When ``train()`` raises, :func:`peers_watched` watches the
counters for :data:`SILENCE_WINDOW` seconds: the processes whose counter did not move and that did not sign off are
the lost ones, and :class:`~trl_jagg.utils.errors.PeerLost` names them with their node. If the store itself is gone,
the lost node is the one that hosted it, node 0 (torchrun's agent there, or rank 0 without torchrun).

Nothing is saved on that path: every save starts with a collective, which the lost process never joins, and a
``checkpoint-N`` folder appears only once complete (:func:`~trl_jagg.trainer.checkpointing.atomic_checkpoint`), so
the last one on disk is whole.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from transformers.trainer_utils import get_last_checkpoint

from trl_jagg.utils.errors import PeerLost

HEARTBEAT_INTERVAL = 0.5
"""Seconds between two beats of a process."""

SILENCE_WINDOW = 3.0
"""Seconds a process's counter is watched after ``train()`` raised: a process that did not beat in that time (six
beats) and did not sign off is lost. It is also the timeout of each store request."""

FINISHED, FAILED, LEFT = 1, 2, 3
"""How a process signs off: ``train()`` returned; it raised an error of its own; it raised because it lost others."""

_CALLS = itertools.count()  # train() calls of this process: every process makes the same ones, in the same order


class PeerWatch:
    """The heartbeat of this process and the view of the others' (one per ``train()`` call).

    Args:
        store: a client of the job's rendezvous store.
        rank: this process's global rank.
        world_size: the processes of the job.
        local_world_size: the processes per node (torchrun numbers the ranks node by node).
        prefix: the store keys of this ``train()`` call.
    """

    def __init__(self, store: Any, rank: int, world_size: int, local_world_size: int, prefix: str):
        self.store, self.rank, self.world_size, self.local_world_size = store, rank, world_size, local_world_size
        self.prefix = prefix
        self.store_error: Exception | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="trl-jagg-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls) -> PeerWatch | None:
        """The watch of this process's ``train()``, or ``None`` without several processes or without a store
        address (``MASTER_ADDR`` / ``MASTER_PORT``, which torchrun, ``accelerate launch`` and Slurm recipes set)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if not address or not port.isdigit():
            return None
        store = dist.TCPStore(
            address, int(port), is_master=False, timeout=timedelta(seconds=SILENCE_WINDOW), wait_for_workers=False
        )
        world_size = dist.get_world_size()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"trl_jagg/peers/{attempt}/{next(_CALLS)}"
        return cls(store, dist.get_rank(), world_size, local_world_size, prefix)

    def node(self, rank: int) -> int:
        """The node of ``rank``: torchrun gives node ``n`` the ranks ``n * local_world_size ...``."""
        return rank // self.local_world_size

    def _beat(self) -> None:
        while not self._stopped.is_set():
            try:
                self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
            except Exception as error:  # the store's host is gone (or unreachable): nothing more to beat into
                self.store_error = error
                return
            self._stopped.wait(HEARTBEAT_INTERVAL)

    def stop(self, status: int) -> None:
        """Stop beating and sign off with ``status`` (:data:`FINISHED`, :data:`FAILED` or :data:`LEFT`), so that
        the others do not count this process as lost when it leaves before them."""
        self._stopped.set()
        self._thread.join()
        with contextlib.suppress(Exception):
            self.store.add(f"{self.prefix}/done/{self.rank}", status)

    def _marks(self) -> list[tuple[int, int]]:
        """Each process's ``(beats, sign-off status)`` (``add(key, 0)`` reads a counter without waiting for it)."""
        return [
            (self.store.add(f"{self.prefix}/beat/{r}", 0), self.store.add(f"{self.prefix}/done/{r}", 0))
            for r in range(self.world_size)
        ]

    def peers_down(self, window: float = SILENCE_WINDOW) -> tuple[list[int], list[int]]:
        """``(lost, failed)``: the other processes that neither beat during ``window`` seconds nor signed off, and
        those that had already signed off after an error of their own; the ranks of the store's host when the store cannot be
        reached (node 0 under torchrun, whose agent hosts it; rank 0 otherwise)."""
        try:
            if self.store_error is not None:
                raise self.store_error
            first = self._marks()
            time.sleep(window)
            last = self._marks()
        except Exception:
            host = range(self.local_world_size if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 1)
            return [r for r in host if r != self.rank], []
        others = [r for r in range(self.world_size) if r != self.rank]
        lost = [r for r in others if first[r][0] == last[r][0] and not last[r][1]]
        # Signed off FAILED before this process raised: the error here follows from it (one raised alike on every
        # process, e.g. a reward's, signs off after the window, and is no one's fault but its own).
        return lost, [r for r in others if first[r][1] == FAILED]


def lost_message(
    watch: PeerWatch, lost: list[int], failed: list[int], step: int, output_dir: str, saves: bool, cause: Exception
) -> str:
    """The one line :class:`~trl_jagg.utils.errors.PeerLost` says: which ranks (and nodes) were lost or failed
    during which step, the error this process got, the last complete checkpoint and the resume."""

    def named(ranks: list[int]) -> str:
        return ", ".join(f"rank {r} (node {watch.node(r)})" for r in ranks)

    what = []
    if lost:
        what.append(f"lost {named(lost)}: its process ended or stopped answering")
    if failed:
        what.append(f"{named(failed)} stopped with an error of its own (its output says which)")
    reason = " ".join(str(cause).split())[:200]
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
    return (
        f"{'; '.join(what)}, during optimizer step {step + 1} (this process got {type(cause).__name__}: {reason}); "
        f"{checkpoint}."
    )


@contextlib.contextmanager
def peers_watched(output_dir: str, saves: bool, global_step: Callable[[], int]) -> Iterator[None]:
    """Run the block (``Trainer.train``) with this process's heartbeat; if it raises while another process is lost
    (or failed first), raise :class:`~trl_jagg.utils.errors.PeerLost` instead, after :data:`SILENCE_WINDOW` seconds
    of watching. The other errors pass unchanged, as late.

    Args:
        output_dir: the run's folder, where the last complete checkpoint is looked for.
        saves: whether this process writes checkpoints (``TrainingArguments.should_save``).
        global_step: the optimizer steps completed so far (read when the block raises).
    """
    watch = PeerWatch.start()
    status = FAILED
    try:
        yield
        status = FINISHED
    except Exception as error:
        lost, failed = watch.peers_down() if watch is not None else ([], [])
        if not (lost or failed):
            raise
        status = LEFT
        message = lost_message(watch, lost, failed, global_step(), output_dir, saves, error)
        raise PeerLost(message, lost + failed, [watch.node(r) for r in lost + failed]) from error
    finally:
        if watch is not None:
            watch.stop(status)
