"""``make gpu-check`` (trl_jagg/benchmarks/gpu_check.py) and ``make gpu-wheels`` (gpu_wheels.py) without a GPU.

The GPU run happens once, on a machine lent for minutes with no network: the ``--tiny`` dry run here runs the same
script end to end on the CPU so that it cannot fail there on an import, a path or a flag, and the wheel list is
checked against the dependency tree the installed metadata gives. Counts and files, never timings.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from collections import deque
from importlib import metadata
from pathlib import Path

import pytest

from trl_jagg import GRPOJaggConfig
from trl_jagg.benchmarks import gpu_check, gpu_wheels

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    report = gpu_check.main(["--tiny", "--output_dir", str(out)])
    return out, report


def test_tiny_dry_run_attempts_every_part_and_writes_its_files(tiny_report):
    out, report = tiny_report
    assert json.loads((out / gpu_check.JSON_NAME).read_text()) == json.loads(json.dumps(report))
    assert (out / gpu_check.PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    section = (out / gpu_check.MD_NAME).read_text()
    assert "python -m trl_jagg.benchmarks.gpu_check --tiny" in section and "| part | measurement | value |" in section
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert len(table) > 10 and all(line.count("|") == 4 for line in table)  # three cells: no stray pipe
    statuses = {name: part["status"] for name, part in report["parts"].items()}
    assert statuses == dict.fromkeys([p.name for p in gpu_check.PARTS], "done")
    assert set(report["config"]["versions"]) >= {"torch", "transformers", "diffusers", "trl", "datasets", "peft"}
    rows = gpu_check.summary_rows(report)
    assert {part for part, _, _ in rows} == set(statuses)


def test_tiny_numerics_hold_their_claims_on_the_cpu(tiny_report):
    """float32 on one CPU thread: the exact claims hold exactly or to rounding; JAGG's approximations do not."""
    numerics = tiny_report[1]["parts"]["numerics"]["result"]
    trained = len(numerics["trained_steps"])
    assert trained == 8  # 9 steps, all but the last trained
    grads = numerics["gradients"]
    assert set(grads) == set(gpu_measure_checks())
    # jagg_frac = 0 routes every group to exact: the same calls in the same order, bitwise the same gradient.
    assert grads["frac0_jagg_cache"]["bitwise_equal"] and grads["exact_again"]["bitwise_equal"]
    for name in ("w2_jagg", "w2_jagg_cache"):  # two endpoints, no interpolation: exact up to summation order
        assert grads[name]["cosine"] > 1 - 1e-6 and grads[name]["rel_error"] < 1e-4
    for name in ("w4_jagg_cache", "w8_jagg_cache"):  # interpolated intermediates: an approximation
        assert grads[name]["cosine"] < 1 - 1e-6
    # Per micro-batch: (8 / W) groups, each with W - 2 intermediates (cached or recomputed) and one backward.
    for w in (2, 4, 8):
        cached, recomputed = grads[f"w{w}_jagg_cache"]["logged"], grads[f"w{w}_jagg"]["logged"]
        assert cached["engine/jagg/cached_velocities"] == trained // w * (w - 2)
        assert cached["engine/jagg/no_grad_forwards"] == 0
        assert recomputed["engine/jagg/cached_velocities"] == 0
        assert cached["engine/jagg/backward_calls"] == recomputed["engine/jagg/backward_calls"] == trained // w
    assert numerics["exact_logged"]["engine/jagg/backward_calls"] == trained
    # The cache's claim: the rollout's velocity is bitwise what the backbone returns at the same batch shape.
    velocity = numerics["velocity"]
    assert velocity["recomputed_per_step"]["bitwise_equal"] and velocity["recomputed_with_graph"]["bitwise_equal"]
    assert numerics["log_prob_gap"]["cached"]["max_abs"] == 0.0
    assert numerics["log_prob_gap"]["cached"]["ratio_max_dev"] == 0.0
    assert numerics["exact_logged"]["ratio"] == pytest.approx(1.0, abs=1e-6)


def gpu_measure_checks():
    from trl_jagg.benchmarks.gpu_measure import GRADIENT_CHECKS

    return GRADIENT_CHECKS


def test_tiny_cadence_and_update_stage_count_the_presets_work(tiny_report):
    parts = tiny_report[1]["parts"]
    variants = {**parts["cadence_dancegrpo"]["result"]["variants"], **parts["cadence_fast_mix"]["result"]["variants"]}
    registered = [name for name in gpu_check.FAST_PRESETS if name in _recipes()]
    assert set(variants) == {"dancegrpo-exact", "dancegrpo-flux", "mixgrpo-flash", *registered}
    assert set(parts["cadence_fast_mix"]["result"]["skipped_variants"]) == set(gpu_check.FAST_PRESETS) - set(
        registered
    )
    tiny = gpu_check.TINY_CADENCE
    g, micro_batches, accumulation = (
        tiny["num_generations"],
        tiny["steps_per_generation"],
        tiny["gradient_accumulation_steps"],
    )
    for entry in variants.values():
        assert entry["optimizer_steps"] == micro_batches // accumulation  # 2: the cache's key changes mid-rollout
        assert entry["work_per_rollout_equal"] and entry["counted"]["decoded_images"] == g
    assert all(entry["checkpointed"] for entry in variants.values())  # both presets checkpoint: priced with recompute
    exact = variants["dancegrpo-exact"]["counted"]
    # DanceGRPO: every image denoised over 16 steps without a graph, a random 60% of the first 15 trained (9).
    assert exact["no_grad_rows"] == g * 16
    assert exact["graph_rows"] == exact["backward_rows"] == g * round(0.6 * 15)
    assert variants["dancegrpo-flux"]["counted"]["backward_rows"] < exact["backward_rows"]
    assert variants["dancegrpo-exact"]["speedup_vs_exact"] == 1.0
    # The cache's served share is reported: the exact update has no cache; with the default `recompute` the cache
    # serves the intermediates of the micro-batches before the rollout's first optimizer step only.
    assert variants["dancegrpo-exact"]["cache_served"] is None
    assert 0 < variants["dancegrpo-flux"]["cache_served"] < 1
    calls = {(r["variant"], r["group_size"]): r["calls"] for r in parts["update_stage"]["result"]["results"]}
    # The numerics' trainer: 2 micro-batches of 8 trained steps; exact takes a backward per step.
    assert calls["exact", None]["backward_calls"] == 2 * 8
    assert calls["jagg_cache", 8]["backward_calls"] == 2 and calls["jagg_cache", 8]["no_grad_forwards"] == 0


def _recipes():
    from trl_jagg.recipes import RECIPES

    return RECIPES


def test_preset_values_pass_activation_checkpointing_as_gradient_checkpointing_where_transformers_is_older(tmp_path):
    """The GPU machine's transformers (5.17) has no ``activation_checkpointing`` field: the trainer's other switch."""
    from trl_jagg.benchmarks.gpu_measure import preset_config, preset_values

    known = {f.name for f in dataclasses.fields(GRPOJaggConfig)}
    values = preset_values("dancegrpo-flux", known, use_jagg=False)
    assert values["activation_checkpointing"] is True and not values.get("gradient_checkpointing")
    older = preset_values("dancegrpo-flux", known - {"activation_checkpointing"}, use_jagg=False)
    assert older == {k: v for k, v in values.items() if k != "activation_checkpointing"} | {
        "gradient_checkpointing": True
    }
    args = preset_config("dancegrpo-flux", output_dir=str(tmp_path), use_jagg=False)
    assert args.activation_checkpointing and not args.use_jagg and args.gradient_accumulation_steps == 4


def test_time_guard_skips_parts_and_a_failing_part_does_not_stop_the_run(tmp_path, monkeypatch):
    def fails(session):
        raise RuntimeError("out of memory")

    parts = (gpu_check.Part("first", 1.0, fails), gpu_check.Part("second", 1.0, lambda s: {"fine": True}),
             gpu_check.Part("third", 1000.0, lambda s: {}))  # fmt: skip
    monkeypatch.setattr(gpu_check, "PARTS", parts)
    monkeypatch.setattr(gpu_check, "summary_rows", lambda report: [])
    argv = ["--tiny", "--output_dir", str(tmp_path), "--time_limit_s", "100"]
    report = gpu_check.main(argv + ["--parts", "first", "second", "third"])
    assert report["parts"]["first"]["status"] == "error" and "out of memory" in report["parts"]["first"]["error"]
    assert report["parts"]["second"] == {**report["parts"]["second"], "status": "done", "result": {"fine": True}}
    assert report["parts"]["third"]["status"] == "skipped"  # its budget does not fit in the limit
    assert json.loads((tmp_path / gpu_check.JSON_NAME).read_text())["parts"]["third"]["status"] == "skipped"


def test_render_docs_fills_the_section_between_the_markers(tiny_report, tmp_path):
    out, report = tiny_report
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\n## GPU\n{gpu_check.DOCS_BEGIN}\nNot measured yet.\n{gpu_check.DOCS_END}\n\n## Next\n")
    gpu_check.main(["--render_docs", str(out / gpu_check.JSON_NAME), str(docs)])
    text = docs.read_text()
    assert "Not measured yet." not in text and text.startswith("# B\n\n## GPU\n") and text.endswith("\n\n## Next\n")
    assert gpu_check.markdown(report) in text
    docs.write_text("no markers")
    with pytest.raises(ValueError, match="gpu-check:begin"):
        gpu_check.main(["--render_docs", str(out / gpu_check.JSON_NAME), str(docs)])


def test_the_repository_docs_have_the_gpu_section_markers():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert text.count(gpu_check.DOCS_BEGIN) == text.count(gpu_check.DOCS_END) == 1


def test_budgets_fit_in_eight_minutes():
    """Start-up (install, imports: about 30 s) and every part's budget within the time guard and 8 minutes."""
    assert sum(p.budget_s for p in gpu_check.PARTS) + 30 <= gpu_check.TIME_LIMIT_S <= 8 * 60
    assert [p.name for p in gpu_check.PARTS][:2] == ["numerics", "cadence_dancegrpo"]  # most important first


# ---------------------------------------------------------------------------------------------- wheels
def _requirement_names(dist: str) -> list[str]:
    """Names of ``dist``'s requirements that apply on the GPU machine (CPython 3.12 on Linux, no extras)."""
    from packaging.requirements import Requirement

    environment = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}  # fmt: skip
    names = []
    for line in metadata.requires(dist) or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(environment):
            names.append(gpu_wheels.normalize(requirement.name))
    return names


def test_the_wheel_list_is_what_the_gpu_machine_lacks_of_the_dependency_tree():
    """Walk trl_jagg's run-time requirements (installed metadata) and stop at what the GPU machine has: what is
    left is what must travel as wheels."""
    needed, queue = set(), deque(_requirement_names("trl_jagg"))
    while queue:
        name = queue.popleft()
        if name in gpu_wheels.GPU_MACHINE_HAS or name in needed:
            continue
        needed.add(name)
        queue.extend(_requirement_names(name))
    assert needed == {gpu_wheels.normalize(n) for n in gpu_wheels.GPU_MACHINE_LACKS}


def test_wheel_commands_pin_the_lock_and_install_offline(tmp_path):
    versions = gpu_wheels.locked_versions(REPO / "requirements.lock")
    assert list(versions) == list(gpu_wheels.CARRIED)
    for name, version in versions.items():  # what the suite runs is what travels
        assert metadata.version(name) == version
    command = gpu_wheels.download_command("python", tmp_path, versions)
    assert {"--no-deps", "--only-binary=:all:"} <= set(command) and command[
        command.index("--python-version") + 1
    ] == "3.12"
    assert [c for c in command if "==" in c] == [f"{n}=={v}" for n, v in versions.items()]
    with pytest.raises(FileNotFoundError, match="make gpu-wheels"):
        gpu_wheels.install_command("python3", tmp_path, tmp_path / "site")
    for name in ("b-1.0-py3-none-any.whl", "a-1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    install = gpu_wheels.install_command("python3", tmp_path, tmp_path / "site")
    assert {"--no-index", "--no-deps"} <= set(install) and install[install.index("--target") + 1] == str(
        tmp_path / "site"
    )
    assert install[-2:] == [str(tmp_path / "a-1.0-py3-none-any.whl"), str(tmp_path / "b-1.0-py3-none-any.whl")]
    lock = tmp_path / "lock.txt"
    lock.write_text("diffusers==0.42.1\n")
    with pytest.raises(ValueError, match="'trl'"):
        gpu_wheels.locked_versions(lock)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_targets_call_the_wheel_module_and_the_check():
    def dry_run(*args: str) -> str:
        done = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "-m trl_jagg.benchmarks.gpu_wheels download --dest gpu-wheels --lock requirements.lock" in dry_run(
        "gpu-wheels"
    )
    check = dry_run("gpu-check", "OUT=/tmp/x", "GPU_CHECK_ARGS=--tiny")
    assert "python3 -m trl_jagg.benchmarks.gpu_wheels install --wheels gpu-wheels --target .gpu-site" in check
    assert "PYTHONPATH=.gpu-site" in check and "-m trl_jagg.benchmarks.gpu_check --output_dir /tmp/x --tiny" in check
    ignored = (REPO / ".gitignore").read_text().split()
    assert "gpu-wheels/" in ignored and ".gpu-site/" in ignored
