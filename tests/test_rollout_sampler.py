"""The training sampler's buckets (Qwen-Image-Edit-Plus rows with different source-image counts or sizes): every
rollout, all processes' rows of it, comes from one bucket; every row is drawn over epochs; the order is the same on
every process, fixed by the seed, and replayed by a resumed run; with one bucket it is TRL's `RepeatSampler`."""

from __future__ import annotations

from collections import Counter

import pytest
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader
from trl.trainer.utils import RepeatSampler

from trl_jagg.trainer.data import EpochSeededRepeatSampler, identity_collator

# Rows' buckets (their source images' count): 9 rows of 1 image, 6 of 2, 4 of 3, interleaved.
BUCKETS = [1, 2, 1, 3, 1, 2, 1, 3, 1, 2, 1, 3, 1, 2, 1, 3, 1, 2, 2]
PROMPTS, G, REPEATS = 4, 2, 2  # a rollout: 4 prompts x G = 2 rows, each rollout feeding 2 micro-batches


def sampler(seed: int = 0, buckets=BUCKETS, **kwargs) -> EpochSeededRepeatSampler:
    return EpochSeededRepeatSampler(
        range(len(buckets)), mini_repeat_count=G, batch_size=PROMPTS, repeat_count=REPEATS, seed=seed,
        buckets=buckets, **kwargs,
    )  # fmt: skip


def epoch(s: EpochSeededRepeatSampler, number: int) -> list[int]:
    s.set_epoch(number)
    return list(s)


def rollouts(order: list[int]) -> list[list[int]]:
    """The order cut into rollouts: PROMPTS x G rows, each yielded REPEATS times in a row."""
    size = PROMPTS * G
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    assert all(chunks[i] == chunks[i + 1] for i in range(0, len(chunks), REPEATS))  # one per micro-batch it feeds
    return chunks[::REPEATS]


def test_every_rollout_is_one_bucket_and_a_bucket_gives_its_full_chunks_each_epoch():
    s = sampler()
    for number in range(3):
        order = epoch(s, number)
        assert len(order) == len(s)
        drawn = rollouts(order)
        for rows in drawn:
            assert len({BUCKETS[row] for row in rows}) == 1
            assert rows == [row for row in rows[::G] for _ in range(G)]  # each prompt G times in a row
            assert len(set(rows)) == PROMPTS
        # Each bucket fills len // PROMPTS rollouts an epoch: 9 rows -> 2, 6 -> 1, 4 -> 1 (in proportion to size).
        assert Counter(BUCKETS[rows[0]] for rows in drawn) == {1: 2, 2: 1, 3: 1}


def test_every_row_is_eventually_drawn_and_the_buckets_order_varies():
    s = sampler()
    epochs = [rollouts(epoch(s, number)) for number in range(8)]
    assert {row for drawn in epochs for rows in drawn for row in rows} == set(range(len(BUCKETS)))
    assert len({tuple(BUCKETS[rows[0]] for rows in drawn) for drawn in epochs}) > 1  # buckets interleaved at random
    # Unshuffled, a bucket's chunk is its rows in dataset order, emitted once full (at rows 6, 13, 14 and 15).
    chunks = [(0, 2, 4, 6), (1, 5, 9, 13), (8, 10, 12, 14), (3, 7, 11, 15)]
    assert rollouts(list(sampler(shuffle=False))) == [[row for row in rows for _ in range(G)] for rows in chunks]


@pytest.mark.parametrize("world", [2, 4])
def test_processes_share_each_rollout_of_one_bucket(world):
    """Each process builds its own sampler (the same seed) under accelerate's sharding, as `Trainer` prepares the
    dataloader: at every step the processes' rows together are one rollout of one bucket."""
    per_process = PROMPTS * G // world
    shards = []
    for rank in range(world):
        loader = DataLoader(
            range(len(BUCKETS)), batch_size=per_process, sampler=sampler(), collate_fn=identity_collator
        )
        shards.append(list(prepare_data_loader(loader, num_processes=world, process_index=rank, put_on_device=False)))
    steps = list(zip(*shards, strict=True))
    assert len(steps) == len(sampler()) // (PROMPTS * G)
    for step, parts in zip(rollouts(list(sampler())), steps[::REPEATS]):
        rows = [row for part in parts for row in part]
        assert rows == step and len({BUCKETS[row] for row in rows}) == 1  # the global order, split between them


def test_the_order_is_fixed_by_the_seed_and_replayed_on_resume():
    assert epoch(sampler(seed=3), 0) == epoch(sampler(seed=3), 0) != epoch(sampler(seed=4), 0)
    uninterrupted = sampler(seed=3)
    orders = [epoch(uninterrupted, number) for number in range(3)]
    resumed = sampler(seed=3)  # a restart: a fresh sampler told the epoch it resumes in
    assert epoch(resumed, 2) == orders[2] != orders[1]


def test_one_bucket_is_trls_order():
    """Without buckets (text-to-image, FLUX.1 Kontext, Qwen-Image-Edit rows of one grid), TRL's sampler's order: runs
    and their checkpoints are unchanged."""
    for shuffle in (True, False):
        ours = EpochSeededRepeatSampler(range(11), G, 3, REPEATS, shuffle=shuffle, seed=5)
        ours.set_epoch(0)
        trl = RepeatSampler(range(11), G, 3, REPEATS, shuffle=shuffle, seed=5)
        assert list(ours) == list(trl) and len(ours) == len(trl)
