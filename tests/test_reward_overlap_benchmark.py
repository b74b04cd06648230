"""The reward-overlap benchmark: its pairing of interleaved steps and its report (never asserts on timings)."""

from __future__ import annotations

import json

from trl_jagg.benchmarks.reward_overlap import (
    JSON_NAME,
    PNG_NAME,
    compare_pairs,
    overlapped_at,
    run_reward_overlap_benchmark,
)


def test_pairs_take_one_step_each_way_and_the_criterion_from_the_sequential_share():
    # Made-up times for S O O S: each pair is one sequential and one overlapped step, whichever came first.
    steps = [
        {"step_s": 4.0, "reward_wait_s": 2.0, "rollout_s": 1.0, "update_s": 0.8},
        {"step_s": 2.5, "reward_wait_s": 0.1, "rollout_s": 1.0, "update_s": 1.2},
        {"step_s": 1.5, "reward_wait_s": 0.0, "rollout_s": 1.0, "update_s": 0.4},
        {"step_s": 3.6, "reward_wait_s": 2.0, "rollout_s": 1.0, "update_s": 0.4},
    ]
    assert [overlapped_at(i) for i in range(4)] == [False, True, True, False]
    report = compare_pairs(steps, chunks=4, latency=0.5)
    first, second = report["pairs"]
    assert (first["sequential"]["step_s"], first["overlapped"]["step_s"]) == (4.0, 2.5)
    assert (second["sequential"]["step_s"], second["overlapped"]["step_s"]) == (3.6, 1.5)
    # fall / share: (4.0 - 2.5) / 2.0 and (3.6 - 1.5) / 2.0; the median of two values is their mean.
    assert (first["fall_over_share"], second["fall_over_share"]) == (0.75, 1.05)
    assert report["fall_over_share"] == {"median": 0.9, "min": 0.75, "max": 1.05}
    assert report["done_when_met"] is False
    # The sequential rollouts after their first of 4 chunks: 0.75 s twice, longer than the latency; the updates'
    # first 3 of 4 micro-batches: 0.6 and 0.3 s, median 0.45 s, shorter.
    assert report["rollout_after_first_chunk_s"]["median"] == 0.75
    assert report["update_before_last_micro_batch_s"]["median"] == 0.45
    assert report["room_outlasts_latency"] is False


def test_the_benchmark_trains_both_ways_against_a_local_server_and_writes_its_report(tmp_path):
    report = run_reward_overlap_benchmark(
        str(tmp_path), latency=0.01, pairs=1, num_inference_steps=3, resolution=32, num_layers=1,
        num_single_layers=1, betas=(0.0,),
    )  # fmt: skip
    assert json.loads((tmp_path / JSON_NAME).read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / PNG_NAME).stat().st_size > 0
    (pair,) = report["betas"]["0.0"]["pairs"]
    # The sequential step waits for one request per chunk (4 of them) after the rollout; each is at least the latency.
    assert pair["sequential"]["reward_wait_s"] >= 4 * 0.01
    assert set(pair["overlapped"]) == {"step_s", "reward_wait_s", "rollout_s", "update_s"}
