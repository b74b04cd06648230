"""The quality benchmark (`trl-jagg bench quality`): its variants, its bookkeeping and one short end-to-end run.

Whether a variant costs reward is measured by the 100-step benchmark (docs/benchmarks.md), never asserted here.
"""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from trl_jagg.benchmarks.quality import (
    QUALITY_TASKS,
    QUALITY_VARIANTS,
    EvaluateAt,
    TrainingCPUClock,
    TrainingWork,
    evaluation_steps,
    milestones,
    plot_quality,
    run_order,
    run_record,
    variant_overrides,
)
from trl_jagg.benchmarks.race import markdown_table, paired_race, summarize, time_to_reward, time_to_reward_table
from trl_jagg.core.sde_window import compressed_path, sde_window
from trl_jagg.demo.run import DEMO_NUM_INFERENCE_STEPS, demo_config


def test_variant_configs_are_valid_demo_configs_and_the_mix_window_moves_at_mixgrpos_cadence(tmp_path):
    configs = {v: demo_config(str(tmp_path), steps=100, seed=0, **variant_overrides(v, 100)) for v in QUALITY_VARIANTS}
    assert not configs["exact"].use_jagg
    assert configs["jagg_cache"].use_jagg and configs["jagg_cache"].jagg_cache_velocities
    mix = configs["mix_jagg_cache"]
    assert mix.use_jagg and mix.jagg_group_size == mix.sde_window_size == 4  # the window is one JAGG group
    assert mix.ode_solver_order == 2 and mix.same_group_noise
    assert mix.steps_per_generation == mix.gradient_accumulation_steps  # one optimizer step per rollout
    windows = [
        sde_window(
            mix.sde_window_schedule, num_steps=mix.num_inference_steps, size=mix.sde_window_size,
            max_start=mix.sde_window_max_start, rollout=rollout, stride=mix.sde_window_stride,
            shift_interval=mix.sde_window_shift_interval,
        )
        for rollout in range(100)
    ]  # fmt: skip
    # MixGRPO-Flash's iters_per_group: a move every 20 rollouts; its end, 9 - 2 = 7, cuts the window at start 4.
    expected = [list(range(r // 20, min(r // 20 + 4, 7))) for r in range(100)]
    assert windows == expected and windows[-1] == [4, 5, 6]
    # After the window, MixGRPO-Flash's int((9 - last) x 0.6) - 1 ODE steps (at least 1); round(0.6 n) before it.
    for window in map(list, dict.fromkeys(map(tuple, windows))):
        path = compressed_path(DEMO_NUM_INFERENCE_STEPS, window, mix.ode_step_ratio, mixgrpo_post=True)
        before, after = path.index(window[0]), len(path) - 2 - path.index(window[-1])
        assert before == (max(1, round(0.6 * window[0])) if window[0] else 0), window
        assert after == max(1, int((9 - window[-1]) * 0.6) - 1), window
    fast = configs["fast_jagg_cache"]  # the jagg-fast-flux rollout: the window held on steps 0-3 of 9
    assert fast.use_jagg and fast.jagg_cache_velocities and fast.jagg_group_size == fast.sde_window_size == 4
    assert fast.ode_solver_order == 2 and fast.ode_step_ratio == 0.4 and fast.same_group_noise
    for step in range(100):
        window = sde_window(
            fast.sde_window_schedule, num_steps=9, size=4, max_start=fast.sde_window_max_start, rollout=step,
            shift_interval=fast.sde_window_shift_interval,
        )  # fmt: skip
        assert window == [0, 1, 2, 3]
    # 4 SDE steps and round(0.4 x 5) = 2 ODE steps: 6 backbone calls a rollout instead of 9.
    assert compressed_path(9, [0, 1, 2, 3], fast.ode_step_ratio) == [0, 1, 2, 3, 4, 6, 9]
    for name in ("nft", "nft_jagg"):  # DiffusionNFT: deterministic rollouts, 4 of the 9 timesteps trained
        nft = configs[name]
        assert nft.objective == "nft" and nft.sde_window_size == 0 and nft.use_jagg == (name == "nft_jagg")
        assert max(1, int(9 * nft.train_timestep_fraction)) == nft.jagg_group_size == 4 and nft.beta == 1e-4
    with pytest.raises(ValueError, match="Unknown variant"):
        variant_overrides("mix", 100)
    assert configs["exact_low_kl"].beta == 1e-3 and configs["exact"].beta == 0.15  # DGPO's KL against the demo's
    assert not configs["exact_low_kl"].use_jagg and configs["exact_low_kl"].sde_window_size == 4
    for name in ("dgpo_fast", "dgpo_jagg_fast"):  # the dgpo-sd35 rollout: DPM-Solver++ 2, 10 of 14 steps -> 6 of 9
        fast = configs[name]
        assert fast.objective == "dgpo" and fast.use_jagg == (name == "dgpo_jagg_fast")
        assert (fast.num_inference_steps, fast.ode_solver_order, fast.eval_num_inference_steps) == (6, 2, 9)
        assert fast.dgpo_trunc_steps == 4 and fast.dgpo_num_train_timesteps == 4  # 4 of the first 5 timesteps
    assert QUALITY_TASKS == {"color": "prompt_color", "detail": "high_frequency", "stripes": "horizontal_detail"}


def test_runs_are_interleaved_seed_by_seed_in_rotating_order():
    assert run_order([0, 1, 2], ["a", "b", "c"]) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b"),
    ]  # fmt: skip
    assert milestones(100) == [50, 100] and milestones(2) == [1, 2] and milestones(1) == [1]
    assert evaluation_steps(100, 10) == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert evaluation_steps(30, 20) == [15, 20, 30]  # the milestones too


def test_evaluate_at_asks_for_an_evaluation_at_its_steps_only():
    class State:
        global_step = 0

    class Control:
        should_evaluate = False

    state, callback, asked = State(), EvaluateAt([2, 5]), []
    for step in range(1, 7):
        state.global_step, control = step, Control()
        asked.append(callback.on_step_end(None, state, control).should_evaluate)
    assert asked == [False, True, False, False, True, False]


def test_cpu_clock_leaves_evaluation_out():
    times = iter([10.0, 11.0, 12.5, 14.5, 15.5])  # begin, step 1, step 2, evaluation done (2 s), step 3
    clock = TrainingCPUClock(clock=lambda: next(times))

    class State:
        global_step = 0

    state = State()
    clock.on_train_begin(None, state, None)
    for step in (1, 2):
        state.global_step = step
        clock.on_step_end(None, state, None)
    clock.on_evaluate(None, state, None)
    state.global_step = 3
    clock.on_step_end(None, state, None)
    assert clock.seconds == {1: 1.0, 2: 2.5, 3: 3.5}


def _history(rewards, accuracies, evals):
    history = [{"reward": r, "rewards/color_accuracy/mean": a, "step": i + 1} for i, (r, a) in enumerate(zip(rewards, accuracies))]  # fmt: skip
    history += [{"eval_reward": r, "eval_rewards/color_accuracy/mean": a, "step": s} for s, (r, a) in evals.items()]
    return history[::-1]  # any order: the record sorts by step


def test_summary_equals_a_hand_computation():
    cpu = {1: 1.0, 2: 2.0, 3: 3.5, 4: 5.0}
    runs = [
        run_record(
            "exact", 0, _history([0.1, 0.2, 0.3, 0.4], [0.3, 0.4, 0.5, 0.6], {2: (0.05, 0.5), 4: (0.15, 0.7)}), cpu
        ),  # fmt: skip
        run_record(
            "exact",
            1,
            _history([0.0, 0.4, 0.2, 0.6], [0.2, 0.6, 0.5, 0.9], {2: (0.25, 0.3), 4: (0.35, 0.9)}),
            {k: 2 * v for k, v in cpu.items()},
        ),  # fmt: skip
        run_record(
            "mix_jagg_cache", 0, _history([0.1, -0.1, 0.3, 0.2], [0.3, 0.2, 0.5, 0.4], {2: (0.0, 0.4)}), cpu
        ),  # fmt: skip
    ]
    assert runs[0]["step"] == [1, 2, 3, 4] and runs[0]["reward"] == [0.1, 0.2, 0.3, 0.4]
    summary = summarize(runs, [2, 4])
    exact2, exact4 = summary["exact"]["2"], summary["exact"]["4"]
    assert exact2["seeds"] == [0, 1] and exact2["per_seed"]["reward"] == [0.2, 0.4]
    expected2 = {"reward": 0.3, "color_accuracy": 0.5, "eval_reward": 0.15, "eval_color_accuracy": 0.4, "cpu_s": 3.0}
    expected4 = {"reward": 0.5, "color_accuracy": 0.75, "eval_reward": 0.25, "eval_color_accuracy": 0.8, "cpu_s": 7.5}
    for got, expected in ((exact2["mean"], expected2), (exact4["mean"], expected4)):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value), key
    mix4 = summary["mix_jagg_cache"]["4"]["mean"]
    assert mix4["reward"] == pytest.approx(0.2) and math.isnan(mix4["eval_reward"])  # not evaluated at step 4
    table = markdown_table(summary)
    assert "| exact | 4 | 0,1 | **+0.500** [+0.400, +0.600] | **0.75** [0.60, 0.90] |" in table
    assert len(table.splitlines()) == 2 + 4  # header, rule, a row per variant and step


def test_time_to_reward_equals_a_hand_computation():
    """exact's target is the mean of its seeds' last evaluations ((0.15 + 0.35) / 2 = 0.25); each run's time is the
    CPU time at its first evaluation at or above it."""
    cpu = {1: 1.0, 2: 2.0, 3: 3.5, 4: 5.0}
    evals_exact0 = {1: (0.0, 0.3), 2: (0.05, 0.5), 3: (0.1, 0.5), 4: (0.15, 0.7)}  # never reaches 0.25
    evals_exact1 = {1: (0.1, 0.3), 2: (0.25, 0.3), 3: (0.3, 0.5), 4: (0.35, 0.9)}  # at step 2: 2 x 2.0 s
    evals_fast0 = {1: (0.1, 0.3), 2: (0.2, 0.3), 3: (0.26, 0.3), 4: (0.3, 0.3)}  # at step 3: 3.5 s
    evals_fast1 = {1: (0.3, 0.3), 2: (0.3, 0.3), 3: (0.3, 0.3), 4: (0.3, 0.3)}  # at step 1: 1.0 s
    evals_fast2 = {2: (0.4, 0.3), 4: (0.3, 0.3)}  # at step 2: 2.0 s
    flat = [0.1] * 4
    runs = [
        run_record("exact", 0, _history(flat, flat, evals_exact0), cpu),
        run_record("exact", 1, _history(flat, flat, evals_exact1), {k: 2 * v for k, v in cpu.items()}),
        run_record("fast_jagg_cache", 0, _history(flat, flat, evals_fast0), cpu),
        run_record("fast_jagg_cache", 1, _history(flat, flat, evals_fast1), cpu),
        run_record("fast_jagg_cache", 2, _history(flat, flat, evals_fast2), cpu),
        run_record("mix_jagg_cache", 0, _history(flat, flat, {4: (0.2, 0.3)}), cpu),
    ]
    table = time_to_reward(runs)
    assert table["target_eval_reward"] == pytest.approx(0.25) and table["at_step"] == 4
    assert table["reference_cpu_s"] == pytest.approx((5.0 + 10.0) / 2)  # exact's median CPU time to step 4
    exact, fast, mix = (table["variants"][v] for v in ("exact", "fast_jagg_cache", "mix_jagg_cache"))
    assert exact["step"] == [None, 2] and exact["cpu_s"] == [None, 4.0]
    assert exact["median_cpu_s"] is None and exact["speedup"] is None  # half the seeds never reach it
    assert fast["step"] == [3, 1, 2] and fast["cpu_s"] == [3.5, 1.0, 2.0]
    assert fast["median_cpu_s"] == 2.0 and fast["speedup"] == pytest.approx(7.5 / 2.0)
    assert fast["speedup_per_seed"] == pytest.approx([7.5 / 3.5, 7.5 / 1.0, 7.5 / 2.0])
    assert exact["speedup_per_seed"] == [None, pytest.approx(7.5 / 4.0)]
    assert mix["step"] == [None] and mix["median_cpu_s"] is None
    text = time_to_reward_table(table)
    assert "| fast_jagg_cache | **2** [4, 1, 2] | 3, 1, 2 | 3.75x [2.14, 7.50] |" in text  # 3.5 s prints as 4
    assert "| mix_jagg_cache | **not reached** [-] | - | - |" in text
    assert time_to_reward([runs[2]]) == {} and time_to_reward_table({}) == ""  # no exact run
    # Priced: the FLOPs of the work done up to the step reached (here 10 a backbone row, 1 a decoded image).
    for run in runs:
        run["work"] = [{"rows": 3 * step, "decoded_images": step} for step in run["step"]]
    priced = time_to_reward(runs, flops=lambda work: 10 * work["rows"] + work["decoded_images"])
    assert priced["reference_flops"] == 4 * 31  # both exact runs did the same work to step 4
    fast = priced["variants"]["fast_jagg_cache"]
    assert fast["flops"] == [3 * 31, 1 * 31, 2 * 31] and fast["median_flops"] == 2 * 31
    assert fast["flop_speedup"] == pytest.approx(2.0) and fast["speedup"] == pytest.approx(7.5 / 2.0)
    assert "| 3.75x [2.14, 7.50] | 2.00x [1.33, 4.00] |" in time_to_reward_table(priced)


def test_training_work_leaves_evaluation_out():
    class Counter:
        counts = {"rows": 0}
        closed = False

        def close(self):
            self.closed = True

    class State:
        global_step = 0

    counter, state = Counter(), State()
    work = TrainingWork(counter)
    work.on_train_begin(None, state, None)
    for step, rows in ((1, 5), (2, 10)):
        counter.counts["rows"], state.global_step = rows, step
        work.on_step_end(None, state, None)
    counter.counts["rows"] = 13  # an evaluation: 3 rows
    work.on_evaluate(None, state, None)
    counter.counts["rows"], state.global_step = 18, 3
    work.on_step_end(None, state, None)
    work.on_train_end(None, state, None)
    assert work.work == {1: {"rows": 5}, 2: {"rows": 10}, 3: {"rows": 15}} and counter.closed


def test_plot_draws_every_variant(tmp_path):
    runs = [
        run_record(variant, seed, _history([0.1 * seed, 0.2], [0.3, 0.4], {}), {1: 1.0 + seed, 2: 2.0 + seed})
        for variant in QUALITY_VARIANTS
        for seed in (0, 1)
    ]
    path = plot_quality(runs, str(tmp_path / "quality.png"))
    with Image.open(path) as png:
        assert png.width > 500


@pytest.mark.slow
def test_bench_quality_command_writes_json_and_png(tmp_path):
    """The command end to end, one variant (the mixed rollout, the most options) for 1 step: a few seconds of CPU.
    The three variants' configs are checked above; each costs about as much again."""
    from trl_jagg.scripts.bench import main

    out = tmp_path / "quality"
    argv = ["quality", "--output_dir", str(out), "--steps", "1", "--seeds", "3", "--eval_repeats", "1"]
    assert main([*argv, "--variants", "mix_jagg_cache", "--beta", "0"]) == 0
    report = json.loads((out / "quality.json").read_text())
    assert report["config"]["task"] == "color" and report["time_to_reward"] == {}  # no exact run to aim at
    assert report["config"]["beta"] == 0 and report["config"]["variants"]["mix_jagg_cache"]["beta"] == 0
    assert [(r["seed"], r["variant"]) for r in report["runs"]] == [(3, "mix_jagg_cache")]
    (run,) = report["runs"]
    assert run["step"] == [1] and run["cpu_s"][0] > 0
    assert math.isfinite(run["reward"][0]) and 0 <= run["color_accuracy"][0] <= 1
    assert set(run["eval"]) == {"1"} and math.isfinite(run["eval"]["1"]["reward"])
    assert report["config"]["eval_images"] == 9
    assert report["summary"]["mix_jagg_cache"]["1"]["seeds"] == [3]
    with Image.open(out / "quality.png") as png:
        assert png.width > 500


@pytest.mark.slow
def test_bench_quality_detail_task_reports_the_time_to_exacts_reward(tmp_path):
    """The second task end to end: exact and the fast variant for 2 steps, evaluated after each; the time to
    exact's reward is read from the runs' own evaluations and CPU times."""
    from trl_jagg.scripts.bench import main

    out = tmp_path / "quality"
    argv = ["quality", "--output_dir", str(out), "--steps", "2", "--seeds", "0", "--eval_repeats", "1",
            "--price_flux", "false", "--task"]  # fmt: skip
    assert main([*argv, "detail", "--eval_every", "1", "--variants", "exact", "fast_jagg_cache"]) == 0
    report = json.loads((out / "quality.json").read_text())
    assert report["config"]["reward"] == "high_frequency" and report["config"]["evaluated_steps"] == [1, 2]
    exact = next(r for r in report["runs"] if r["variant"] == "exact")
    assert set(exact["eval"]) == {"1", "2"}
    # The training work: 9 prompts x 8 images decoded a step (the evaluations' 9 each left out); each step runs the
    # rollout's backbone rows without a graph and the update's with one, backwards through them.
    for run in report["runs"]:
        assert [w["decoded_images"] for w in run["work"]] == [72, 144]
        assert run["work"][1]["backward_rows"] == 2 * run["work"][0]["backward_rows"] > 0
    table = report["time_to_reward"]
    assert table["target_eval_reward"] == exact["eval"]["2"]["reward"]  # one seed: its own last evaluation
    for run in report["runs"]:
        entry = table["variants"][run["variant"]]
        reached = [s for s in (1, 2) if run["eval"][str(s)]["reward"] >= table["target_eval_reward"]]
        assert entry["step"] == [reached[0] if reached else None]
        assert entry["cpu_s"] == [run["cpu_s"][reached[0] - 1] if reached else None]
    with pytest.raises(ValueError, match="task"):
        main([*argv, "texture"])


def test_paired_race_takes_each_seed_against_its_own_reference_run_and_a_target_over_its_last_evaluations():
    def run(variant, seed, rewards, cpu):  # evaluations at steps 10, 20, 30; CPU seconds at those steps
        return {"variant": variant, "seed": seed, "step": [10, 20, 30], "cpu_s": cpu,
                "eval": {str(s): {"reward": r} for s, r in zip((10, 20, 30), rewards)}}  # fmt: skip

    runs = [
        run("exact", 0, [0.1, 0.2, 0.3], [10.0, 20.0, 30.0]),
        run("exact", 1, [0.0, 0.2, 0.4], [12.0, 24.0, 36.0]),
        run("fast", 0, [0.25, 0.3, 0.5], [2.0, 4.0, 6.0]),
        run("fast", 1, [0.1, 0.1, 0.1], [3.0, 6.0, 9.0]),  # never reaches the target
    ]
    table = paired_race(runs, last_evaluations=2)
    # The target: the reference's last two evaluations over both seeds, (0.2 + 0.3 + 0.2 + 0.4) / 4.
    assert table["target_eval_reward"] == pytest.approx(0.275) and table["target_steps"] == [20, 30]
    fast = table["variants"]["fast"]
    # Seed 0 reaches 0.275 at step 20 (4 CPU s), against its own exact run's 30 s to the end; seed 1 never does.
    assert fast["cpu_s"] == [4.0, None] and fast["ratio"] == [pytest.approx(7.5), None]
    assert fast["min"] is None and fast["max"] == pytest.approx(7.5) and fast["median"] is None
    assert fast["final_mean"] == pytest.approx(0.3)
    exact = table["variants"]["exact"]  # seed 0 at step 30 (30 s of 30), seed 1 at step 30 (36 s of 36)
    assert exact["ratio"] == [pytest.approx(1.0), pytest.approx(1.0)] and exact["min"] == pytest.approx(1.0)
