"""Rewards that do not stall the rollout: the rewards that score each sample on its own (a remote server, a pointwise
VLM judge; see :func:`~trl_jagg.rewards.base.scores_each_sample`) score each rollout chunk in background threads
while the next chunk samples. The rollout then scores the whole batch as before, with these rewards replaced by
stand-ins returning the chunks' scores, so names, weights, checks and errors are those of
:func:`~trl_jagg.rewards.compute_rewards`, and the scores are those of one call on the whole batch in order.

When the advantages of a group depend only on that group's rewards (:class:`ChunkAdvantages`), they are resolved
chunk by chunk instead, as the update's micro-batches need them: the first micro-batches train while the last chunk
is still being scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from trl_jagg.rewards import reward_name
from trl_jagg.rewards.base import scores_each_sample
from trl_jagg.rewards.calling import call_within, reward_deadline

MAX_CHUNKS_IN_FLIGHT = 8
"""Chunks scored at once: a server answers one chunk while the next ones are already sent."""


class _ChunkScores:
    """Stands in for a reward in :func:`~trl_jagg.rewards.compute_rewards`: its first call returns the chunks'
    scores, concatenated in order (or raises the first chunk's error, a :class:`~trl_jagg.rewards.calling.RewardTimeout`
    when a chunk ran past its deadline); a further call (``reward_retries``) scores the whole batch with the reward
    itself. Its deadline in ``compute_rewards`` is the reward's."""

    def __init__(self, func: Callable[..., Any], chunks: list[tuple[Future, int]], timeout: float | None):
        self.func, self.chunks = func, chunks
        self.__name__ = reward_name(func)
        self.default_reward_timeout = reward_deadline(func, timeout)
        self._called = False

    def __call__(self, **kwargs: Any) -> list[Any]:
        if self._called:
            return call_within(self.func, self.__name__, self.default_reward_timeout, **kwargs)
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
    early (every reward then runs on the whole batch, as without this class). Each chunk's call has the reward's
    deadline (``timeout``, ``reward_timeout``; see :func:`~trl_jagg.rewards.calling.reward_deadline`) from its
    start."""

    def __init__(
        self, reward_funcs: Sequence[Callable[..., Any]], *, enabled: bool, trainer_state: Any, timeout: float | None
    ):
        self._funcs = list(reward_funcs)
        self._timeout = timeout
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
            func = self._funcs[i]
            call = self._pool.submit(call_within, func, reward_name(func), reward_deadline(func, self._timeout),
                                     **kwargs)  # fmt: skip
            self._chunks[i].append((call, len(images)))

    @property
    def scores_every_reward(self) -> bool:
        """Whether every reward scores chunk by chunk: what remains after the rollout is then waiting for the last
        chunk's answers (and cheap sums), which may wait behind other work."""
        return len(self._early) == len(self._funcs)

    def reward_funcs(self, chunk: int | None = None) -> list[Callable[..., Any]]:
        """The reward functions to score the whole rollout with (or, with ``chunk``, only that chunk of it): the
        per-sample ones answer from their chunks."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # the submitted chunks still run; nothing new is accepted
        window = slice(None) if chunk is None else slice(chunk, chunk + 1)
        return [
            _ChunkScores(func, self._chunks[i][window], self._timeout) if i in self._chunks else func
            for i, func in enumerate(self._funcs)
        ]


class ChunkAdvantages:
    """The per-group advantages of a rollout whose rewards are all scored chunk by chunk, resolved one chunk at a
    time as the rows asked for need them (the ``resolve_rows`` of a
    :class:`~trl_jagg.trainer.batch.PendingAdvantages`).

    The gathered batch holds process ``p``'s ``num_rows`` rows at ``[p * num_rows, (p + 1) * num_rows)`` and a group
    is ``num_generations`` consecutive gathered rows, so a group may span processes. Rows ``rows`` of every process
    need the chunks (of every process: chunk ``c`` is local rows ``[c * chunk_size, (c + 1) * chunk_size)``) holding
    any row of their groups; every process computes the same count from the same rows and resolves chunks in order,
    so the collectives of ``score_chunk`` are issued alike everywhere.

    Args:
        score_chunk: chunk index -> its gathered ``(rewards, per_reward)`` (``(num_processes * size,)`` and
            ``(num_processes * size, num_rewards)``, process-major), on every process alike.
        advantages: the advantages of the whole gathered batch from its rewards, each group's from its own rows
            only. Called on every resolved chunk with the rewards known so far (the others 0): a complete group's
            rows then see the same rows, in a tensor of the same shape, as the call on the whole batch, so their
            values are bit-equal to it.
        finish: called once, after the last chunk, with the gathered rewards, per-reward scores and advantages.
    """

    def __init__(
        self, *, num_rows: int, chunk_size: int, num_processes: int, process_index: int, num_generations: int,
        score_chunk: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
        advantages: Callable[[torch.Tensor], torch.Tensor],
        finish: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    ):  # fmt: skip
        self.num_rows, self.chunk_size, self.num_processes = num_rows, chunk_size, num_processes
        self.first = process_index * num_rows
        self.num_chunks = math.ceil(num_rows / chunk_size)
        self._score_chunk, self._advantages, self._finish = score_chunk, advantages, finish
        # The chunks each local row needs: the last chunk, on any process, holding a row of its group on any process.
        gathered = torch.arange(num_processes)[:, None] * num_rows + torch.arange(num_rows)[None]
        members = (gathered // num_generations)[..., None] * num_generations + torch.arange(num_generations)
        self.chunks_needed = ((members % num_rows) // chunk_size).amax(dim=2).amax(dim=0) + 1
        self.scored = 0
        self.rewards: torch.Tensor | None = None
        self.per_reward: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """The advantages of this process's rows ``rows``, once the chunks they need are scored."""
        needed = int(self.chunks_needed[rows].max()) if rows.numel() else max(self.scored, 1)
        while self.scored < needed:
            self._score_next()
        return self.values[self.first + rows.to(self.values.device)]

    def _score_next(self) -> None:
        chunk, size = self.scored, self.chunk_size
        rewards, per_reward = self._score_chunk(chunk)
        if self.rewards is None:
            total = self.num_processes * self.num_rows
            self.rewards = rewards.new_zeros(total)
            self.per_reward = per_reward.new_zeros(total, per_reward.shape[1])
        count = rewards.numel() // self.num_processes  # the last chunk may be shorter
        rows = torch.arange(self.num_processes)[:, None] * self.num_rows + chunk * size + torch.arange(count)
        rows = rows.flatten().to(self.rewards.device)
        self.rewards[rows], self.per_reward[rows] = rewards, per_reward
        self.values = self._advantages(self.rewards)
        self.scored += 1
        if self.scored == self.num_chunks:
            self._finish(self.rewards, self.per_reward, self.values)
