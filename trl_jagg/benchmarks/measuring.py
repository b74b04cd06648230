"""What the benchmarks measure with: backbone calls counted by hooks, peak memory, the clock (CPU time on a CPU,
synchronised wall time on an accelerator), the spread of per-repeat figures and an endless supply of rollout
inputs. Shared by the trainer, whole-step and GPU benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch


class BackboneCallCounter:
    """Counts backbone work by hooks: policy forwards with and without an autograd graph, reference forwards (the
    frozen copy, or the policy with its LoRA adapters disabled) and ``accelerator.backward`` calls.

    Use as a context manager around the work to count; :meth:`take` returns and resets the counts.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.counts = dict.fromkeys(("graph_forwards", "no_grad_forwards", "reference_forwards", "backward_calls"), 0)
        self._handles: list[Any] = []
        self._backward: Callable | None = None

    def __enter__(self) -> BackboneCallCounter:
        from peft.tuners.tuners_utils import BaseTunerLayer

        policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
        lora_layer = next((m for m in policy.modules() if isinstance(m, BaseTunerLayer)), None)

        def on_policy(module: torch.nn.Module, args: Any, output: Any) -> None:
            if lora_layer is not None and lora_layer.disable_adapters:
                self.counts["reference_forwards"] += 1
            elif torch.is_grad_enabled():
                self.counts["graph_forwards"] += 1
            else:
                self.counts["no_grad_forwards"] += 1

        def on_reference(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.counts["reference_forwards"] += 1

        self._handles.append(policy.register_forward_hook(on_policy))
        if self.trainer.ref_transformer is not None:
            self._handles.append(self.trainer.ref_transformer.register_forward_hook(on_reference))
        accelerator = self.trainer.accelerator
        self._backward = accelerator.backward

        def counting_backward(loss: torch.Tensor, **kwargs: Any) -> None:
            self.counts["backward_calls"] += 1
            self._backward(loss, **kwargs)

        accelerator.backward = counting_backward
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.trainer.accelerator.backward = self._backward

    def take(self) -> dict[str, int]:
        counts = dict(self.counts)
        self.counts = dict.fromkeys(self.counts, 0)
        return counts


class PeakMemory:
    """Peak memory growth in MiB between :meth:`start` and :meth:`stop`: the CUDA allocator's peak on a GPU; on Linux
    CPUs the growth of the process's peak resident set (``VmHWM``) after returning freed heap memory to the system
    (``malloc_trim``, which also slows the steps that follow it: never start it before a timed step). ``None``
    elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self._base: int | None = None

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return
        self._base = None
        if not sys.platform.startswith("linux"):
            return
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            return
        self._base = proc_status_kb("VmRSS") * 1024

    def stop(self) -> float | None:
        if self._base is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        return (proc_status_kb("VmHWM") * 1024 - self._base) / 2**20


def measure_peak_memory_mb(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak memory growth of ``fn()`` in MiB (:class:`PeakMemory`)."""
    probe = PeakMemory(device)
    probe.start()
    fn()
    return probe.stop()


def proc_status_kb(key: str) -> int:
    """A ``/proc/self/status`` field in kB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every value of a benchmark's per-repeat figures."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "per_repeat": list(values),
    }


def served_share(cached: Sequence[float], recomputed: Sequence[float]) -> float | None:
    """The share of JAGG intermediates the velocity cache served: ``cached`` (``jagg/cached_velocities``) over
    ``cached + recomputed`` (``jagg/no_grad_forwards``), each summed over the micro-batches logged; ``None`` when
    there were no JAGG intermediates (an exact update)."""
    total = sum(cached) + sum(recomputed)
    return sum(cached) / total if total else None


def benchmark_clock(device: torch.device) -> Callable[[], float]:
    """The clock the benchmarks time with: wall time on an accelerator (synchronised around each measurement); on
    a CPU the process's CPU time, which, with one torch thread, counts the work itself and not the time other
    processes on a shared machine hold the cores (wall-time ratios there swing by 10x between repeats)."""
    return time.perf_counter if device.type != "cpu" else time.process_time


def endless_batches(trainer: Any) -> Iterator[Any]:
    """Rollout inputs from the trainer's dataloader, epoch after epoch."""
    while True:
        yield from trainer.get_train_dataloader()


def sync_device(device: torch.device) -> None:
    """Wait for the accelerator's queued work (a timed section starts and ends with it); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Timed work inside sees Python's cyclic garbage collector as a process with one trainer would.

    A benchmark that interleaves several trainers in one process holds all their pipelines, modules and optimizer
    states. A full (generation-2) collection traverses all of them, about 0.3 s on the whole-step benchmark's CPU,
    and is charged to whichever rollout happens to trigger it: measured, it landed in 4 of 10 exact rollouts and
    moved single ratios by 10 %. Inside this context, the objects alive at entry (collected first) are frozen out
    of the collector (``gc.freeze``), so a collection only visits what the timed work itself allocates; a
    collection before each timed unit (:func:`interleaved`) keeps any from starting with another's garbage.
    ``timeit`` goes further and turns the collector off."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def interleaved(names: Sequence[str], repeats: int) -> Iterator[str]:
    """The timed runs after a warm-up: ``repeats`` repeats of every name in alternating order (ABBA, the first
    repeat reversed), inside :func:`frozen_heap`, with a full collection before each run (outside its clock, which
    starts when the caller runs it): each run pays only for the garbage it makes."""
    with frozen_heap():
        for repeat in range(1, repeats + 1):
            for name in list(names) if repeat % 2 == 0 else list(names)[::-1]:
                gc.collect()
                yield name
