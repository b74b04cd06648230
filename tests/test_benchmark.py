"""The engine benchmark (`trl_jagg.benchmarks.engine`) with tiny settings: files, fields and counts, never timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from trl_jagg.benchmarks.engine import (
    JSON_NAME,
    PNG_NAME,
    TinyDiT,
    plan_cost_ratio,
    run_engine_benchmark,
    theoretical_speedup,
)
from trl_jagg.core.jagg import plan_groups

TINY = {"num_steps": 5, "width": 16, "depth": 1, "batch": 2, "repeats": 1, "tokens": 6, "channels": 4, "heads": 2}
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    output_dir = tmp_path_factory.mktemp("bench")
    report = run_engine_benchmark(output_dir, group_sizes=(1, 2, 4), seed=0, verbose=False, **TINY)
    return report, output_dir


def test_files_are_written_and_match_the_returned_dict(tiny_report):
    report, output_dir = tiny_report
    written = json.loads((output_dir / JSON_NAME).read_text())
    assert written == json.loads(json.dumps(report))
    png = (output_dir / PNG_NAME).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert report["files"] == {"json": str(output_dir / JSON_NAME), "png": str(output_dir / PNG_NAME)}
    assert report["config"]["num_params"] == sum(
        p.numel() for p in TinyDiT(4, 16, 1, 2, 6, 32).parameters()
    )  # the configured network


def test_fields_are_sane(tiny_report):
    report, _ = tiny_report
    results = {r["group_size"]: r for r in report["results"]}
    assert sorted(results) == [1, 2, 4]
    # 5 trained steps: W=1 is five exact steps; W=2 is two joint groups and an exact remainder step; W=4 one joint
    # group and a remainder step. Exact mode always takes one backward per step.
    expected_calls = {1: 5, 2: 3, 4: 2}
    expected_groups = {1: 5, 2: 3, 4: 2}
    for w, r in results.items():
        assert r["num_trained_steps"] == 5
        assert r["backward_calls_exact"] == 5
        assert r["backward_calls_jagg"] == expected_calls[w]
        assert r["num_groups"] == expected_groups[w] == len(r["cosine_per_group"]) == len(r["norm_ratio_per_group"])
        assert r["theory_speedup"] == pytest.approx(3 * w / (w + 4))
        assert all(-1 - 1e-9 <= c <= 1 + 1e-9 for c in r["cosine_per_group"])
        assert all(n > 0 and math.isfinite(n) for n in r["norm_ratio_per_group"])
        assert r["speedup"] > 0 and r["time_exact_s"] > 0 and r["time_jagg_s"] > 0
        assert len(r["speedup_per_repeat"]) == TINY["repeats"]
        # The reported loss is the true mean of the step losses whichever way the gradient is taken.
        assert r["loss_jagg"] == pytest.approx(r["loss_exact"], rel=1e-6, abs=1e-9)
    for w in (1, 2):  # the exact limits
        assert results[w]["cosine_per_group"] == pytest.approx([1.0] * expected_groups[w], abs=1e-6)
        assert results[w]["norm_ratio_per_group"] == pytest.approx([1.0] * expected_groups[w], abs=1e-5)
    assert results[4]["cosine_per_group"][-1] == pytest.approx(1.0, abs=1e-6)  # the one-step remainder
    assert results[4]["cosine_per_group"][0] < 1 - 1e-6  # a real approximation on a nonlinear network
    assert report["summary"][2].startswith("W=4: cosine ")
    assert "update-stage speedup" in report["summary"][2] and "(theory 1.50x)" in report["summary"][2]


def test_cost_model():
    assert [theoretical_speedup(w) for w in (2, 4, 8)] == pytest.approx([1.0, 1.5, 2.0])
    times = [1.0 - 0.1 * k for k in range(10)]
    assert plan_cost_ratio(plan_groups(times, 4, 1.0)) == pytest.approx(30 / (8 + 8 + 6))
    assert plan_cost_ratio(plan_groups(times, 4, 0.0)) == 1.0


def test_table_is_printed(tmp_path, capsys):
    run_engine_benchmark(tmp_path, group_sizes=(2,), plot=False, **TINY)
    out = capsys.readouterr().out
    assert "speedup" in out and "cosine per group" in out
    assert "W=2: cosine 1.00, update-stage speedup" in out
    assert (tmp_path / JSON_NAME).exists() and not (tmp_path / PNG_NAME).exists()


def test_thread_setting_is_restored(tmp_path):
    before = torch.get_num_threads()
    run_engine_benchmark(tmp_path, group_sizes=(2,), plot=False, verbose=False, num_threads=1, **TINY)
    assert torch.get_num_threads() == before


def test_bench_command_runs(tmp_path):
    from trl_jagg.scripts.bench import main

    args = ["--output_dir", str(tmp_path), "--group_sizes", "2", "--num_steps", "2", "--width", "8", "--depth", "1"]
    args += ["--heads", "2", "--tokens", "4", "--channels", "2", "--batch", "2", "--repeats", "1", "--no_plot"]
    main(args)
    report = json.loads((tmp_path / JSON_NAME).read_text())
    assert report["config"]["num_steps"] == 2 and report["results"][0]["backward_calls_jagg"] == 1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"group_sizes": (0,)}, "group_sizes"), ({"repeats": 0}, "repeats"), ({"num_generations": 3}, "num_generations")],
)
def test_engine_benchmark_refuses_bad_input_naming_the_field(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        run_engine_benchmark(tmp_path, **{**TINY, **kwargs})


def test_gpu_benchmark_script_runs_tiny_on_cpu(tmp_path):
    """trl_jagg/benchmarks/gpu.py at FLUX.1-dev size needs a GPU; ``--tiny`` runs the same code on a CPU."""
    from trl_jagg.benchmarks import gpu as module

    assert module.FLUX_DEV_TRANSFORMER["num_layers"] == 19 and module.FLUX_DEV_TRANSFORMER["num_single_layers"] == 38
    report = module.main(["--tiny", "--output_dir", str(tmp_path), "--resolution", "32"])
    assert json.loads((tmp_path / "gpu_benchmark.json").read_text()) == json.loads(json.dumps(report))
    assert report["config"]["num_generations"] == 4 and report["config"]["micro_batch"] == 2
    calls = {r["variant"]: r["calls"] for r in report["results"]}
    assert list(calls) == ["exact", "jagg", "jagg_cache", "jagg_cache_seq"]
    # 6 steps, 5 trained (a JAGG group of W = 4 and one exact step), two micro-batches per rollout.
    assert calls["exact"]["graph_forwards"] == calls["exact"]["backward_calls"] == 10
    assert (calls["jagg"]["graph_forwards"], calls["jagg"]["no_grad_forwards"], calls["jagg"]["backward_calls"]) == (
        6, 4, 4
    )  # fmt: skip
    assert (calls["jagg_cache"]["no_grad_forwards"], calls["jagg_cache_seq"]["backward_calls"]) == (0, 6)
    assert all(r["update_s"]["median"] > 0 for r in report["results"])
