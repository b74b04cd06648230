"""The objective registry and the objectives on it: every registered objective trains through ``train()`` (LoRA and
full fine-tuning), resumes bit-exact with its state, and gives JAGG's exact limit at W = 2; AWM and DGPO end to end
(their losses against the papers' formulas are in test_awm.py and test_dgpo.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from test_nft import LinearVelocity, TanhVelocity  # the toy velocities of DiffusionNFT's JAGG tests
from testing_utils import PROMPTS, engine_and_exact_gradients, redness, update_gradient

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.objectives import OBJECTIVES, get_objective
from trl_jagg.objectives.update import UpdateStage
from trl_jagg.trainer.old_policy import OLD_POLICY_FILE

FORWARD = ("nft", "awm", "dgpo")
"""The forward-process objectives (trained on clean samples, deterministic ODE rollouts)."""

SETTINGS = {
    "nft": dict(train_timestep_fraction=0.8),
    # 4 strata of width 1 over the indices [0, int(5 * 0.9)): timesteps 0..3, two W = 2 groups.
    "awm": dict(awm_num_train_timesteps=4, awm_timestep_fraction=0.9, awm_ema_kl_beta=0.5),
    # the authors' clip range; the old policy samples from step 1 on, so resume must restore it.
    "dgpo": dict(dgpo_trunc_steps=3, dgpo_num_train_timesteps=4, epsilon=0.05, dgpo_sample_old_policy_after=1),
}


def objective_trainer(path, tmp_path, objective, *, lora=True, **overrides) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    args = dict(
        output_dir=str(tmp_path / "out"), objective=objective, per_device_train_batch_size=4, num_generations=2,
        num_inference_steps=5, height=32, width=32, max_steps=2, learning_rate=1e-2, max_sequence_length=16,
        report_to="none", save_strategy="no", seed=0, disable_tqdm=True, jagg_group_size=2, jagg_frac=1.0,
        beta=1e-4, lr_scheduler_type="constant", **SETTINGS[objective],
    )  # fmt: skip
    args.update(overrides)
    lora_config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian")
    return DDPOJaggTrainer(
        model=path,
        reward_funcs=redness,
        args=GRPOJaggConfig(**args),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=lora_config if lora else None,
    )


# ---------------------------------------------------------------- the registry
def test_every_registered_objective_names_its_update_stage_and_fields():
    config_fields = {f.name: f for f in dataclasses.fields(GRPOJaggConfig)}
    assert set(OBJECTIVES) == {"grpo", "nft", "awm", "dgpo"}
    for name, spec in OBJECTIVES.items():
        assert get_objective(name) is spec and spec.name == name
        assert issubclass(spec.update_stage_class(), UpdateStage), name
        assert set(spec.fields) <= set(config_fields), name
        assert set(spec.refused) <= set(config_fields), name
        assert spec.citation.startswith("@article"), name
        # A field belongs to one objective.
        others = {f for other in OBJECTIVES.values() if other is not spec for f in other.fields}
        assert not set(spec.fields) & others, name
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        get_objective("ppo")
    with pytest.raises(ValueError, match="GRPOJaggConfig.objective is 'ppo'"):
        GRPOJaggConfig(output_dir="unused", objective="ppo", report_to="none")


@pytest.mark.parametrize("objective", ["awm", "dgpo"])
def test_a_forward_process_objective_refuses_the_grpo_only_settings(objective):
    for name, value in (("sde_window_size", 2), ("drop_zero_advantages", True), ("ratio_normalization", True)):
        kwargs = dict(SETTINGS[objective], output_dir="unused", objective=objective, report_to="none")
        if name == "sde_window_size":
            kwargs["train_timesteps"] = "sde_window"
        with pytest.raises(ValueError, match=f"GRPOJaggConfig.{name} is .* with objective='{objective}'"):
            GRPOJaggConfig(**kwargs, **{name: value})


# GRPO's settings that a deterministic-ODE rollout and a forward-noised update never read, each with a value other
# than its default (from the rollout code: the sampler, its noise and the KL's std act on SDE steps only; the velocity
# cache and the probe serve GRPO trajectory groups). Written here, not read from the registry, so that a field
# dropped from the registry's refusals fails this test.
GRPO_ONLY = {
    "sampler": "cps", "noise_level": 0.5, "train_timesteps": "all", "kl_std": "flow_grpo",
    "step_gradient_reweighting": True, "jagg_cache_velocities": False, "jagg_cache_mode": "corrected",
    "jagg_cache_tolerance": 0.5, "jagg_probe_steps": 7,
}  # fmt: skip


@pytest.mark.parametrize("objective", ["nft", "awm", "dgpo"])
@pytest.mark.parametrize("name", sorted(GRPO_ONLY))
def test_a_forward_process_objective_refuses_a_grpo_setting_it_would_ignore(objective, name):
    kwargs = dict(SETTINGS[objective], output_dir="unused", objective=objective, report_to="none")
    with pytest.raises(ValueError, match=f"GRPOJaggConfig.{name} is .* with objective='{objective}'. .*default"):
        GRPOJaggConfig(**kwargs, **{name: GRPO_ONLY[name]})
    GRPOJaggConfig(**kwargs)  # the defaults pass


@pytest.mark.parametrize("objective", ["nft", "awm", "dgpo"])
def test_a_forward_process_objective_refuses_the_grpo_probe_for_jagg_frac(objective):
    kwargs = dict(SETTINGS[objective], output_dir="unused", objective=objective, report_to="none")
    with pytest.raises(ValueError, match=f"GRPOJaggConfig.jagg_frac is 'auto' with objective='{objective}'"):
        GRPOJaggConfig(**kwargs, jagg_frac="auto")


@pytest.mark.parametrize("name, value", [("epsilon", 0.2), ("epsilon_high", 0.3)])
def test_nft_refuses_a_clip_range_it_has_no_ratio_for(name, value):
    with pytest.raises(ValueError, match=f"GRPOJaggConfig.{name} is {value} with objective='nft'"):
        GRPOJaggConfig(output_dir="unused", objective="nft", report_to="none", **{name: value})


def test_awm_refuses_more_than_one_optimizer_step_per_rollout():
    """The authors' AWM is on-policy (one optimizer step per rollout): a second step would need the rollout
    policy's log-probabilities, which this update does not keep."""
    with pytest.raises(ValueError, match="2 optimizer steps per rollout with objective='awm'"):
        GRPOJaggConfig(output_dir="unused", objective="awm", steps_per_generation=2, report_to="none")


def test_dgpo_refuses_micro_batches_that_split_a_group_and_a_grpo_scale_clip():
    base = dict(output_dir="unused", objective="dgpo", report_to="none", num_generations=4)
    with pytest.raises(ValueError, match="per_device_train_batch_size is 6 with num_generations=4"):
        GRPOJaggConfig(**base, epsilon=0.05, per_device_train_batch_size=6)
    with pytest.raises(ValueError, match="GRPOJaggConfig.epsilon is 0.0001 with objective='dgpo'"):
        GRPOJaggConfig(**base, per_device_train_batch_size=8)


@pytest.mark.parametrize("field, value", [("awm_weighting", "t"), ("dgpo_beta", 10.0), ("nft_beta", 0.5)])
def test_an_objectives_field_with_another_objective_is_refused(field, value):
    with pytest.raises(ValueError, match=f"GRPOJaggConfig.{field} is .* it acts only with objective="):
        GRPOJaggConfig(output_dir="unused", report_to="none", **{field: value})


# ---------------------------------------------------------------- through train()
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("objective", ["awm", "dgpo"])
def test_the_objective_trains_through_train(tiny_flux_path, tmp_path, objective, lora):
    trainer = objective_trainer(tiny_flux_path, tmp_path, objective, lora=lora)
    before = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    trainer.train()
    after = [p for p in trainer.model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the loss moved the weights
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {f"{objective}/policy_loss", f"{objective}/kl", "engine/jagg/groups_jagg"} <= logged
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    # Two W = 2 groups of the 4 trained timesteps: two joint backwards per micro-batch.
    assert trainer._metrics == {} or trainer._metrics.get("jagg/backward_calls", [2])[-1] == 2
    trainer.save_model()
    card = open(os.path.join(trainer.args.output_dir, "README.md")).read()
    spec = get_objective(objective)
    assert f"aligned with {spec.title}" in card and f"- {spec.tags[0]}" in card


@pytest.mark.parametrize("objective", FORWARD)
def test_w2_jagg_equals_exact_with_the_same_noise(tiny_flux_path, tmp_path, objective):
    """JAGG's exact limit through each forward-process stage: W = 2 groups give the gradient of the same groups
    taken exactly (one eps per group), up to float32 rounding; exact never equals a zero gradient."""
    trainer = objective_trainer(tiny_flux_path, tmp_path, objective)
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    assert rollout.stochastic_steps == []  # the deterministic ODE rollout
    exact = update_gradient(trainer, rollout, jagg_mode="exact")
    jagg = update_gradient(trainer, rollout, jagg_mode="jagg")
    assert exact.abs().max() > 1e-5
    torch.testing.assert_close(jagg, exact, atol=1e-5 * exact.abs().max().item(), rtol=0)
    assert trainer._metrics["jagg/groups_jagg"][-1] == 2 and trainer._metrics["jagg/backward_calls"][-1] == 2


@pytest.mark.parametrize("objective", ["awm", "dgpo"])
def test_a_resumed_run_ends_with_the_weights_and_state_of_an_uninterrupted_one(tiny_flux_path, tmp_path, objective):
    whole = objective_trainer(tiny_flux_path, tmp_path / "whole", objective, max_steps=3)
    whole.train()
    cut = objective_trainer(
        tiny_flux_path, tmp_path / "cut", objective, max_steps=2, save_strategy="steps", save_steps=2
    )
    cut.train()
    checkpoint = os.path.join(cut.args.output_dir, "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, OLD_POLICY_FILE))  # the objective's state is saved
    resumed = objective_trainer(tiny_flux_path, tmp_path / "cut", objective, max_steps=3)
    resumed.train(resume_from_checkpoint=checkpoint)
    state = {"awm": "kl_ema", "dgpo": "old_policy"}[objective]
    for a, b in zip(getattr(whole.update_stage, state).weights, getattr(resumed.update_stage, state).weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bit-exact resume is the property under test
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Another objective that keeps an old policy does not take this one's.
    other = "dgpo" if objective == "awm" else "awm"
    from trl_jagg.utils.errors import CheckpointError

    wrong = objective_trainer(tiny_flux_path, tmp_path / "cut", other, max_steps=3)
    with pytest.raises(CheckpointError, match=f"old-policy state of objective='{objective}'"):
        wrong.train(resume_from_checkpoint=checkpoint)


# ---------------------------------------------------------------- JAGG's exact limits on the objectives' losses
def forward_objective_gradients(objective, model, times, group_size, mode="jagg"):
    """One batch of 4 samples (2 groups of 2) at ``times`` with one eps per JAGG group, the objective's loss per
    timestep: the engine's gradient and the exact sum of per-timestep gradients taken here one by one."""
    from trl_jagg.core.awm import awm_loss
    from trl_jagg.core.dgpo import dgpo_loss
    from trl_jagg.core.jagg import plan_groups
    from trl_jagg.core.nft import forward_noised

    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5], dtype=torch.float64)
    reference = LinearVelocity(4)
    groups = plan_groups(times, group_size, 1.0, mode)
    eps = {}
    for g in groups:  # one eps per group
        noise = torch.randn(4, 4, generator=gen, dtype=torch.float64)
        eps.update(dict.fromkeys(g.steps, noise))
    t_of = [torch.full((4,), s, dtype=torch.float64) for s in times]
    x_t = [forward_noised(x0, eps[i], t_of[i]) for i in range(len(times))]
    with torch.no_grad():
        ref = [reference(x_t[i], t_of[i]) for i in range(len(times))]

    def loss_fn(i, v):
        if objective == "awm":
            return awm_loss(v, x0, eps[i], t_of[i], advantages, ref_velocity=ref[i], kl_beta=0.1).loss
        return dgpo_loss(
            v, x0, eps[i], advantages, torch.tensor([0, 0, 1, 1]), ref[i], num_groups=2, group_size=2, dpo_beta=10.0
        ).loss

    return engine_and_exact_gradients(model, groups, x_t, t_of, loss_fn)


@pytest.mark.parametrize("objective", ["awm", "dgpo"])
def test_jagg_across_timesteps_is_exact_for_a_velocity_linear_in_x_and_t(objective):
    """Theorem 1 across the objective's timesteps: one eps per group puts x_t on a line in t, so a velocity linear in
    (x, t) makes the interpolated Jacobian exact (float64: rounding only), and W = 2 is exact for any velocity."""
    times = [0.95, 0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05]
    jagg, exact = forward_objective_gradients(objective, LinearVelocity(4), times, group_size=4)
    assert exact.abs().max() > 1e-3
    torch.testing.assert_close(jagg, exact, rtol=1e-10, atol=1e-12)
    ablation, _ = forward_objective_gradients(objective, LinearVelocity(4), times, group_size=4, mode="endpoints")
    assert (ablation - exact).abs().max() > 1e-3  # the test can fail: dropping the intermediates is not exact
    pairs, exact = forward_objective_gradients(objective, TanhVelocity(4), times, group_size=2)
    torch.testing.assert_close(pairs, exact, rtol=1e-10, atol=1e-12)
    wider, _ = forward_objective_gradients(objective, TanhVelocity(4), times, group_size=4)
    assert (wider - exact).abs().max() > 1e-6  # W = 4 on a nonlinear velocity is an approximation


# ---------------------------------------------------------------- on two processes
@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
@pytest.mark.parametrize("objective", ["awm", "dgpo"])
def test_the_objective_on_two_processes_resumes_bit_exactly(tiny_flux_path, tmp_path, objective, backend):
    """AWM and DGPO on 2 gloo processes under torchrun, DDP or the LoRA backbone sharded by FSDP2: a run resumed
    from checkpoint-2 ends with the weights and the objective state of the uninterrupted run (bit-exact is the
    property: the same operations on the same numbers), on each rank's part of the state; the checkpoints hold the
    state whole (one tensor per trainable weight)."""
    from safetensors.torch import load_file
    from test_distributed import _torchrun

    _torchrun("objective_sharded", str(tmp_path), tiny_flux_path, objective, backend, timeout=600)
    whole, resumed = (load_file(str(tmp_path / f"{run}.safetensors")) for run in ("whole", "resumed"))
    initial = load_file(str(tmp_path / "whole" / "checkpoint-1" / OLD_POLICY_FILE))  # saved after step 1
    assert sorted(whole) == sorted(resumed) and len(initial) == len(whole)
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=0)
    states = {
        (run, rank): load_file(str(tmp_path / f"{run}_state{rank}.safetensors"))
        for run in ("whole", "resumed")
        for rank in (0, 1)
    }
    for rank in (0, 1):
        for key, value in states[("whole", rank)].items():
            torch.testing.assert_close(states[("resumed", rank)][key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("value", "fix"),
    [(0.0, "Use a positive guidance strength up to 1000"), (1e30, "Use a positive guidance strength up to 1000"),
     (float("inf"), "Use a finite number")],
)  # fmt: skip
def test_an_nft_beta_that_would_overflow_the_loss_is_refused_early(value, fix):
    """Issue 42: nft_beta=1e30 used to be accepted and end in a non-finite loss; it is refused when the config is
    built, naming the field and the fix."""
    with pytest.raises(ValueError, match=f"GRPOJaggConfig.nft_beta is .*{fix}"):
        GRPOJaggConfig(output_dir="unused", objective="nft", nft_beta=value, report_to="none")
