"""DiffusionNFT (``objective="nft"``): the loss against the paper's formula written out here, the old policy's decay,
JAGG across NFT timesteps at its exact limits, and training the demo end to end."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from testing_utils import PROMPTS, engine_and_exact_gradients, redness, update_gradient

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.core.jagg import plan_groups
from trl_jagg.core.nft import forward_noised, nft_loss, old_policy_decay, optimality_probability
from trl_jagg.trainer.old_policy import OLD_POLICY_FILE, OldPolicy


def nft_loss_by_hand(v, v_old, x0, eps, t, advantages, beta, clip, v_ref=None, kl_beta=0.0):
    """The paper's negative-aware loss (arXiv 2509.16117, eq. for L(theta) with the reference code's adaptive weights
    and scale), in float64, one sample and one formula at a time."""
    total = 0.0
    batch = x0.shape[0]
    for b in range(batch):
        a = min(max(float(advantages[b]), -clip), clip)
        r = min(max(a / clip / 2 + 0.5, 0.0), 1.0)
        x_t = (1 - t[b]) * x0[b] + t[b] * eps[b]
        positive = beta * v[b] + (1 - beta) * v_old[b]
        negative = (1 + beta) * v_old[b] - beta * v[b]
        pos_err = x_t - t[b] * positive - x0[b]
        neg_err = x_t - t[b] * negative - x0[b]
        pos_w = max(pos_err.detach().abs().mean().item(), 1e-5)
        neg_w = max(neg_err.detach().abs().mean().item(), 1e-5)
        per_sample = (r * (pos_err**2).mean() / pos_w + (1 - r) * (neg_err**2).mean() / neg_w) / beta
        total = total + clip * per_sample / batch
        if v_ref is not None:
            total = total + kl_beta * ((v[b] - v_ref[b]) ** 2).mean() / batch
    return total


@pytest.mark.parametrize("with_kl", [False, True])
def test_nft_loss_matches_the_papers_formula(with_kl):
    gen = torch.Generator().manual_seed(0)
    shape = (3, 4, 5)
    x0, eps, v_old, v_ref = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    v = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.9, 0.5, 0.2], dtype=torch.float64)
    advantages = torch.tensor([7.0, -1.3, 0.4], dtype=torch.float64)  # the first beyond the clip
    kwargs = {"v_ref": v_ref, "kl_beta": 0.3} if with_kl else {}
    expected = nft_loss_by_hand(v, v_old, x0, eps, t, advantages, 0.7, 5.0, **kwargs)
    (expected_grad,) = torch.autograd.grad(expected, v)
    out = nft_loss(
        v, v_old, x0, forward_noised(x0, eps, t), t, optimality_probability(advantages, 5.0), nft_beta=0.7,
        adv_clip_max=5.0, ref_velocity=v_ref if with_kl else None, kl_beta=0.3 if with_kl else 0.0,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, v)
    # float64 on both sides, the same operations in another order: equal to rounding.
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)


def test_at_the_old_policy_a_neutral_sample_has_no_gradient():
    """With v = v_old the positive and negative predictions coincide: r = 1/2 pulls both ways equally (the paper's
    neutral sample), r = 1 pulls like the flow-matching loss scaled by beta."""
    gen = torch.Generator().manual_seed(1)
    x0, eps, v_old = (torch.randn(2, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([0.6, 0.3], dtype=torch.float64)
    v = v_old.clone().requires_grad_(True)
    x_t = forward_noised(x0, eps, t)
    neutral = nft_loss(v, v_old, x0, x_t, t, torch.full((2,), 0.5, dtype=torch.float64), nft_beta=1.0, adv_clip_max=5)
    (grad,) = torch.autograd.grad(neutral.loss, v)
    assert grad.abs().max() < 1e-12
    positive = nft_loss(v, v_old, x0, x_t, t, torch.ones(2, dtype=torch.float64), nft_beta=1.0, adv_clip_max=5)
    (grad,) = torch.autograd.grad(positive.loss, v)
    # d/dv of 5 * mean_b mean((x_t - t v - x0)^2) / w_b at v = v_old, w_b = mean |x_t - t v - x0|
    err = x_t - t[:, None] * v_old - x0
    expected = 5 * (-2 * t[:, None] * err / err.abs().mean(dim=1, keepdim=True)) / err.shape[1] / 2
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=0)


def test_old_policy_decay_follows_the_reference_schedules():
    # NVlabs/DiffusionNFT scripts/train_nft_sd3.py:169-189 (return_decay), values worked out by hand.
    table = {
        (0, 0): 0.0, (0, 1000): 0.0,
        (1, 0): 0.0, (1, 100): 0.1, (1, 499): 0.499, (1, 500): 0.5, (1, 9000): 0.5,
        (2, 0): 0.0, (2, 74): 0.0, (2, 75): 0.0, (2, 100): 0.1875, (2, 208): 0.9975, (2, 400): 0.999,
    }  # fmt: skip
    for (decay_type, step), expected in table.items():
        assert old_policy_decay(step, decay_type) == pytest.approx(expected, abs=1e-12), (decay_type, step)
    with pytest.raises(ValueError, match="decay_type"):
        old_policy_decay(1, 3)


def test_old_policy_follows_swaps_and_round_trips(tmp_path):
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    policy = OldPolicy(lambda: [weight], functools.partial(old_policy_decay, decay_type=1))
    with torch.no_grad():
        weight.copy_(torch.tensor([3.0, 6.0]))
    policy.follow(100)  # decay 0.1: 0.1 * old + 0.9 * current
    torch.testing.assert_close(policy.weights[0], torch.tensor([2.8, 5.6]))
    policy.follow(100)  # the same step again: no second move
    torch.testing.assert_close(policy.weights[0], torch.tensor([2.8, 5.6]))
    with policy.swapped_in():
        torch.testing.assert_close(weight.detach(), torch.tensor([2.8, 5.6]))
    torch.testing.assert_close(weight.detach(), torch.tensor([3.0, 6.0]))
    policy.save(str(tmp_path), checkpoint_step=100)
    other = OldPolicy(lambda: [weight], functools.partial(old_policy_decay, decay_type=1))
    other.load(str(tmp_path))
    assert other.followed_step == 100
    torch.testing.assert_close(other.weights[0], policy.weights[0], rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="objective='nft'"):
        other.load(str(tmp_path / "missing"))


class LinearVelocity(torch.nn.Module):
    """v = x A + t b + c: linear in (x, t), so along x_t = (1 - t) x0 + t eps its Jacobian is linear in t."""

    def __init__(self, dim: int):
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.a = torch.nn.Parameter(torch.randn(dim, dim, generator=gen, dtype=torch.float64) / dim)
        self.b = torch.nn.Parameter(torch.randn(dim, generator=gen, dtype=torch.float64))
        self.c = torch.nn.Parameter(torch.randn(dim, generator=gen, dtype=torch.float64))

    def forward(self, x, t):
        return x @ self.a + t[:, None] * self.b + self.c


class TanhVelocity(LinearVelocity):
    def forward(self, x, t):
        return torch.tanh(super().forward(x, t)) * (1 + t[:, None])


def jagg_nft_gradients(model, times, group_size, jagg_frac, mode="jagg"):
    """The NFT gradient of one sample batch at ``times`` (one eps per group), through the JAGG engine, and the exact
    sum of per-timestep gradients computed here step by step."""
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    v_old_model = LinearVelocity(4)
    groups = plan_groups(times, group_size, jagg_frac, mode)
    eps = {i: torch.randn(2, 4, generator=gen, dtype=torch.float64) for g in groups for i in g.steps}
    for g in groups:  # one eps per group
        for i in g.steps:
            eps[i] = eps[g.steps[0]]
    t_of = [torch.full((2,), s, dtype=torch.float64) for s in times]
    x_t = [forward_noised(x0, eps[i], t_of[i]) for i in range(len(times))]
    with torch.no_grad():
        v_old = [v_old_model(x_t[i], t_of[i]) for i in range(len(times))]
    optimality = torch.tensor([0.8, 0.3], dtype=torch.float64)

    def loss_fn(i, v):
        return nft_loss(v, v_old[i], x0, x_t[i], t_of[i], optimality, nft_beta=1.0, adv_clip_max=5.0).loss

    return engine_and_exact_gradients(model, groups, x_t, t_of, loss_fn)


def test_jagg_nft_is_exact_for_a_velocity_linear_in_x_and_t():
    """Theorem 1 across NFT timesteps: one eps per group puts x_t on a line in t, so a velocity linear in (x, t) has
    a Jacobian linear in t and the interpolated one is exact (float64: rounding only)."""
    times = [0.95, 0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05]
    jagg, exact = jagg_nft_gradients(LinearVelocity(4), times, group_size=4, jagg_frac=1.0)
    assert exact.abs().max() > 1e-3
    torch.testing.assert_close(jagg, exact, rtol=1e-10, atol=1e-12)
    # The test can fail: dropping the intermediate signals (the ``endpoints`` ablation) is not exact.
    ablation, _ = jagg_nft_gradients(LinearVelocity(4), times, group_size=4, jagg_frac=1.0, mode="endpoints")
    assert (ablation - exact).abs().max() > 1e-3


def test_jagg_nft_with_two_timesteps_is_exact_for_any_velocity():
    times = [0.9, 0.7, 0.4, 0.1]
    jagg, exact = jagg_nft_gradients(TanhVelocity(4), times, group_size=2, jagg_frac=1.0)
    torch.testing.assert_close(jagg, exact, rtol=1e-10, atol=1e-12)
    wider, _ = jagg_nft_gradients(TanhVelocity(4), times, group_size=4, jagg_frac=1.0)
    assert (wider - exact).abs().max() > 1e-6  # W = 4 on a nonlinear velocity is an approximation


def nft_trainer(path, tmp_path, **overrides) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    args = dict(
        output_dir=str(tmp_path / "out"), objective="nft", per_device_train_batch_size=4, num_generations=2,
        num_inference_steps=5, height=32, width=32, max_steps=2, learning_rate=1e-2, max_sequence_length=16,
        report_to="none", save_strategy="no", seed=0, disable_tqdm=True, train_timestep_fraction=0.8,
        jagg_group_size=2, jagg_frac=1.0, beta=1e-4,
    )  # fmt: skip
    args.update(overrides)
    return DDPOJaggTrainer(
        model=path,
        reward_funcs=redness,
        args=GRPOJaggConfig(**args),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"
        ),
    )


def test_nft_update_w2_jagg_equals_exact_on_flux(tiny_flux_path, tmp_path):
    """The trainer's NFT stage on a tiny Flux: W = 2 JAGG groups (4 trained timesteps) give the gradient of the same
    groups taken exactly (the same eps per group), up to float32 rounding."""
    trainer = nft_trainer(tiny_flux_path, tmp_path)
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    assert rollout.stochastic_steps == []  # the deterministic ODE rollout
    exact = update_gradient(trainer, rollout, jagg_mode="exact")
    jagg = update_gradient(trainer, rollout, jagg_mode="jagg")
    assert exact.abs().max() > 1e-4
    torch.testing.assert_close(jagg, exact, atol=1e-5 * exact.abs().max().item(), rtol=0)
    assert trainer._metrics["jagg/groups_jagg"][-1] == 2 and trainer._metrics["jagg/backward_calls"][-1] == 2


def test_nft_resume_samples_with_the_saved_old_policy(tiny_flux_path, tmp_path):
    """Checkpoints hold the old policy; a run resumed from one ends with the weights of an uninterrupted run."""
    common = {"lr_scheduler_type": "constant", "nft_decay_type": 1}  # decay 0.001 per step: old != current
    whole = nft_trainer(tiny_flux_path, tmp_path / "whole", max_steps=3, **common)
    whole.train()
    whole.save_model()
    card = open(os.path.join(whole.args.output_dir, "README.md")).read()
    assert "aligned with DiffusionNFT" in card and "- diffusion-nft" in card and "arXiv:2509.16117" in card
    interrupted = nft_trainer(
        tiny_flux_path, tmp_path / "cut", max_steps=2, save_strategy="steps", save_steps=2, **common
    )
    interrupted.train()
    checkpoint = os.path.join(interrupted.args.output_dir, "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, OLD_POLICY_FILE))
    resumed = nft_trainer(tiny_flux_path, tmp_path / "cut", max_steps=3, **common)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.update_stage.old_policy.followed_step == whole.update_stage.old_policy.followed_step == 2
    for a, b in zip(whole.update_stage.old_policy.weights, resumed.update_stage.old_policy.weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bit-exact resume is the property under test
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nft_trains_the_demo_to_a_rising_held_out_reward(tmp_path):
    """NFT (exact, no JAGG) on the CPU demo, seed 0, 40 steps at the demo's learning rate: the 18 held-out images (9
    prompts x 2 seeds, the evaluation's ODE) in the named colour rise from 9 to 18 in the run that set this test
    (reward 0.02 -> 0.28); asserted with a margin of 4 images and 0.1 reward."""
    from trl_jagg.benchmarks.nft import NFT_DEMO_OVERRIDES
    from trl_jagg.demo.run import DEMO_ASSET_DIR, demo_prompts, demo_trainer

    trainer = demo_trainer(
        str(DEMO_ASSET_DIR), str(tmp_path), steps=40, seed=0, eval_dataset=Dataset.from_dict({"prompt": demo_prompts() * 2}),
        save_strategy="no", report_to="none", **{**NFT_DEMO_OVERRIDES, "use_jagg": False},
    )  # fmt: skip
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    in_colour = [round(m["eval_rewards/color_accuracy/mean"] * 18) for m in (before, after)]
    assert in_colour[1] >= in_colour[0] + 4, in_colour
    assert after["eval_rewards/prompt_color/mean"] >= before["eval_rewards/prompt_color/mean"] + 0.1


def test_nft_jagg_benchmark_writes_its_report(tmp_path):
    """`trl-jagg bench nft-jagg` on a tiny setting: one seed, a measurement before and after one step, against
    exact shared-noise NFT and DiffusionNFT's fresh-noise NFT."""
    import json

    from trl_jagg.benchmarks.nft import JSON_NAME, PNG_NAME, run_nft_jagg_benchmark

    report = run_nft_jagg_benchmark(str(tmp_path), seeds=[0], checkpoints=[0, 1], repeats=1)
    assert [(r["seed"], r["step"]) for r in report["rows"]] == [(0, 0), (0, 1)]
    for row in report["rows"]:
        assert -1 <= row["cosine"] <= 1 and row["relative_error"] >= 0
        speedup = row["update_speedup"]
        assert speedup["min"] <= speedup["median"] <= speedup["max"]
        # DiffusionNFT's fresh-noise update (use_jagg=False) is the baseline too: another noise draw, so another
        # gradient than exact shared-noise NFT's, and JAGG is compared with it.
        assert row["shared_fresh_cosine"] < 1 - 1e-6 and row["fresh_relative_error"] > 0
        assert -1 <= row["fresh_cosine"] <= 1
    for name, spread in report["summary"].items():
        values = [row[name] for row in report["rows"]]
        assert (spread["min"], spread["max"]) == (min(values), max(values)), name
    assert json.loads((tmp_path / JSON_NAME).read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / PNG_NAME).stat().st_size > 0


@pytest.fixture(scope="module")
def nft_checkpoints(tiny_flux_path, tmp_path_factory):
    """An NFT run saved at steps 1 and 2 (read-only: each test copies what it damages)."""
    run = tmp_path_factory.mktemp("nft_saved")
    trainer = nft_trainer(tiny_flux_path, run, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    return run / "out"


def _copied_run(nft_checkpoints, tmp_path):
    import shutil

    shutil.copytree(nft_checkpoints, tmp_path / "out")
    return tmp_path / "out" / "checkpoint-2"


@pytest.mark.parametrize("damage", ["other_objective", "copied_from_checkpoint_1", "truncated", "unstamped"])
def test_resume_refuses_an_old_policy_that_is_not_the_runs_own(tiny_flux_path, nft_checkpoints, tmp_path, damage):
    """Issue 42: the old policy carries its own stamp (safetensors metadata: the step it followed, the checkpoint
    step it was saved with). A GRPO resume of an NFT checkpoint, an old policy copied from another save, a truncated
    file and one without its stamp are each a named CheckpointError before anything is loaded."""
    from safetensors.torch import load_file, save_file

    from trl_jagg.utils.errors import CheckpointError

    checkpoint = _copied_run(nft_checkpoints, tmp_path)
    file = checkpoint / OLD_POLICY_FILE
    objective = "grpo" if damage == "other_objective" else "nft"
    if damage == "copied_from_checkpoint_1":
        file.write_bytes((checkpoint.parent / "checkpoint-1" / OLD_POLICY_FILE).read_bytes())
    elif damage == "truncated":
        file.write_bytes(file.read_bytes()[:100])
    elif damage == "unstamped":
        save_file(load_file(str(file)), str(file))
    expected = {
        "other_objective": "saved by a DiffusionNFT run", "copied_from_checkpoint_1": "from another save",
        "truncated": "truncated or corrupt", "unstamped": "not written by this trainer",
    }[damage]  # fmt: skip
    resumed = nft_trainer(tiny_flux_path, tmp_path, max_steps=3, objective=objective)
    with pytest.raises(CheckpointError, match=expected):
        resumed.train(resume_from_checkpoint=str(checkpoint))
