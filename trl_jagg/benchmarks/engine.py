"""Engine-level benchmark: the update stage with exact per-step backward vs JAGG, on a small DiT-like network.

A small time- and prompt-conditioned transformer over latent tokens stands in for the backbone (big enough that
backward dominates, small enough to run in seconds on a laptop CPU). One synthetic rollout is sampled with the real
Flow-GRPO SDE sampler (latents, next latents, old log-probs, group advantages); then, for every group size ``W``, the
same update is timed with the engine in ``exact`` mode and in ``jagg`` mode (``jagg_frac=1``), interleaved over
several repeats, and compared with the theoretical cost ratio ``3W / (W + 4)``. The per-group gradient cosine and
norm ratio come from :func:`trl_jagg.core.jagg.gradient_diagnostic`.

Run it with ``trl-jagg bench``; it writes ``engine_benchmark.json`` and
``engine_benchmark.png`` into the output directory.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trl_jagg.core.grpo import group_advantages, ppo_step_loss
from trl_jagg.core.jagg import JaggEngine, StepFunctions, StepGroup, gradient_diagnostic, plan_groups
from trl_jagg.core.sampling import sampler_step

JSON_NAME = "engine_benchmark.json"
PNG_NAME = "engine_benchmark.png"


def theoretical_speedup(group_size: int) -> float:
    """Update-stage cost ratio exact/JAGG of one full group: ``3W`` forward units against ``W + 4``.

    A backward costs about two forwards, so the exact group costs ``W`` forwards and ``W`` backwards (``3W``) and
    the JAGG group ``W`` forwards and one joint backward through the two endpoints (``W + 4``).
    """
    return 3 * group_size / (group_size + 4)


def plan_cost_ratio(groups: Sequence[StepGroup]) -> float:
    """The same cost model over a whole plan (remainder groups stay exact and cost ``3`` per step)."""
    exact = sum(3 * len(g.steps) for g in groups)
    joint = sum(len(g.steps) + 4 if g.is_joint else 3 * len(g.steps) for g in groups)
    return exact / joint


# --- the stand-in backbone ---------------------------------------------------------------------------------------


def timestep_embedding(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of ``1000 * sigma`` (as DiT/SD3 embed their timesteps); ``(batch,) -> (batch, dim)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half)
    angles = 1000.0 * sigma.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class DiTBlock(nn.Module):
    """Pre-norm transformer block with adaptive LayerNorm modulation from the conditioning vector."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))
        self.modulation = nn.Linear(width, 6 * width)

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(cond))[:, None].chunk(6, dim=-1)
        batch, tokens, width = h.shape
        x = self.norm1(h) * (1 + scale1) + shift1
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
        h = h + gate1 * self.proj(attn)
        return h + gate2 * self.mlp(self.norm2(h) * (1 + scale2) + shift2)


class TinyDiT(nn.Module):
    """A DiT-like velocity network ``v(z, sigma, c)`` over packed latent tokens ``(batch, tokens, channels)``.

    Randomly initialised everywhere (no adaLN-zero), so that it is genuinely nonlinear in ``z`` and ``sigma``.
    """

    def __init__(self, channels: int, width: int, depth: int, heads: int, tokens: int, cond_dim: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"`width` ({width}) must be divisible by `heads` ({heads}).")
        self.freq_dim = 64
        self.patch_in = nn.Linear(channels, width)
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, width))
        self.time_mlp = nn.Sequential(nn.Linear(self.freq_dim, width), nn.SiLU(), nn.Linear(width, width))
        self.cond_proj = nn.Linear(cond_dim, width)
        self.blocks = nn.ModuleList(DiTBlock(width, heads) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False)
        self.final_modulation = nn.Linear(width, 2 * width)
        self.out = nn.Linear(width, channels)

    def forward(self, z: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        c = self.time_mlp(timestep_embedding(sigma, self.freq_dim)) + self.cond_proj(cond)
        h = self.patch_in(z) + self.pos
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_modulation(F.silu(c))[:, None].chunk(2, dim=-1)
        return self.out(self.final_norm(h) * (1 + scale) + shift)


# --- the synthetic rollout ---------------------------------------------------------------------------------------


def shifted_sigmas(num_steps: int, shift: float) -> list[float]:
    """SD3's shifted flow schedule from 1 to 0 in ``num_steps`` steps."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).tolist()


@dataclass
class SyntheticRollout:
    """What the update stage needs from a rollout, and the per-step velocity and loss closures for the engine."""

    model: TinyDiT
    cond: torch.Tensor
    sigmas: list[float]
    latents: list[torch.Tensor]
    next_latents: list[torch.Tensor]
    old_log_probs: list[torch.Tensor]
    advantages: torch.Tensor
    noise_level: float
    clip_range: float

    @property
    def times(self) -> list[float]:
        """Flow times of the trained steps."""
        return self.sigmas[: len(self.latents)]

    def velocity_fn(self, k: int) -> torch.Tensor:
        """Backbone velocity of trained step ``k``."""
        sigma = torch.full((self.cond.shape[0],), self.sigmas[k])
        return self.model(self.latents[k], sigma, self.cond)

    def loss_fn(self, k: int, velocity: torch.Tensor) -> torch.Tensor:
        """PPO-clipped loss of step ``k`` through the SDE log-prob of the rollout's next latent."""
        out = sampler_step(
            velocity,
            self.latents[k],
            self.sigmas[k],
            self.sigmas[k + 1],
            noise_level=self.noise_level,
            sigma_max=self.sigmas[1],
            prev_sample=self.next_latents[k],
        )
        return ppo_step_loss(out.log_prob, self.old_log_probs[k], self.advantages, self.clip_range).loss


def build_rollout(
    model: TinyDiT,
    *,
    batch: int,
    num_generations: int,
    tokens: int,
    channels: int,
    cond_dim: int,
    num_steps: int,
    noise_level: float = 0.7,
    shift: float = 3.0,
    clip_range: float = 1e-4,
    generator: torch.Generator | None = None,
) -> SyntheticRollout:
    """Sample ``num_steps + 1`` SDE steps with ``model`` and keep the first ``num_steps`` as trained steps.

    Flow-GRPO trains every step but the last. Rewards are random; advantages are per-prompt group advantages over
    ``batch // num_generations`` prompts. Old log-probs are the rollout's own (the first inner PPO epoch).
    """
    sigmas = shifted_sigmas(num_steps + 1, shift)
    prompts = torch.randn(batch // num_generations, cond_dim, generator=generator)
    cond = prompts.repeat_interleave(num_generations, dim=0)
    z = torch.randn(batch, tokens, channels, generator=generator)
    latents, next_latents, old_log_probs = [], [], []
    with torch.no_grad():
        for k in range(num_steps):
            v = model(z, torch.full((batch,), sigmas[k]), cond)
            out = sampler_step(
                v, z, sigmas[k], sigmas[k + 1], noise_level=noise_level, sigma_max=sigmas[1], generator=generator
            )
            latents.append(z)
            next_latents.append(out.prev_sample)
            old_log_probs.append(out.log_prob)
            z = out.prev_sample
    advantages = group_advantages(torch.randn(batch, generator=generator), num_generations)
    return SyntheticRollout(
        model, cond, sigmas, latents, next_latents, old_log_probs, advantages, noise_level, clip_range
    )


# --- timing ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``num_threads`` inside the block (``None`` or 0: unchanged), restored after."""
    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _timed_update(rollout: SyntheticRollout, groups: Sequence[StepGroup]) -> tuple[float, int, float]:
    """One update stage (forwards, losses, backwards) with fresh gradients: ``(seconds, backward calls, loss)``."""
    rollout.model.zero_grad(set_to_none=True)
    engine, functions = JaggEngine(), StepFunctions(rollout.velocity_fn, rollout.loss_fn)
    start = time.perf_counter()
    result = engine.run(groups, functions)
    elapsed = time.perf_counter() - start
    rollout.model.zero_grad(set_to_none=True)
    return elapsed, result.num_backward, result.loss


def run_engine_benchmark(
    output_dir: str | Path,
    *,
    group_sizes: Sequence[int] = (2, 4, 8),
    num_steps: int = 8,
    width: int = 128,
    depth: int = 2,
    batch: int = 4,
    repeats: int = 5,
    seed: int = 0,
    tokens: int = 64,
    channels: int = 16,
    heads: int = 4,
    num_generations: int | None = None,
    num_threads: int | None = 1,
    plot: bool = True,
    verbose: bool = True,
) -> dict[str, Any]:
    """Time the update stage exact vs JAGG for each group size and measure the JAGG/exact gradient agreement.

    Args:
        output_dir: where ``engine_benchmark.json`` and ``engine_benchmark.png`` go (created if missing).
        group_sizes: the ``W`` values to compare.
        num_steps: trained steps per rollout (the rollout samples one more, untrained, as Flow-GRPO does).
        width: the transformer's hidden size.
        depth: the number of transformer blocks.
        batch: images per update (``num_generations`` per prompt).
        repeats: timed exact/JAGG pairs per ``W`` (after one warm-up pair), alternating which runs first.
        seed: seeds the network and the rollout.
        tokens: latent tokens per image; the latent is ``(batch, tokens, channels)``, packed like Flux latents.
        channels: latent channels per token.
        heads: attention heads (must divide ``width``).
        num_generations: GRPO group size; defaults to ``batch`` (one prompt).
        num_threads: torch intra-op threads for the run (restored afterwards). One thread by default: the most
            reproducible measure of compute cost (on a shared or busy CPU, multi-threaded kernels mostly time the
            scheduler). ``None`` or ``0`` keeps torch's current setting.
        plot: write the PNG chart.
        verbose: print the table and the one-line summaries.

    Returns:
        The dict written to ``engine_benchmark.json``: ``config``, one ``results`` entry per ``W`` (median speedup
        exact/JAGG and its per-repeat values, median times, backward calls, theoretical ratio, per-group cosine and
        norm ratio, the reported losses) and the ``summary`` lines.
    """
    if not group_sizes or any(not isinstance(w, int) or w < 1 for w in group_sizes):
        raise ValueError(f"`group_sizes` must be integers >= 1, got {group_sizes!r}.")
    if num_steps < 1 or repeats < 1 or batch < 1:
        raise ValueError(f"`num_steps`, `repeats` and `batch` must be >= 1, got {num_steps}, {repeats}, {batch}.")
    num_generations = num_generations or batch
    if batch % num_generations:
        raise ValueError(f"`num_generations` ({num_generations}) must divide `batch` ({batch}).")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    with torch_threads(num_threads):
        torch.manual_seed(seed)
        cond_dim = 32
        model = TinyDiT(channels, width, depth, heads, tokens, cond_dim)
        generator = torch.Generator().manual_seed(seed)
        rollout = build_rollout(
            model,
            batch=batch,
            num_generations=num_generations,
            tokens=tokens,
            channels=channels,
            cond_dim=cond_dim,
            num_steps=num_steps,
            generator=generator,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        forward_s, backward_s = _calibrate(rollout, repeats)
        results = [_benchmark_group_size(rollout, params, w, repeats) for w in group_sizes]
        config = {
            "group_sizes": list(group_sizes),
            "num_steps": num_steps,
            "width": width,
            "depth": depth,
            "heads": heads,
            "batch": batch,
            "num_generations": num_generations,
            "tokens": tokens,
            "channels": channels,
            "repeats": repeats,
            "seed": seed,
            "num_params": sum(p.numel() for p in params),
            "num_threads": torch.get_num_threads(),
            "forward_ms": 1000 * forward_s,
            "backward_ms": 1000 * backward_s,
            "backward_over_forward": backward_s / forward_s,
            "sampler": "sde",
            "noise_level": rollout.noise_level,
            "clip_range": rollout.clip_range,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
        }

    summary = [
        f"W={r['group_size']}: cosine {r['cosine_mean']:.2f}, update-stage speedup {r['speedup']:.2f}x "
        f"(theory {r['theory_speedup']:.2f}x)"
        for r in results
    ]
    report: dict[str, Any] = {"config": config, "results": results, "summary": summary}
    json_path = output_dir / JSON_NAME
    report["files"] = {"json": str(json_path)}
    if plot:
        png_path = output_dir / PNG_NAME
        _plot(results, png_path, config)
        report["files"]["png"] = str(png_path)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    if verbose:
        print(format_table(report))
    return report


def _calibrate(rollout: SyntheticRollout, repeats: int) -> tuple[float, float]:
    """Median seconds of one backbone forward (with graph) and of its backward; the cost model assumes 1 : 2."""
    forwards, backwards = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        velocity = rollout.velocity_fn(0)
        middle = time.perf_counter()
        velocity.backward(torch.ones_like(velocity))
        end = time.perf_counter()
        forwards.append(middle - start)
        backwards.append(end - middle)
    rollout.model.zero_grad(set_to_none=True)
    return statistics.median(forwards[1:]), statistics.median(backwards[1:])


def _benchmark_group_size(
    rollout: SyntheticRollout, params: Sequence[torch.Tensor], group_size: int, repeats: int
) -> dict[str, Any]:
    exact_groups = plan_groups(rollout.times, group_size, 0.0, mode="exact")
    jagg_groups = plan_groups(rollout.times, group_size, 1.0, mode="jagg")
    plans = {"exact": exact_groups, "jagg": jagg_groups}
    # Warm-up pair (allocator, autograd caches), then interleaved timed pairs in alternating order.
    for name in plans:
        _timed_update(rollout, plans[name])
    times: dict[str, list[float]] = {"exact": [], "jagg": []}
    calls: dict[str, int] = {}
    losses: dict[str, float] = {}
    for repeat in range(repeats):
        for name in ("exact", "jagg") if repeat % 2 == 0 else ("jagg", "exact"):
            elapsed, calls[name], losses[name] = _timed_update(rollout, plans[name])
            times[name].append(elapsed)
    ratios = [e / j for e, j in zip(times["exact"], times["jagg"])]
    diagnostics = gradient_diagnostic(jagg_groups, rollout.velocity_fn, rollout.loss_fn, params)
    joint = [d for d, g in zip(diagnostics, jagg_groups) if g.is_joint] or diagnostics
    return {
        "group_size": group_size,
        "num_trained_steps": len(rollout.times),
        "num_groups": len(jagg_groups),
        "num_jagg_groups": sum(g.is_joint for g in jagg_groups),
        "backward_calls_exact": calls["exact"],
        "backward_calls_jagg": calls["jagg"],
        "time_exact_s": statistics.median(times["exact"]),
        "time_jagg_s": statistics.median(times["jagg"]),
        "times_exact_s": times["exact"],
        "times_jagg_s": times["jagg"],
        "speedup": statistics.median(ratios),
        "speedup_per_repeat": ratios,
        "theory_speedup": theoretical_speedup(group_size),
        "theory_speedup_plan": plan_cost_ratio(jagg_groups),
        "group_steps": [list(g.steps) for g in jagg_groups],
        "cosine_per_group": [d.cosine for d in diagnostics],
        "norm_ratio_per_group": [d.norm_ratio for d in diagnostics],
        "cosine_mean": statistics.fmean(d.cosine for d in joint),
        "loss_exact": losses["exact"],
        "loss_jagg": losses["jagg"],
    }


# --- reporting ---------------------------------------------------------------------------------------------------


def format_table(report: dict[str, Any]) -> str:
    """The benchmark as a fixed-width table followed by the one-line summaries."""
    config = report["config"]
    lines = [
        f"JAGG engine benchmark: TinyDiT width {config['width']}, depth {config['depth']}, {config['tokens']} tokens, "
        f"batch {config['batch']}, {config['num_steps']} trained steps, {config['num_params']:,} params, "
        f"{config['num_threads']} thread(s), {config['repeats']} repeats (median); one forward "
        f"{config['forward_ms']:.1f} ms, its backward {config['backward_ms']:.1f} ms "
        f"({config['backward_over_forward']:.1f}x; the cost model assumes 2x)",
        f"{'W':>3} {'groups':>6} {'bwd exact':>9} {'bwd jagg':>8} {'exact ms':>9} {'jagg ms':>8} "
        f"{'speedup':>8} {'theory':>7}  cosine per group",
    ]
    for r in report["results"]:
        cosines = " ".join(f"{c:.3f}" for c in r["cosine_per_group"])
        lines.append(
            f"{r['group_size']:>3} {r['num_groups']:>6} {r['backward_calls_exact']:>9} {r['backward_calls_jagg']:>8} "
            f"{1000 * r['time_exact_s']:>9.1f} {1000 * r['time_jagg_s']:>8.1f} {r['speedup']:>7.2f}x "
            f"{r['theory_speedup']:>6.2f}x  {cosines}"
        )
    return "\n".join(lines + report["summary"])


def _plot(results: Sequence[dict[str, Any]], path: Path, config: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_cos) = plt.subplots(1, 2, figsize=(11, 4.2))
    ws = [r["group_size"] for r in results]
    speedups = [r["speedup"] for r in results]
    low = [r["speedup"] - min(r["speedup_per_repeat"]) for r in results]
    high = [max(r["speedup_per_repeat"]) - r["speedup"] for r in results]
    grid = torch.linspace(1, max(ws) + 1, 200).tolist()
    ax_speed.plot(grid, [theoretical_speedup(w) for w in grid], "--", color="gray", label="theory 3W/(W+4)")
    ax_speed.errorbar(ws, speedups, yerr=[low, high], fmt="o-", capsize=4, label="measured (median, min-max)")
    ax_speed.axhline(1.0, color="black", linewidth=0.6)
    ax_speed.set_xlabel("group size W")
    ax_speed.set_ylabel("update-stage speedup exact / JAGG")
    ax_speed.set_xticks(ws)
    ax_speed.set_title("Update-stage speedup")
    ax_speed.legend()
    for r in results:
        centres = [statistics.fmean(steps) for steps in r["group_steps"]]
        ax_cos.plot(centres, r["cosine_per_group"], "o-", label=f"W={r['group_size']}")
    lowest = min(c for r in results for c in r["cosine_per_group"])
    ax_cos.axhline(1.0, color="black", linewidth=0.6)
    ax_cos.set_ylim(lowest - 0.1 * (1 - lowest) - 0.01, 1 + 0.05 * (1 - lowest) + 0.005)
    ax_cos.set_xlabel("trained step at the group's centre (0 = highest noise)")
    ax_cos.set_ylabel("cosine(JAGG gradient, exact gradient)")
    ax_cos.set_title("Gradient agreement per group")
    ax_cos.legend()
    fig.suptitle(
        f"JAGG engine on TinyDiT (width {config['width']}, depth {config['depth']}, {config['num_steps']} steps)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
