"""The whole-step benchmark trains each preset through ``DDPOJaggTrainer.train()`` at its own cadence, counts the
work each rollout does by hooks and prices it with the FLOP model (never asserts on timings)."""

from __future__ import annotations

import json

import pytest
from torch.optim.optimizer import register_optimizer_step_post_hook

from trl_jagg.benchmarks import whole_step
from trl_jagg.benchmarks.flops import StepCosts
from trl_jagg.benchmarks.whole_step import JSON_NAME, PNG_NAME, run_whole_step_benchmark
from trl_jagg.recipes import get_recipe

# Made-up unit costs (the real ones take a minute to count on the meta device; tests/test_flops.py checks them).
COSTS = {
    "full": StepCosts(forward_row=10.0, backward_row=20.0, recompute_row=9.0, vae_decode=3.0, text_encode=1.0),
    "lora": StepCosts(forward_row=11.0, backward_row=12.0, recompute_row=10.0, vae_decode=3.0, text_encode=1.0),
}


def priced(counts: dict[str, int], costs: StepCosts, checkpointed: bool) -> float:
    backward = costs.backward_row + (costs.recompute_row if checkpointed else 0.0)
    rows = counts["graph_rows"] + counts["no_grad_rows"]
    return (
        rows * costs.forward_row + counts["backward_rows"] * backward + counts["decoded_images"] * costs.vae_decode
        + counts["encoded_prompts"] * costs.text_encode
    )  # fmt: skip


def test_the_preset_trains_at_its_cadence_and_memory_is_probed_outside_the_timed_rollouts(tmp_path, monkeypatch):
    monkeypatch.setattr(whole_step, "flux_dev_costs", lambda *args: COSTS)
    optimizer_steps = []
    hook = register_optimizer_step_post_hook(lambda *args: optimizer_steps.append(1))
    # The memory probe must never be active while the benchmark's clock is read.
    probing, clock_reads = [False], []

    class Probe:
        def __init__(self, device):
            pass

        def start(self):
            probing[0] = True

        def stop(self):
            probing[0] = False
            return 1.0

    def clock():
        clock_reads.append(probing[0])
        return 0.0 if len(clock_reads) % 2 else 1.0  # rollouts of 1 "second": the ratios are 1

    monkeypatch.setattr(whole_step, "PeakMemory", Probe)
    monkeypatch.setattr(whole_step, "benchmark_clock", lambda device: clock)
    try:
        report = run_whole_step_benchmark(
            str(tmp_path), variants=("dancegrpo-flux",), resolution=32, max_sequence_length=16, num_layers=1,
            num_single_layers=1, repeats=1,
        )  # fmt: skip
    finally:
        hook.remove()
    assert json.loads((tmp_path / JSON_NAME).read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / PNG_NAME).stat().st_size > 0
    exact, fast = report["results"]
    assert (exact["variant"], fast["variant"]) == ("dancegrpo-exact", "dancegrpo-flux")  # the baseline is added

    # dancegrpo-flux: 12 micro-batches of one sample per rollout, an optimizer step every 4 -> 3 per rollout.
    config = get_recipe("dancegrpo-flux").config
    per_rollout = (
        config["steps_per_generation"] * config.get("num_iterations", 1) // config["gradient_accumulation_steps"]
    )
    assert per_rollout == 3
    assert exact["optimizer_steps"] == fast["optimizer_steps"] == [per_rollout]  # the one timed rollout
    # Counted by torch: 2 trainers x (warm-up + timed + memory rollout) x 3 optimizer steps, all through train().
    assert len(optimizer_steps) == 2 * 3 * per_rollout

    assert clock_reads and not any(clock_reads)
    assert exact["peak_memory_mb"] == fast["peak_memory_mb"] == 1.0
    assert exact["probed_steps"] == [2 * per_rollout] and exact["first_steps"] == [per_rollout]

    # The exact update of the timed rollout: G = 12 samples x 16 SDE steps sampled (no shared prefix: every step
    # is stochastic), then a random 60% of the first 15 steps (9) trained per sample, each a one-row forward with
    # graph and its backward; 12 images decoded, the rollout's one prompt encoded.
    trained = round(config["train_timestep_fraction"] * (config["num_inference_steps"] - 1))
    samples, steps = config["num_generations"], config["num_inference_steps"]
    assert exact["counted"] == {
        "graph_rows": samples * trained, "no_grad_rows": samples * steps, "backward_rows": samples * trained,
        "decoded_images": samples, "encoded_prompts": 1,
    }  # fmt: skip
    assert fast["counted"]["backward_rows"] < exact["counted"]["backward_rows"]
    # Both priced as dancegrpo-flux trains (every block checkpointed) for full fine-tuning, as flow-grpo-flux (none)
    # for LoRA.
    assert fast["predicted_checkpointing"] == {"full": 1.0, "lora": 0.0}
    for training, checkpointed in (("full", True), ("lora", False)):
        ratio = priced(exact["counted"], COSTS[training], checkpointed) / priced(
            fast["counted"], COSTS[training], checkpointed
        )
        assert fast["predicted_speedup_vs_dancegrpo-exact"][training] == pytest.approx(ratio)
    assert fast["speedup_vs_dancegrpo-exact"]["per_repeat"] == [1.0] and "speedup_vs_dancegrpo-exact" not in exact
    assert fast["quality"] is None  # bench quality's figure, not measured here
    # The cache's served share under the default `recompute`: the intermediates of the micro-batches before each
    # rollout's first optimizer step (4 of 12), recomputed in the others; an exact update has none.
    assert exact["cache_served"] is None
    assert fast["cache_served"] == pytest.approx(
        config["gradient_accumulation_steps"] / (config["steps_per_generation"] * config.get("num_iterations", 1))
    )

    # Repricing the saved report at other costs recomputes the predictions from its counted work, and nothing else.
    saved = tmp_path / "saved.json"
    saved.write_text((tmp_path / JSON_NAME).read_text())
    dearer = {"full": StepCosts(10.0, 20.0, 9.0, 30.0, 1.0), "lora": StepCosts(11.0, 12.0, 10.0, 30.0, 1.0)}
    monkeypatch.setattr(whole_step, "flux_dev_costs", lambda *args: dearer)
    repriced = run_whole_step_benchmark(str(tmp_path / "repriced"), reprice_report=str(saved), plot=False)
    ratio = priced(exact["counted"], dearer["full"], True) / priced(fast["counted"], dearer["full"], True)
    assert repriced["results"][1]["predicted_speedup_vs_dancegrpo-exact"]["full"] == pytest.approx(ratio)
    for before, after in zip(report["results"], repriced["results"]):
        assert {k: v for k, v in after.items() if not k.startswith("predicted")} == json.loads(
            json.dumps({k: v for k, v in before.items() if not k.startswith("predicted")})
        )


def test_mixgrpo_is_compared_with_mixgrpo_flash():
    # MixGRPO-Flash (DPM-Solver++ after the window) with an exact update: mixgrpo-flux with use_jagg off.
    flash = whole_step.WHOLE_STEP_VARIANTS[whole_step.FLASH]
    assert (flash.preset, dict(flash.fields)) == ("mixgrpo-flux", {"use_jagg": False})
    assert get_recipe("mixgrpo-flux").config["ode_solver_order"] == 2
    assert whole_step.WHOLE_STEP_VARIANTS["mixgrpo-flux"].baselines == ("dancegrpo-exact", "mixgrpo-flash")
    assert whole_step.with_baselines(["mixgrpo-flux"]) == ("dancegrpo-exact", "mixgrpo-flash", "mixgrpo-flux")


def test_jagg_fast_flux_is_compared_with_its_own_rollout_trained_exactly():
    # What JAGG earns (vs the same rollout, exact update) apart from what the recipe changes (vs exact DanceGRPO).
    same_rollout = whole_step.WHOLE_STEP_VARIANTS[whole_step.FAST_EXACT]
    assert (same_rollout.preset, dict(same_rollout.fields)) == ("jagg-fast-flux", {"use_jagg": False})
    assert whole_step.FAST_EXACT in whole_step.WHOLE_STEP_VARIANTS["jagg-fast-flux"].baselines


def test_unknown_variant_raises(tmp_path):
    with pytest.raises(ValueError, match="Unknown `variants`"):
        run_whole_step_benchmark(str(tmp_path), variants=("mix_fast",))
