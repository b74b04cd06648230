"""GRPO pieces (`trl_jagg.core.grpo`): advantages, the PPO-clipped step loss and the KL term, against hand computations."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from testing_utils import gdpo_by_hand
from torch.distributions import Normal, kl_divergence

from trl_jagg.core.grpo import (
    PerPromptStatTracker,
    group_advantages,
    guard_log_ratio,
    kl_to_reference,
    multi_reward_advantages,
    per_reward_group_normalize,
    ppo_step_loss,
)
from trl_jagg.core.jagg import upstream_signal
from trl_jagg.core.sampling import sampler_step


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: one intra-op thread is faster and immune to spin-waiting on a shared, busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


REWARDS = [0.1, 0.7, 0.3, 0.9, 2.0, 2.5, 1.0, 4.5]  # two prompts, G = 4


def _hand_advantages(rewards, group_size, scale_by="group", clip=5.0, eps=1e-4):
    """Advantages with the statistics module: (r - group mean) / (sample std + eps), clipped."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = statistics.fmean(group)
        if scale_by == "group":
            scale = statistics.stdev(group) + eps
        elif scale_by == "batch":
            scale = statistics.stdev(rewards) + eps
        else:
            scale = 1.0
        out.extend(0.0 if r == mean else (r - mean) / scale for r in group)  # 0 / 0 in a constant group is 0
    return [max(-clip, min(clip, a)) for a in out] if clip is not None else out


# --- advantages --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_by", ["group", "batch", "none"])
def test_group_advantages_match_hand_computation(scale_by):
    got = group_advantages(torch.tensor(REWARDS), 4, scale_by=scale_by, clip=None)
    expected = _hand_advantages(REWARDS, 4, scale_by=scale_by, clip=None)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_group_advantages_of_a_group_sum_to_zero_and_use_group_std_plus_eps():
    got = group_advantages(torch.tensor(REWARDS), 4)
    assert got.view(2, 4).sum(dim=1).abs().max() < 1e-5
    # A constant group has zero std: the 1e-4 keeps it finite (and zero).
    flat = group_advantages(torch.tensor([3.0, 3.0, 3.0, 3.0]), 4)
    assert torch.all(flat == 0)
    # Two samples differing by 2e-4: sample std = sqrt(2) * 1e-4, so |A| = 1e-4 / (sqrt(2) * 1e-4 + 1e-4).
    tiny = group_advantages(torch.tensor([0.0, 2e-4], dtype=torch.float64), 2)
    assert tiny[1].item() == pytest.approx(1 / (math.sqrt(2) + 1), rel=1e-4)


@pytest.mark.parametrize("clip", [0.8, 1.2, 5.0])
def test_group_advantages_are_clipped_to_plus_minus_clip(clip):
    got = group_advantages(torch.tensor(REWARDS), 4, clip=clip)
    expected = _hand_advantages(REWARDS, 4, clip=clip)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert got.abs().max() <= clip


def test_default_clip_is_five():
    rewards = torch.tensor([0.0] * 3 + [100.0])
    got = group_advantages(rewards, 4, scale_by="none")
    assert got.tolist() == [-5.0, -5.0, -5.0, 5.0]


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="`num_generations`"):
        group_advantages(torch.tensor(REWARDS), 3)
    with pytest.raises(ValueError, match="`num_generations`"):
        group_advantages(torch.tensor(REWARDS), 0)
    with pytest.raises(ValueError, match="`scale_by`"):
        group_advantages(torch.tensor(REWARDS), 4, scale_by="prompt")


def test_stat_tracker_without_buffer_equals_group_advantages_and_with_buffer_uses_history():
    prompts = ["a"] * 4 + ["b"] * 4
    tracker = PerPromptStatTracker(buffer_size=None)
    torch.testing.assert_close(
        tracker.update(prompts, torch.tensor(REWARDS)), group_advantages(torch.tensor(REWARDS), 4)
    )
    # Interleaved prompts are grouped by prompt, not by position.
    shuffled = [0, 4, 1, 5, 2, 6, 3, 7]
    got = PerPromptStatTracker().update([prompts[i] for i in shuffled], torch.tensor([REWARDS[i] for i in shuffled]))
    expected = _hand_advantages(REWARDS, 4)
    torch.testing.assert_close(got, torch.tensor([expected[i] for i in shuffled]), rtol=1e-5, atol=1e-6)
    # With a buffer, the second batch is normalised by the statistics of both batches of its prompt.
    tracker = PerPromptStatTracker(buffer_size=16)
    tracker.update(["a"] * 4, torch.tensor(REWARDS[:4]))
    second = [1.0, 0.0, 0.5, 0.2]
    got = tracker.update(["a"] * 4, torch.tensor(second))
    history = REWARDS[:4] + second
    expected = [(r - statistics.fmean(history)) / (statistics.stdev(history) + 1e-4) for r in second]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        tracker.update(["a"], torch.tensor([1.0, 2.0]))


# --- PPO loss ----------------------------------------------------------------------------------------------------

# (advantage, log ratio) pairs covering every branch of max(-A r, -A clip(r)) with eps = 0.1:
CASES = [
    (1.0, 0.3),  # A > 0, r > 1 + eps: clipped (flat)
    (1.0, -0.3),  # A > 0, r < 1 - eps: unclipped
    (-1.5, -0.3),  # A < 0, r < 1 - eps: clipped (flat)
    (-1.5, 0.3),  # A < 0, r > 1 + eps: unclipped
    (0.7, 0.05),  # inside the range
    (-0.4, -0.02),  # inside the range
]
EPS = 0.1


def _hand_ppo(cases, eps, kl=None, beta=0.0):
    losses, grads = [], []
    for adv, log_ratio in cases:
        r = math.exp(log_ratio)
        unclipped, clipped = -adv * r, -adv * min(max(r, 1 - eps), 1 + eps)
        losses.append(max(unclipped, clipped))
        flat = clipped > unclipped  # the clipped branch is active and constant in r
        grads.append(0.0 if flat else -adv * r / len(cases))  # d loss / d log_prob
    policy = sum(losses) / len(losses)
    kl_mean = sum(kl) / len(kl) if kl is not None else 0.0
    ratios = [math.exp(lr) for _, lr in cases]
    return {
        "loss": policy + beta * kl_mean,
        "policy_loss": policy,
        "kl": kl_mean,
        "ratio_mean": sum(ratios) / len(ratios),
        "clip_fraction": sum(abs(r - 1) > eps for r in ratios) / len(ratios),
        "approx_kl": sum(0.5 * lr**2 for _, lr in cases) / len(cases),
        "grad": grads,
    }


def test_ppo_loss_matches_hand_computation_with_clipping_on_both_sides():
    adv = torch.tensor([a for a, _ in CASES], dtype=torch.float64)
    old = torch.tensor([-1.3, 0.2, -0.7, 1.1, 0.0, -2.0], dtype=torch.float64)
    log_prob = (old + torch.tensor([lr for _, lr in CASES], dtype=torch.float64)).requires_grad_(True)
    out = ppo_step_loss(log_prob, old, adv, EPS)
    hand = _hand_ppo(CASES, EPS)
    assert out.loss.item() == pytest.approx(hand["loss"], rel=1e-12)
    for key in ("policy_loss", "kl", "ratio_mean", "approx_kl"):
        assert getattr(out, key) == pytest.approx(hand[key], rel=1e-12, abs=1e-15), key
    assert out.clip_fraction == pytest.approx(hand["clip_fraction"], rel=1e-7)
    assert hand["clip_fraction"] == 4 / 6  # the cases do clip on both sides
    (grad,) = torch.autograd.grad(out.loss, log_prob)
    torch.testing.assert_close(grad, torch.tensor(hand["grad"], dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert grad[0] == 0 and grad[2] == 0 and grad[1] != 0 and grad[3] != 0


def test_ppo_loss_with_kl_adds_beta_times_mean_kl():
    adv = torch.tensor([a for a, _ in CASES])
    old = torch.zeros(len(CASES))
    log_prob = torch.tensor([lr for _, lr in CASES])
    kl = torch.tensor([0.5, 0.1, 0.0, 0.3, 0.2, 0.9])
    out = ppo_step_loss(log_prob, old, adv, EPS, kl=kl, beta=0.04)
    hand = _hand_ppo(CASES, EPS, kl=kl.tolist(), beta=0.04)
    assert out.loss.item() == pytest.approx(hand["loss"], rel=1e-6)
    assert out.kl == pytest.approx(hand["kl"], rel=1e-6)
    assert out.policy_loss == pytest.approx(hand["policy_loss"], rel=1e-6)
    # beta = 0 ignores the KL in the loss but still reports it.
    plain = ppo_step_loss(log_prob, old, adv, EPS, kl=kl)
    assert plain.loss.item() == pytest.approx(hand["policy_loss"], rel=1e-6)
    assert plain.kl == pytest.approx(hand["kl"], rel=1e-6)


def test_kl_to_reference_by_hand_and_equals_gaussian_kl():
    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    ref = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    std = torch.tensor([0.3, 0.7, 1.1], dtype=torch.float64).view(3, 1, 1)
    got = kl_to_reference(mean, ref, std)
    hand = [
        sum((m - r) ** 2 for m, r in zip(mean[b].flatten().tolist(), ref[b].flatten().tolist()))
        / 20
        / (2 * std[b].item() ** 2)
        for b in range(3)
    ]
    torch.testing.assert_close(got.double(), torch.tensor(hand, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    exact_kl = kl_divergence(Normal(mean, std.expand_as(mean)), Normal(ref, std.expand_as(ref))).mean(dim=(1, 2))
    torch.testing.assert_close(got.double(), exact_kl, rtol=1e-6, atol=1e-7)


def test_fresh_rollout_ratios_are_exactly_one():
    """Re-scoring a rollout with the same parameters gives log_prob == old_log_prob bit for bit."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    sigmas = [1.0, 0.8, 0.55, 0.3, 0.0]
    advantages = group_advantages(torch.randn(4), 4)
    for sampler in ("sde", "dance", "cps"):
        x = torch.randn(4, 6, 8).to(torch.bfloat16)
        rollout = []
        gen = torch.Generator().manual_seed(11)
        for sigma, sigma_next in zip(sigmas, sigmas[1:]):
            with torch.no_grad():
                v = net(torch.cat([x, torch.full((4, 6, 1), sigma, dtype=x.dtype)], dim=-1))
            out = sampler_step(v, x, sigma, sigma_next, sampler=sampler, noise_level=0.7, generator=gen)
            rollout.append((x, sigma, sigma_next, out.prev_sample, out.log_prob))
            x = out.prev_sample.bfloat16()
        for x_k, sigma, sigma_next, next_k, old in rollout:
            v = net(torch.cat([x_k, torch.full((4, 6, 1), sigma, dtype=x_k.dtype)], dim=-1))
            new = sampler_step(v, x_k, sigma, sigma_next, sampler=sampler, noise_level=0.7, prev_sample=next_k)
            assert torch.equal(new.log_prob, old)
            stats = ppo_step_loss(new.log_prob, old, advantages, 1e-5 if sampler == "cps" else 1e-4)
            assert stats.ratio_mean == 1.0 and stats.clip_fraction == 0.0 and stats.approx_kl == 0.0
            assert stats.policy_loss == pytest.approx(-advantages.mean().item(), abs=1e-7)


def _sde_step_loss(x, nxt, advantages, old_log_prob, clip_range):
    def loss_fn(_step: int, velocity: torch.Tensor) -> torch.Tensor:
        out = sampler_step(velocity, x, 0.7, 0.5, noise_level=0.7, prev_sample=nxt)
        return ppo_step_loss(out.log_prob, old_log_prob, advantages, clip_range).loss

    return loss_fn


def test_clipped_samples_contribute_a_zero_upstream_signal():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(4, 3, 8, generator=gen, dtype=torch.float64)
    nxt = sampler_step(v, x, 0.7, 0.5, noise_level=0.7, generator=gen).prev_sample.double()
    log_prob = sampler_step(v, x, 0.7, 0.5, noise_level=0.7, prev_sample=nxt).log_prob
    eps = 1e-4
    # Samples 0 and 1 sit outside the range in the clipped direction; samples 2 and 3 in the unclipped one.
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float32)
    shift = torch.tensor([-1e-2, 1e-2, 1e-2, -1e-2])  # log r = log_prob - old = -shift
    loss_fn = _sde_step_loss(x, nxt, advantages, log_prob + shift, eps)
    loss, signal = upstream_signal(loss_fn, 0, v)
    assert torch.all(signal[:2] == 0)
    assert torch.all(signal[2:].flatten(1).abs().sum(dim=1) > 0)
    # Independent check of the unclipped rows: dL/dv = -A r / B * d log_prob / dv.
    proxy = v.detach().requires_grad_(True)
    lp = sampler_step(proxy, x, 0.7, 0.5, noise_level=0.7, prev_sample=nxt).log_prob
    ratio = torch.exp(lp.detach() - (log_prob + shift))
    (dlp,) = torch.autograd.grad((lp * (-advantages * ratio / 4)).sum(), proxy)
    torch.testing.assert_close(signal[2:], dlp[2:], rtol=1e-5, atol=1e-12)
    # A fully clipped step has no upstream signal at all, so it adds nothing to any gradient.
    all_clipped = _sde_step_loss(x, nxt, torch.tensor([1.0, -1.0, -1.0, 1.0]), log_prob + shift, eps)
    _, signal = upstream_signal(all_clipped, 0, v)
    assert torch.all(signal == 0)
    assert loss.item() == pytest.approx(ppo_step_loss(log_prob, log_prob + shift, advantages, eps).loss.item())


def test_ppo_and_kl_shape_mismatch_raises():
    lp = torch.zeros(4)
    with pytest.raises(ValueError, match="`old_log_prob`"):
        ppo_step_loss(lp, torch.zeros(4, 1), torch.ones(4), 0.1)
    with pytest.raises(ValueError, match="`advantages`"):
        ppo_step_loss(lp, torch.zeros(4), torch.ones(4, 1), 0.1)
    with pytest.raises(ValueError, match="`kl`"):
        ppo_step_loss(lp, torch.zeros(4), torch.ones(4), 0.1, kl=torch.zeros(3), beta=0.1)
    with pytest.raises(ValueError, match="`log_prob`"):
        ppo_step_loss(torch.zeros(4, 2), torch.zeros(4, 2), torch.ones(4, 2), 0.1)
    with pytest.raises(ValueError, match="`ref_mean`"):
        kl_to_reference(torch.zeros(2, 3), torch.zeros(2, 1), torch.ones(2, 1))


def test_ppo_loss_with_epsilon_high_clips_asymmetrically():
    # DAPO's clip-higher, TRL's epsilon / epsilon_high: the ratio is clipped to [1 - 0.2, 1 + 0.28].
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    ratios = torch.tensor([1.25, 1.5, 0.7, 1.25])
    log_prob = ratios.log().requires_grad_(True)
    out = ppo_step_loss(log_prob, torch.zeros(4), advantages, 0.2, clip_range_high=0.28)
    # By hand, max(-A r, -A clip(r)): 1.25 inside (A > 0), 1.5 clipped to 1.28, 0.7 clipped to 0.8 (A < 0),
    # 1.25 with A < 0 keeps the unclipped -A r = 1.25 (the larger term).
    hand = [-1.25, -1.28, 0.8, 1.25]
    assert out.loss.item() == pytest.approx(sum(hand) / 4, rel=1e-6)
    assert out.clip_fraction == pytest.approx(2 / 4)  # 1.5 and 0.7 lie outside [0.8, 1.28]
    (grad,) = torch.autograd.grad(out.loss, log_prob)
    # d(-A r)/d log r = -A r where unclipped; 0 where the clipped term is the max.
    torch.testing.assert_close(grad, torch.tensor([-1.25, 0.0, 0.0, 1.25]) / 4)
    symmetric = ppo_step_loss(log_prob, torch.zeros(4), advantages, 0.2)
    assert symmetric.loss.item() == pytest.approx((-1.2 - 1.2 + 0.8 + 1.25) / 4, rel=1e-6)


# --- peer conventions of the advantage std -----------------------------------------------------------------------


def _flow_grpo_advantages(prompts, rewards, global_std):
    """Flow-GRPO's PerPromptStatTracker.update (flow_grpo/stat_tracking.py) written out with numpy: the prompt's mean,
    numpy's population std (ddof = 0) of the prompt's rewards or, with global_std, of the whole batch, plus 1e-4."""
    import numpy as np

    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.zeros_like(rewards)
    for prompt in np.unique(prompts):
        group = rewards[prompts == prompt]
        std = (np.std(rewards) if global_std else np.std(group)) + 1e-4
        advantages[prompts == prompt] = (group - np.mean(group)) / std
    return advantages


def _dancegrpo_advantages(rewards, group_size):
    """DanceGRPO's (fastvideo/train_grpo_flux.py): per consecutive group, torch's unbiased std + 1e-8."""
    rewards = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(rewards)
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        out[start : start + group_size] = (group - group.mean()) / (group.std() + 1e-8)
    return out


@pytest.mark.parametrize("global_std", [False, True])
def test_flow_grpo_convention_population_std_per_prompt_or_global(global_std):
    prompts = ["a"] * 4 + ["b"] * 4
    expected = _flow_grpo_advantages(prompts, REWARDS, global_std)
    tracker = PerPromptStatTracker(global_std=global_std, ddof=0, eps=1e-4)
    got = tracker.update(prompts, torch.tensor(REWARDS), clip=None)
    torch.testing.assert_close(got.double(), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # The same numbers from group_advantages (consecutive groups): "batch" is the global std.
    scale_by = "batch" if global_std else "group"
    got = group_advantages(torch.tensor(REWARDS), 4, scale_by=scale_by, clip=None, eps=1e-4, ddof=0)
    torch.testing.assert_close(got.double(), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_dancegrpo_convention_unbiased_std_and_the_gap_at_small_groups():
    expected = _dancegrpo_advantages(REWARDS, 4)
    got = group_advantages(torch.tensor(REWARDS), 4, clip=None, eps=1e-8, ddof=1)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    # At G = 2 the unbiased std is sqrt(2) times the population std: the two conventions differ by 29%.
    pair = torch.tensor([0.2, 0.7])
    population = group_advantages(pair, 2, clip=None, eps=0.0, ddof=0)
    unbiased = group_advantages(pair, 2, clip=None, eps=0.0, ddof=1)
    torch.testing.assert_close(population, unbiased * math.sqrt(2))
    assert 1 - unbiased[1] / population[1] == pytest.approx(1 - 1 / math.sqrt(2))  # 0.29


def test_constant_groups_have_exactly_zero_advantages():
    # 0.1 summed three times is not 0.3 in floating point: the mean's rounding must not leak into the advantage.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.5, 0.9, 0.2])
    for ddof in (0, 1):
        got = group_advantages(rewards, 3, ddof=ddof)
        assert torch.all(got[:3] == 0) and torch.all(got[3:] != 0)
        tracked = PerPromptStatTracker(ddof=ddof).update(["a"] * 3 + ["b"] * 3, rewards)
        assert torch.all(tracked[:3] == 0) and torch.all(tracked[3:] != 0)
    with pytest.raises(ValueError, match="ddof"):
        group_advantages(rewards, 3, ddof=2)


@pytest.mark.parametrize("scale_by", ["group", "batch"])
def test_eps_zero_gives_a_constant_group_zero_and_the_others_their_hand_value(scale_by):
    # advantage_eps=0 is valid: a constant group must give 0, not 0 / 0 = NaN.
    rewards = [0.5, 0.5, 0.5, 0.5, *REWARDS[4:]]
    expected = torch.tensor(_hand_advantages(rewards, 4, scale_by=scale_by, clip=None, eps=0.0))
    got = group_advantages(torch.tensor(rewards), 4, scale_by=scale_by, clip=None, eps=0.0)
    tracker = PerPromptStatTracker(eps=0.0, global_std=scale_by == "batch")
    tracked = tracker.update(["a"] * 4 + ["b"] * 4, torch.tensor(rewards), clip=None)
    for advantages in (got, tracked):
        assert torch.all(advantages[:4] == 0)  # exactly 0: drop_zero_advantages recognises such groups by it
        torch.testing.assert_close(advantages, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GRPO-Guard (arXiv 2510.22319)
def _peer_sde_step(v, x, sigma, sigma_prev, sigma_max, noise_level, prev_sample):
    """Flow-GRPO's sde_step_with_logprob (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:44-68, 89-92 at
    zhtmike/flow_grpo@9745241), transcribed: log_prob, prev_sample_mean, std_dev_t, sqrt(-dt)."""
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    sigma = torch.full(shape, sigma, dtype=torch.float32)
    sigma_prev = torch.full(shape, sigma_prev, dtype=torch.float32)
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    log_prob = (
        -((prev_sample.detach() - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t, torch.sqrt(-1 * dt)


def _peer_guard_policy_loss(log_prob, old_log_prob, mean, old_mean, std_dev_t, sqrt_dt, advantages, clip_range):
    """scripts/train_sd3_GRPO_Guard.py:915-932 at zhtmike/flow_grpo@9745241 with config.rationorm = True."""
    sigma_t = std_dev_t.mean()
    ratio_mean_bias = (mean - old_mean).pow(2).mean(dim=tuple(range(1, log_prob.ndim + 3)))
    ratio_mean_bias = ratio_mean_bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old_log_prob + ratio_mean_bias) * (sqrt_dt.mean() * sigma_t))
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    return policy_loss / (sqrt_dt.mean() ** 2), ratio


@pytest.mark.parametrize(("sigma", "sigma_next"), [(1.0, 0.9), (0.6, 0.45), (0.2, 0.08)])
def test_guard_loss_equals_flow_grpo_grpo_guard(sigma, sigma_next):
    """GRPO-Guard's normalised ratio and 1/|dt| reweighting through ppo_step_loss equal the peer's code, loss and
    gradient, at a high-, a mid- and a low-noise step (the peer's clip range 4e-6: some samples clip, some do not)."""
    gen = torch.Generator().manual_seed(3)
    x, v_old = torch.randn(6, 4, 3, 3, generator=gen), torch.randn(6, 4, 3, 3, generator=gen)
    # The current policy moved the velocity a little, by a different amount for each sample.
    v = (v_old + 2e-4 * torch.randn(6, 4, 3, 3, generator=gen) * torch.arange(6.0).view(-1, 1, 1, 1)).requires_grad_()
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.5, 2.0, -0.1])
    sigma_max, noise_level, clip_range = 0.97, 0.7, 4e-6
    old = sampler_step(v_old, x, sigma, sigma_next, sampler="sde", noise_level=noise_level, sigma_max=sigma_max)
    prev_sample = old.prev_sample  # the rollout's next latent
    new = sampler_step(
        v, x, sigma, sigma_next, sampler="sde", noise_level=noise_level, sigma_max=sigma_max, prev_sample=prev_sample
    )
    ours = ppo_step_loss(
        new.log_prob, old.log_prob, advantages, clip_range,
        log_ratio=guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std),
        policy_weight=1.0 / (sigma - sigma_next),
    )  # fmt: skip

    peer_old = _peer_sde_step(v_old, x, sigma, sigma_next, sigma_max, noise_level, prev_sample)
    log_prob, mean, std_dev_t, sqrt_dt = _peer_sde_step(v, x, sigma, sigma_next, sigma_max, noise_level, prev_sample)
    peer, ratio = _peer_guard_policy_loss(
        log_prob, peer_old[0], mean, peer_old[1], std_dev_t, sqrt_dt, advantages, clip_range
    )
    assert 0 < ((ratio - 1).abs() > clip_range).sum() < 6  # both branches of the clip are exercised
    assert ours.loss.item() == pytest.approx(peer.item(), rel=1e-5, abs=1e-9)
    assert ours.clip_fraction.item() == pytest.approx(((ratio - 1).abs() > clip_range).float().mean().item())
    (grad,) = torch.autograd.grad(ours.loss, v)
    (peer_grad,) = torch.autograd.grad(peer, v)
    torch.testing.assert_close(grad, peer_grad, rtol=1e-4, atol=1e-9 * peer_grad.abs().max().item())
    assert peer_grad.abs().max() > 0


def test_guard_log_ratio_is_the_drift_free_ratio_on_one_scale():
    """For a Gaussian step, s (log p - log p_old) + |mu - mu_old|^2 / (2 s) = mean((mu - mu_old) (x' - mu_old)) / s,
    i.e. mean((mu - mu_old) eps) for the rollout's noise eps: no negative drift, and the same scale at every step."""
    gen = torch.Generator().manual_seed(0)
    mean_old, delta, eps = (torch.randn(3, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    std = torch.tensor([0.5, 0.05, 0.005], dtype=torch.float64)
    mean, x_next = mean_old + 1e-3 * delta, mean_old + std[:, None] * eps

    def log_density(mu):
        return Normal(mu, std[:, None]).log_prob(x_next).mean(dim=1)

    ratio = guard_log_ratio(log_density(mean), log_density(mean_old), mean, mean_old, std)
    # guard_log_ratio works in float32, as the sampler: a float32 tolerance.
    expected = ((mean - mean_old) * eps).mean(dim=1)
    torch.testing.assert_close(ratio, expected, rtol=1e-4, atol=1e-8)
    with pytest.raises(ValueError, match="one value per sample"):
        guard_log_ratio(log_density(mean), log_density(mean_old), mean, mean_old, std[:2])


def test_policy_weight_scales_only_the_policy_term():
    adv, log_prob, old = torch.tensor([1.0, -2.0]), torch.tensor([0.5e-4, -0.2e-4]), torch.zeros(2)
    kl = torch.tensor([0.3, 0.1])
    plain = ppo_step_loss(log_prob, old, adv, 1e-4, kl=kl, beta=0.1)
    weighted = ppo_step_loss(log_prob, old, adv, 1e-4, kl=kl, beta=0.1, policy_weight=7.0)
    assert weighted.policy_loss.item() == pytest.approx(7.0 * plain.policy_loss.item(), rel=1e-6)
    assert weighted.loss.item() == pytest.approx(7.0 * plain.policy_loss.item() + 0.1 * 0.2, rel=1e-6)


@pytest.mark.parametrize("ddof", [0, 1])
def test_multi_reward_advantages_match_gdpo_by_hand(ddof):
    # Two groups of 4; rewards on very different scales, a None, and a reward constant within the second group.
    pick = [21.0, 23.5, 19.0, 22.0, 20.0, 20.5, 24.0, 18.5]
    ocr = [0.1, 0.9, None, 0.4, 0.5, 0.5, 0.5, 0.5]
    weights = [1.0, 0.5]
    per_reward = torch.tensor([[p, float("nan") if o is None else o] for p, o in zip(pick, ocr)])
    advantages = multi_reward_advantages(per_reward, 4, weights, clip=5.0, eps=1e-4, ddof=ddof)
    expected = gdpo_by_hand([pick, ocr], weights, 4, 1e-4, ddof, 5.0)
    assert advantages.tolist() == pytest.approx(expected, abs=1e-5)


def test_multi_reward_advantages_equal_weights_of_rewards_not_of_their_scales():
    # Scaling one reward by 100 changes the weighted sum of raw rewards, but not GDPO's advantages (eps = 0: with
    # eps > 0 the two differ by about eps / std).
    torch.manual_seed(0)
    per_reward = torch.rand(12, 2)
    scaled = per_reward * torch.tensor([100.0, 1.0])
    gdpo, gdpo_scaled = (multi_reward_advantages(r, 4, eps=0.0) for r in (per_reward, scaled))
    assert torch.allclose(gdpo, gdpo_scaled, atol=1e-5)
    raw = group_advantages(per_reward.sum(1), 4)
    assert not torch.allclose(raw, group_advantages(scaled.sum(1), 4), atol=1e-2)


def test_per_reward_group_normalize_zeros_none_and_constant_groups_exactly():
    per_reward = torch.tensor([[0.1, 1.0], [0.1, float("nan")], [0.1, 3.0], [0.3, 7.0]])
    normalized = per_reward_group_normalize(per_reward, 2, eps=0.0, ddof=0)
    # Exactly 0 is the property: these samples must carry no signal from that reward.
    assert normalized[0, 0] == 0 and normalized[1, 0] == 0 and normalized[1, 1] == 0 and normalized[0, 1] == 0
    assert normalized[2:, 0].tolist() == pytest.approx([-1.0, 1.0]) and normalized[2:, 1].tolist() == pytest.approx(
        [-1.0, 1.0]
    )
    with pytest.raises(ValueError, match="weights"):
        multi_reward_advantages(per_reward, 2, [1.0])
    with pytest.raises(ValueError, match="num_generations"):
        per_reward_group_normalize(per_reward, 3)
