"""GRPO pieces shared by every model: group advantages, the PPO-clipped step loss, GRPO-Guard's normalised ratio,
the KL term (pure torch)."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale_by: str = "group",
    clip: float | None = 5.0,
    eps: float = 1e-4,
    ddof: int = 1,
) -> torch.Tensor:
    """Advantages of consecutive groups of ``num_generations`` samples of the same prompt.

    ``A = (r - mean of the group) / (std + eps)``, then clipped to ``[-clip, clip]``. A group whose rewards are all
    equal gets advantages of exactly 0 (not the rounding error of its mean, nor 0 / 0 at ``eps = 0``), so that such
    samples can be recognised.

    Args:
        rewards: ``(num_groups * num_generations,)``, each prompt's samples consecutive.
        num_generations: the GRPO group size G.
        scale_by: ``"group"`` (the group's std), ``"batch"`` (the std of the whole batch, a global std) or
            ``"none"`` (no scaling, as in Dr. GRPO).
        clip: the advantage clip ``A_max``; ``None`` disables clipping.
        eps: added to the std (Flow-GRPO 1e-4, DanceGRPO 1e-8).
        ddof: delta degrees of freedom of the std: 0 is the population std (numpy's default, Flow-GRPO), 1 the
            unbiased one (torch's default, DanceGRPO).
    """
    if num_generations < 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"`num_generations` ({num_generations}) must divide the number of rewards ({rewards.numel()})."
        )
    if ddof not in (0, 1):
        raise ValueError(f"`ddof` must be 0 (population std) or 1 (unbiased std), got {ddof!r}.")
    grouped = rewards.float().view(-1, num_generations)
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).masked_fill(constant, 0.0)
    if scale_by == "group":
        std = _std(grouped, ddof, dim=1)
    elif scale_by == "batch":
        std = _std(grouped.flatten(), ddof)
    elif scale_by == "none":
        std = torch.ones(())
    else:
        raise ValueError(f"`scale_by` must be 'group', 'batch' or 'none', got {scale_by!r}.")
    # A constant group's 0 stays 0 at eps = 0 too (0 / 0 would be NaN).
    scaled = centered / (std + eps) if scale_by != "none" else centered
    advantages = scaled.masked_fill(constant, 0.0).view(-1)
    return advantages.clamp(-clip, clip) if clip is not None else advantages


MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
"""TRL's ``GRPOConfig.multi_objective_aggregation`` values."""


def per_reward_group_normalize(
    per_reward: torch.Tensor, num_generations: int, *, eps: float = 1e-4, ddof: int = 1
) -> torch.Tensor:
    """Each reward (column) normalised within each group: ``(r - group mean) / (group std + eps)``.

    NaN marks a sample a reward does not score (a ``None``): it is left out of that reward's group statistics and
    gets 0, so that it adds nothing to a weighted sum (TRL's ``nansum``). A group whose scored values are all equal
    gets exactly 0, as in :func:`group_advantages`.

    Args:
        per_reward: ``(num_groups * num_generations, num_rewards)``, each prompt's samples consecutive.
        num_generations: the GRPO group size G.
        eps, ddof: as in :func:`group_advantages`.
    """
    if per_reward.ndim != 2:
        raise ValueError(f"`per_reward` must have shape (samples, rewards), got {tuple(per_reward.shape)}.")
    if num_generations < 1 or per_reward.shape[0] % num_generations != 0:
        raise ValueError(
            f"`num_generations` ({num_generations}) must divide the number of samples ({per_reward.shape[0]})."
        )
    if ddof not in (0, 1):
        raise ValueError(f"`ddof` must be 0 (population std) or 1 (unbiased std), got {ddof!r}.")
    grouped = per_reward.float().view(-1, num_generations, per_reward.shape[1])  # (groups, G, rewards)
    scored = ~grouped.isnan()
    count = scored.sum(dim=1, keepdim=True)
    values = grouped.nan_to_num(0.0)
    mean = values.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = (values - mean) * scored
    # One scored value has no unbiased std: its std is 0 (and it is centred to 0 anyway).
    std = ((centered**2).sum(dim=1, keepdim=True) / (count - ddof).clamp(min=1)).sqrt()
    constant = grouped.masked_fill(~scored, -torch.inf).amax(dim=1, keepdim=True) == grouped.masked_fill(
        ~scored, torch.inf
    ).amin(dim=1, keepdim=True)
    normalized = (centered / (std + eps)).masked_fill(constant | ~scored, 0.0)
    return normalized.view_as(per_reward)


def multi_reward_advantages(
    per_reward: torch.Tensor,
    num_generations: int,
    weights: Sequence[float] | None = None,
    *,
    clip: float | None = 5.0,
    eps: float = 1e-4,
    ddof: int = 1,
) -> torch.Tensor:
    """GDPO's advantages of several rewards (TRL's ``multi_objective_aggregation="normalize_then_sum"``): each
    reward normalised within its group (:func:`per_reward_group_normalize`), the weighted sum of these, then that
    sum normalised over the whole batch (``(s - batch mean) / (batch std + eps)``) and clipped to ``[-clip, clip]``.

    Unlike normalising the weighted sum of raw rewards, a reward with a large scale or variance (PickScore ~20
    next to an OCR score in [0, 1]) cannot drown the others: the weights act on rewards of unit group std.

    Args:
        per_reward: ``(num_groups * num_generations, num_rewards)``; NaN where a reward returned ``None``.
        num_generations: the GRPO group size G.
        weights: one per reward; ``None`` means all 1.
        clip, eps, ddof: as in :func:`group_advantages`.
    """
    normalized = per_reward_group_normalize(per_reward, num_generations, eps=eps, ddof=ddof)
    weight = torch.ones(per_reward.shape[1]) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    if weight.shape != (per_reward.shape[1],):
        raise ValueError(f"Got {weight.numel()} weights for {per_reward.shape[1]} rewards.")
    combined = normalized @ weight.to(normalized.device)
    return group_advantages(combined, combined.numel(), scale_by="group", clip=clip, eps=eps, ddof=ddof)


def _std(values: torch.Tensor, ddof: int, dim: int | None = None) -> torch.Tensor:
    """Std with ``ddof``; a single value (where the unbiased std is undefined) has std 0."""
    count = values.numel() if dim is None else values.shape[dim]
    correction = ddof if count > ddof else 0
    if dim is None:
        return values.std(correction=correction)
    return values.std(dim=dim, keepdim=True, correction=correction)


class PerPromptStatTracker:
    """Advantages from a running per-prompt history of rewards (Flow-GRPO's ``per_prompt_stat_tracking``).

    Each prompt keeps its last ``buffer_size`` rewards across steps, so small groups get stabler statistics.
    ``buffer_size=None`` keeps only the current batch (as Flow-GRPO, which clears its tracker every epoch; it then
    equals :func:`group_advantages` up to the grouping). ``global_std=True`` divides by the std of the whole batch
    instead of the prompt's (Flow-GRPO's ``global_std``); ``ddof`` and ``eps`` as in :func:`group_advantages`.
    """

    def __init__(self, buffer_size: int | None = None, *, global_std: bool = False, eps: float = 1e-4, ddof: int = 1):
        if ddof not in (0, 1):
            raise ValueError(f"`ddof` must be 0 (population std) or 1 (unbiased std), got {ddof!r}.")
        self.buffer_size = buffer_size
        self.global_std = global_std
        self.eps = eps
        self.ddof = ddof
        self.history: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=buffer_size))

    def update(self, prompts: Sequence[str], rewards: torch.Tensor, clip: float | None = 5.0) -> torch.Tensor:
        """Record ``rewards`` for ``prompts`` and return their advantages."""
        if len(prompts) != rewards.numel():
            raise ValueError(f"Got {len(prompts)} prompts for {rewards.numel()} rewards.")
        rewards = rewards.float().flatten()
        current: dict[str, list[float]] = defaultdict(list)
        for prompt, reward in zip(prompts, rewards.tolist()):
            current[prompt].append(reward)
        stats = {}
        for prompt, values in current.items():
            if self.buffer_size is None:
                self.history[prompt].clear()
            self.history[prompt].extend(values)
            stats[prompt] = torch.tensor(list(self.history[prompt]))
        batch_std = _std(rewards, self.ddof)
        advantages = torch.empty_like(rewards)
        for i, (prompt, reward) in enumerate(zip(prompts, rewards)):
            values = stats[prompt]
            std = batch_std if self.global_std else _std(values, self.ddof)
            # A constant history gives 0, also at eps = 0 (not 0 / 0).
            constant = values.amax() == values.amin()
            advantages[i] = 0.0 if constant else (reward - values.mean()) / (std + self.eps)
        return advantages.clamp(-clip, clip) if clip is not None else advantages


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample KL between the policy's and the reference's step Gaussians of equal std.

    ``KL = mean over latent dims of (mu - mu_ref)^2 / (2 std^2)``; returns ``(batch,)``.
    """
    if ref_mean.shape != mean.shape:
        raise ValueError(f"`ref_mean` must have the shape of `mean` {tuple(mean.shape)}, got {tuple(ref_mean.shape)}.")
    kl = (mean.float() - ref_mean.float()) ** 2 / (2 * std.float() ** 2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def guard_log_ratio(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio of one Gaussian step (RatioNorm, arXiv 2510.22319).

    ``log r = s (log p - log p_old + mean((mu - mu_old)^2) / (2 s^2))`` with ``s`` the step's std: the added term
    removes the ratio's negative drift ``-|mu - mu_old|^2 / (2 s^2)``, and the factor ``s`` puts every step's ratio on
    one scale (without it, the narrow low-noise steps have ratios far from 1 for the same change of the mean). This is
    Flow-GRPO's scripts/train_sd3_GRPO_Guard.py (its ``s`` is ``std_dev_t * sqrt(-dt)`` averaged over the batch,
    which shares one step).

    Args:
        log_prob, old_log_prob: ``(batch,)`` log-densities (averaged over latent dims) of the rollout's next latent
            under the current policy and at rollout time.
        mean, old_mean: the step's Gaussian mean under the current policy and at rollout time, latent-shaped.
        std: the step's std, ``(batch,)`` or broadcastable to the latent.
    """
    if std.numel() != log_prob.numel():
        raise ValueError(f"`std` must hold one value per sample ({log_prob.numel()}), got {tuple(std.shape)}.")
    std = std.float().reshape(log_prob.shape)
    drift = (mean.float() - old_mean.float()).pow(2).mean(dim=tuple(range(1, mean.ndim)))
    return (log_prob - old_log_prob + drift / (2 * std**2)) * std


@dataclass
class StepLoss:
    """The PPO loss of one denoising step and its diagnostics (detached 0-dim tensors, left on the device so that a
    caller reads them once per update instead of one GPU sync each)."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    ratio_mean: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


def ppo_step_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    *,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    clip_range_high: float | None = None,
    log_ratio: torch.Tensor | None = None,
    policy_weight: float | torch.Tensor = 1.0,
) -> StepLoss:
    """PPO-clipped loss of one step: ``w mean(max(-A r, -A clip(r, 1-eps, 1+eps_high))) + beta * mean(KL)``.

    Args:
        log_prob: ``(batch,)`` log-probs of the rollout's next latents under the current policy.
        old_log_prob: ``(batch,)`` the same, recorded at rollout time.
        advantages: ``(batch,)``.
        clip_range: PPO's epsilon, the lower clip bound ``1 - eps``.
        clip_range_high: the upper bound ``1 + eps_high`` (DAPO's clip-higher); ``None`` uses ``clip_range``.
        kl: optional ``(batch,)`` KL to the reference (see :func:`kl_to_reference`).
        beta: weight of the KL term.
        log_ratio: ``(batch,)`` the log of ``r`` when it is not ``log_prob - old_log_prob``, e.g. GRPO-Guard's
            normalised one (:func:`guard_log_ratio`); ``approx_kl`` stays that of the plain log-ratio.
        policy_weight: ``w``, a weight of the policy term only (GRPO-Guard's per-step reweighting ``1 / |dt|``).
    """
    if log_prob.ndim != 1:
        raise ValueError(f"`log_prob` must have shape (batch,), got {tuple(log_prob.shape)}.")
    # Mismatched (batch,) and (batch, 1) tensors would broadcast to (batch, batch) and silently average nonsense.
    checked = (("old_log_prob", old_log_prob), ("advantages", advantages), ("kl", kl), ("log_ratio", log_ratio))
    for name, value in checked:
        if value is not None and value.shape != log_prob.shape:
            raise ValueError(
                f"`{name}` must have the shape of `log_prob` {tuple(log_prob.shape)}, got {tuple(value.shape)}."
            )
    plain_log_ratio = log_prob - old_log_prob
    ratio = torch.exp(plain_log_ratio if log_ratio is None else log_ratio)
    unclipped = -advantages * ratio
    high = clip_range if clip_range_high is None else clip_range_high
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)
    policy_loss = policy_weight * torch.maximum(unclipped, clipped).mean()
    kl_mean = kl.mean() if kl is not None else torch.zeros((), device=log_prob.device)
    loss = policy_loss + beta * kl_mean if beta else policy_loss
    with torch.no_grad():
        return StepLoss(
            loss=loss,
            policy_loss=policy_loss.detach(),
            kl=kl_mean.detach(),
            ratio_mean=ratio.mean(),
            clip_fraction=((ratio < 1.0 - clip_range) | (ratio > 1.0 + high)).float().mean(),
            approx_kl=(0.5 * plain_log_ratio.detach() ** 2).mean(),
        )
