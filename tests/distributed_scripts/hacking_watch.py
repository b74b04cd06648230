"""Worker of ``tests/test_hacking_watch.py::test_every_process_logs_and_warns_on_the_whole_rollout`` (torchrun, 2 CPU
processes, gloo): the reward-hacking watch of each rank sees its own shard of two rollouts and writes what it
logged and warned to ``work_dir/rank<r>.json``.

The shards are made to differ (:func:`shard`): a prompt's group is split between the ranks, and in the second
rollout only rank 1's images turn white and alike, so a watch looking at its own shard would warn on rank 1 alone.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
from accelerate import Accelerator

from trl_jagg.trainer.hacking_watch import RewardHackingWarning, RewardHackingWatch

IMAGES, SIZE = 8, 16
KEYS = ["a", "b", "b", "c", "c", "d", "d", "a"]
"""The prompt of each image of the whole rollout, rank 0 holding the first half: group "a" spans both ranks."""


def rollout(step: int) -> tuple[torch.Tensor, list[float]]:
    """The whole rollout of ``step``: seeded random images, and at step 1 the second half pushed to white."""
    images = torch.rand(IMAGES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(step))
    if step == 1:
        images[IMAGES // 2 :] = 0.98 + 0.02 * images[IMAGES // 2 :]
    rewards = images.mean(dim=(1, 2, 3)).tolist()  # brightness
    return images, rewards


def shard(rank: int, step: int) -> tuple[list[str], torch.Tensor, list[float]]:
    images, rewards = rollout(step)
    rows = slice(rank * IMAGES // 2, (rank + 1) * IMAGES // 2)
    return KEYS[rows], images[rows], rewards[rows]


def main(work_dir: str) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    metrics: dict[str, list[float]] = {}
    watch = RewardHackingWatch(metrics, accelerator=accelerator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            watch.observe(*shard(rank, step), step=step)
        watch.observe_evaluation(0.25, step=2)
    messages = [str(w.message) for w in caught if issubclass(w.category, RewardHackingWarning)]
    with open(f"{work_dir}/rank{rank}.json", "w") as handle:
        json.dump({"world": accelerator.num_processes, "metrics": metrics, "warnings": messages}, handle)


if __name__ == "__main__":
    main(*sys.argv[1:])
