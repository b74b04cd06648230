"""The trainer-level benchmark runs the real update path and reports sane figures (never asserts on timings)."""

from __future__ import annotations

import json

from trl_jagg.trainer_benchmark import JSON_NAME, PNG_NAME, run_trainer_benchmark


def test_trainer_benchmark_writes_report(tmp_path):
    report = run_trainer_benchmark(
        str(tmp_path), group_sizes=(2, 4), num_inference_steps=5, resolution=32, num_layers=1, num_single_layers=1,
        repeats=1,
    )  # fmt: skip
    assert json.loads((tmp_path / JSON_NAME).read_text()) == report
    assert (tmp_path / PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    w2, w4 = report["results"]
    # 4 trained steps: exact makes 4 backward calls; W=2 makes 2 joint ones, W=4 one.
    assert (w2["backward_calls_exact"], w2["backward_calls_jagg"]) == (4, 2)
    assert (w4["backward_calls_exact"], w4["backward_calls_jagg"]) == (4, 1)
    assert all(abs(c - 1) < 1e-5 for c in w2["group_cosine"])  # W = 2 is exact
    assert -1 <= w4["group_cosine"][0] <= 1
    assert w4["update_exact_s"] > 0 and w4["update_jagg_s"] > 0
