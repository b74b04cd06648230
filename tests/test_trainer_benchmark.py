"""The trainer-level benchmark runs the real update path and reports sane figures (never asserts on timings)."""

from __future__ import annotations

import json

import pytest
import torch

from trl_jagg.benchmarks.measuring import measure_peak_memory_mb
from trl_jagg.benchmarks.trainer import JSON_NAME, PNG_NAME, run_trainer_benchmark


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("trainer-bench")
    report = run_trainer_benchmark(
        str(output_dir), group_sizes=(2, 4), jagg_fracs=(1.0,), betas=(0.0, 0.1), num_inference_steps=5,
        resolution=32, max_sequence_length=16, num_layers=1, num_single_layers=1, repeats=1,
    )  # fmt: skip
    return report, output_dir


def test_files_and_layout(tiny_report):
    report, output_dir = tiny_report
    assert json.loads((output_dir / JSON_NAME).read_text()) == json.loads(json.dumps(report))
    assert (output_dir / PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["config"]["image_tokens"] == 4 and report["config"]["text_tokens"] == 16
    assert set(report["rollout_s"]) == {"0.0", "0.1"} and len(report["rollout_s"]["0.0"]["per_repeat"]) == 1
    variants = [(r["beta"], r["variant"], r["group_size"]) for r in report["results"]]
    assert variants[:1] == [(0.0, "exact", None)] and (0.1, "exact_batched", None) in variants
    assert (0.0, "exact_batched", None) not in variants  # without KL there is nothing to batch
    for r in report["results"]:
        assert r["update_s"]["min"] <= r["update_s"]["median"] <= r["update_s"]["max"]
        assert len(r["update_speedup"]["per_repeat"]) == 1 and r["step_speedup"]["median"] > 0
        assert ("speedup_vs_jagg" in r) == r["variant"].startswith("jagg_cache")
    assert [t["target"] for t in report["targets"]] == [
        "W=4 JAGG vs exact", "W=4 JAGG+cache vs exact", "beta>0 W=4 JAGG+cache vs JAGG"
    ]  # fmt: skip


def test_backbone_calls_counted_by_hooks(tiny_report):
    report, _ = tiny_report
    calls = {(r["beta"], r["variant"], r["group_size"]): r["calls"] for r in report["results"]}

    def counts(beta, variant, w=None):
        c = calls[beta, variant, w]
        return c["graph_forwards"], c["no_grad_forwards"], c["reference_forwards"], c["backward_calls"]

    # 4 trained steps. Exact: 4 forwards with graph, 4 backward calls; the KL reference one call per step, or one.
    assert counts(0.0, "exact") == (4, 0, 0, 4)
    assert counts(0.1, "exact") == (4, 0, 4, 4)
    assert counts(0.1, "exact_batched") == (4, 0, 1, 4)
    # W = 4, one group: JAGG recomputes the 2 intermediates (one call each); the cache needs none.
    assert counts(0.0, "jagg", 4) == (2, 2, 0, 1)
    assert counts(0.0, "jagg_cache", 4) == (2, 0, 0, 1)
    assert counts(0.0, "jagg_cache_seq", 4) == (2, 0, 0, 2)
    assert counts(0.1, "jagg_cache", 4) == (2, 0, 1, 1)
    assert counts(0.0, "jagg", 2) == (4, 0, 0, 2)


def test_peak_memory_is_measured_per_variant(tiny_report):
    report, _ = tiny_report
    peaks = [r["peak_memory_mb"] for r in report["results"]]
    if measure_peak_memory_mb(lambda: None, torch.device("cpu")) is None:
        pytest.skip("no peak-RSS reading on this platform")
    assert all(p is not None and p >= 0 for p in peaks)


def test_peak_memory_sees_a_large_allocation():
    if measure_peak_memory_mb(lambda: None, torch.device("cpu")) is None:
        pytest.skip("no peak-RSS reading on this platform")

    def allocate() -> None:
        buffer = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del buffer

    assert measure_peak_memory_mb(allocate, torch.device("cpu")) > 48
    assert measure_peak_memory_mb(lambda: None, torch.device("cpu")) < 16


@pytest.mark.parametrize(("kwargs", "name"), [({"group_sizes": (0,)}, "group_sizes"), ({"repeats": 0}, "repeats"),
                                              ({"resolution": 40}, "resolution"), ({"batch": 3}, "batch")])  # fmt: skip
def test_trainer_benchmark_refuses_bad_input_naming_the_field(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        run_trainer_benchmark(str(tmp_path), **kwargs)


def test_editing_variant_runs_on_the_tiny_kontext(tmp_path):
    """family="flux_kontext": the same update path on an editing model, whose backbone calls carry the source
    image's tokens too; the JAGG cache still replaces the intermediate forwards (counted by hooks)."""
    report = run_trainer_benchmark(
        str(tmp_path), group_sizes=(4,), jagg_fracs=(1.0,), betas=(0.0,), num_inference_steps=5, resolution=32,
        max_sequence_length=16, num_layers=1, num_single_layers=1, repeats=1, memory=False, plot=False,
        family="flux_kontext",
    )  # fmt: skip
    config = report["config"]
    assert (config["family"], config["image_tokens"], config["reference_tokens"]) == ("flux_kontext", 4, 4)
    calls = {r["variant"]: r["calls"] for r in report["results"]}
    counts = {
        v: tuple(c[k] for k in ("graph_forwards", "no_grad_forwards", "backward_calls")) for v, c in calls.items()
    }
    assert counts["exact"] == (4, 0, 4) and counts["jagg"] == (2, 2, 1) and counts["jagg_cache"] == (2, 0, 1)
    with pytest.raises(ValueError, match="`family` must be one of"):
        run_trainer_benchmark(str(tmp_path), family="sd3")


def test_video_variant_runs_the_same_update_on_wan(tmp_path):
    """The video variant (a tiny Wan2.1, 5-frame videos: 2 latent frames of 4 tokens) makes the update's calls of the
    image one: the engine does not know it serves videos."""
    report = run_trainer_benchmark(
        str(tmp_path), group_sizes=(4,), jagg_fracs=(1.0,), betas=(0.0,), num_inference_steps=5, resolution=32,
        max_sequence_length=16, num_layers=1, repeats=1, memory=False, plot=False, family="wan", num_frames=5,
    )  # fmt: skip
    assert report["config"]["family"] == "wan" and report["config"]["image_tokens"] == 8
    calls = {(r["variant"], r["group_size"]): r["calls"] for r in report["results"]}
    assert calls["exact", None]["graph_forwards"] == 4 and calls["exact", None]["backward_calls"] == 4
    assert calls["jagg_cache", 4]["graph_forwards"] == 2 and calls["jagg_cache", 4]["no_grad_forwards"] == 0
    assert calls["jagg_cache", 4]["backward_calls"] == 1
