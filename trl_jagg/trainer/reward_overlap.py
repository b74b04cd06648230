"""Rewards that do not stall the rollout: the rewards that score each sample on its own (a remote server, a pointwise
VLM judge; see :func:`~trl_jagg.rewards.base.scores_each_sample`) score each rollout chunk in background threads
while the next chunk samples. The rollout then scores the whole batch as before, with these rewards replaced by
stand-ins returning the chunks' scores, so names, weights, checks and errors are those of
:func:`~trl_jagg.rewards.compute_rewards`, and the scores are those of one call on the whole batch in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from ..rewards import reward_name
from ..rewards.base import scores_each_sample, synchronous

MAX_CHUNKS_IN_FLIGHT = 8
"""Chunks scored at once: a server answers one chunk while the next ones are already sent."""


class _ChunkScores:
    """Stands in for a reward in :func:`~trl_jagg.rewards.compute_rewards`: its first call returns the chunks'
    scores, concatenated in order (or raises the first chunk's error); a further call (``reward_retries``) scores the
    whole batch with the reward itself."""

    def __init__(self, func: Callable[..., Any], chunks: list[tuple[Future, int]]):
        self.func, self.chunks = func, chunks
        self.__name__ = reward_name(func)
        self._called = False

    def __call__(self, **kwargs: Any) -> list[Any]:
        if self._called:
            return synchronous(self.func)(**kwargs)
        self._called = True
        wait(
            [future for future, _ in self.chunks]
        )  # a retry after a failed chunk never overlaps a chunk still running
        scores: list[Any] = []
        for future, size in self.chunks:
            values = future.result()
            values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
            if len(values) != size:  # the concatenation could hide a wrong count per chunk
                raise ValueError(
                    f"Reward {self.__name__!r} returned {len(values)} values for a rollout chunk of {size} images; "
                    "expected one per (prompt, image) pair."
                )
            scores.extend(values)
        return scores


class ChunkScorer:
    """Scores the per-sample rewards among ``reward_funcs`` chunk by chunk (:meth:`submit`) while the rollout samples;
    :meth:`reward_funcs` is the list to score the whole rollout with afterwards. ``enabled=False`` scores nothing
    early (every reward then runs on the whole batch, as without this class)."""

    def __init__(self, reward_funcs: Sequence[Callable[..., Any]], *, enabled: bool, trainer_state: Any):
        self._funcs = list(reward_funcs)
        self._early = [i for i, func in enumerate(self._funcs) if enabled and scores_each_sample(func)]
        self._chunks: dict[int, list[tuple[Future, int]]] = {i: [] for i in self._early}
        self._trainer_state = trainer_state
        self._pool = (
            ThreadPoolExecutor(max_workers=MAX_CHUNKS_IN_FLIGHT, thread_name_prefix="chunk-reward")
            if self._early
            else None
        )

    def submit(self, prompts: list[str], images: list, columns: dict[str, list]) -> None:
        """Start scoring one chunk (its prompts, images and dataset columns) with every per-sample reward."""
        if self._pool is None:
            return
        kwargs = dict(prompts=prompts, images=images, completions=images, trainer_state=self._trainer_state,
                      **columns)  # fmt: skip
        for i in self._early:
            self._chunks[i].append((self._pool.submit(synchronous(self._funcs[i]), **kwargs), len(images)))

    @property
    def scores_every_reward(self) -> bool:
        """Whether every reward scores chunk by chunk: what remains after the rollout is then waiting for the last
        chunk's answers (and cheap sums), which may wait behind other work."""
        return len(self._early) == len(self._funcs)

    def reward_funcs(self) -> list[Callable[..., Any]]:
        """The reward functions to score the whole rollout with: the per-sample ones answer from their chunks."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # the submitted chunks still run; nothing new is accepted
        return [
            _ChunkScores(func, self._chunks[i]) if i in self._chunks else func for i, func in enumerate(self._funcs)
        ]
