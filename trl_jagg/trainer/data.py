"""How the Trainer's dataloader feeds rollouts: whole prompt groups, an order a resumed run replays, and every
rollout's prompts from one bucket of rows whose tensors batch together."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator, Sequence, Sized
from typing import Any

import torch
from trl.trainer.utils import RepeatSampler


class EpochSeededRepeatSampler(RepeatSampler):
    """TRL's ``RepeatSampler`` whose shuffle depends only on ``(seed, epoch)``, so a resumed run sees the order an
    uninterrupted run would (the parent draws every epoch from one generator, which a restart resets), and whose
    every chunk of ``batch_size`` prompts (one rollout: all processes' rows, split among them by accelerate) comes
    from one bucket.

    ``buckets``: each row's bucket key (Qwen-Image-Edit-Plus: its source images' count and resized sizes, which one
    backbone call must share); ``None``: one bucket. The epoch's shuffled rows are walked in order and a bucket's
    chunk is emitted as soon as it holds ``batch_size`` rows, so each bucket gives ``len(bucket) // batch_size``
    chunks an epoch, drawn at random in proportion to its size, the same on every process (they share the seed);
    with one bucket this is exactly TRL's order. A bucket's rows that do not fill a chunk wait for a later epoch's
    shuffle, as TRL's sampler drops the last incomplete chunk.
    """

    def __init__(
        self,
        data_source: Sized,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
        buckets: Sequence[Hashable] | None = None,
    ):
        super().__init__(data_source, mini_repeat_count, batch_size, repeat_count, shuffle, seed)
        self.buckets = list(buckets) if buckets is not None else [None] * self.num_samples
        if len(self.buckets) != self.num_samples:
            raise ValueError(f"{len(self.buckets)} bucket keys for {self.num_samples} rows: give one per row.")

    def set_epoch(self, epoch: int) -> None:
        if self.seed is not None:
            self.generator = torch.Generator().manual_seed(self.seed + epoch)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=self.generator).tolist()  # TRL's draw
        else:
            order = range(self.num_samples)
        filling: dict[Hashable, list[int]] = {}
        for index in order:
            chunk = filling.setdefault(self.buckets[index], [])
            chunk.append(index)
            if len(chunk) < self.batch_size:
                continue
            del filling[self.buckets[index]]
            for _ in range(self.repeat_count):
                for row in chunk:
                    yield from [row] * self.mini_repeat_count

    def __len__(self) -> int:
        chunks = sum(size // self.batch_size for size in Counter(self.buckets).values())
        return chunks * self.batch_size * self.mini_repeat_count * self.repeat_count


def identity_collator(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dataloader's batch is the list of rows: the generation stage reads the prompts and reward columns."""
    return features
