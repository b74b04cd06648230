"""JAGG across DiffusionNFT's timesteps on the CPU demo: its gradient against exact NFT's, and the update's cost.

For each seed the demo (:mod:`trl_jagg.demo.run`, ``objective="nft"``, 4 of the 9 rollout timesteps trained, one
JAGG group of ``W = 4``) trains ``0, 20, ...`` optimizer steps with exact NFT; at each checkpoint of that run one
rollout's update is taken three times on the same weights and timesteps:

- ``shared``: the group exact with the noise JAGG uses, one ``eps`` per image shared by the group's four timesteps
  (four backward calls): the estimator JAGG approximates, so ``cosine`` / ``relative_error`` measure JAGG's own error;
- ``jagg``: through JAGG (one joint backward through the two endpoint timesteps), the same noise;
- ``fresh``: DiffusionNFT's own update (``use_jagg=False``), a fresh ``eps`` per timestep, the baseline a user runs
  without JAGG. Its expected gradient is the shared-noise one, its draw is not: ``fresh_cosine`` /
  ``fresh_relative_error`` compare JAGG with it, and ``shared_fresh_cosine`` exact shared-noise NFT with it (how far
  apart two noise estimators of one gradient lie, JAGG aside).

The report also gives the process CPU time of the shared-noise and JAGG updates, interleaved (after a warm-up pair),
median [min, max] of the per-repeat ratios.

    trl-jagg bench nft-jagg --output_dir runs/bench [--seeds 0 1 2] [--checkpoints 0 20 40] [--repeats 5]

writes ``nft_jagg_benchmark.json`` and ``nft_jagg_benchmark.png`` (cosine per checkpoint; CPU-time ratio).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from trl_jagg.benchmarks.engine import torch_threads
from trl_jagg.demo.run import DEMO_ASSET_DIR, demo_trainer

JSON_NAME = "nft_jagg_benchmark.json"
PNG_NAME = "nft_jagg_benchmark.png"
NFT_DEMO_OVERRIDES: dict[str, Any] = {
    "objective": "nft",
    "sde_window_size": 0,
    "sde_window_schedule": "random",  # the window settings' defaults: no window
    "sde_window_max_start": None,
    "train_timesteps": "all_but_last",  # the default (the demo's "sde_window" is GRPO's): NFT draws its own
    "train_timestep_fraction": 0.5,
    "beta": 1e-4,
    "jagg_group_size": 4,
    "jagg_frac": 1.0,
}
"""The demo as DiffusionNFT trains it: deterministic rollouts, 4 of the 9 timesteps trained per micro-batch, the
reference code's KL 1e-4, the demo's own learning rate (the rest of :func:`~trl_jagg.demo.run.demo_config`)."""


def _update(
    trainer: Any, rollout: dict[str, Any], jagg_mode: str, *, use_jagg: bool = True
) -> tuple[torch.Tensor, float]:
    """The flat gradient of one NFT update of ``rollout`` with ``jagg_mode`` (``use_jagg=False``: DiffusionNFT's
    fresh noise per timestep), and its process CPU time."""
    model = trainer.model
    trainer.args.jagg_mode = jagg_mode
    trainer.args.use_jagg = use_jagg
    model.zero_grad(set_to_none=True)
    model.train()
    start = time.process_time()
    trainer.update_stage.run(model, rollout, micro_step=0, global_step=trainer.state.global_step, accumulation_steps=1)
    seconds = time.process_time() - start
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]), seconds


def measure_checkpoint(trainer: Any, repeats: int) -> dict[str, Any]:
    """JAGG's gradient cosine and relative error against exact shared-noise NFT and against DiffusionNFT's
    fresh-noise NFT, and the CPU-time ratio (exact / JAGG) of one rollout's update at the current weights."""
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    fresh, _ = _update(trainer, rollout, "exact", use_jagg=False)
    exact, _ = _update(trainer, rollout, "exact")
    jagg, _ = _update(trainer, rollout, "jagg")  # the warm-up pair
    ratios = []
    for _ in range(repeats):
        _, exact_s = _update(trainer, rollout, "exact")
        _, jagg_s = _update(trainer, rollout, "jagg")
        ratios.append(exact_s / jagg_s)
    trainer.args.use_jagg = True
    return {
        "cosine": _cosine(jagg, exact),
        "relative_error": float((jagg - exact).norm() / exact.norm()),
        "fresh_cosine": _cosine(jagg, fresh),
        "fresh_relative_error": float((jagg - fresh).norm() / fresh.norm()),
        "shared_fresh_cosine": _cosine(exact, fresh),
        "update_speedup": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median [min, max] over the rows of each gradient figure (JAGG against shared and fresh noise)."""
    names = ("cosine", "relative_error", "fresh_cosine", "fresh_relative_error", "shared_fresh_cosine")
    return {
        name: {
            "median": statistics.median(r[name] for r in rows),
            "min": min(r[name] for r in rows),
            "max": max(r[name] for r in rows),
        }
        for name in names
    }


def run_nft_jagg_benchmark(
    output_dir: str = "runs/bench",
    seeds: Sequence[int] = (0, 1, 2),
    checkpoints: Sequence[int] = (0, 20, 40),
    repeats: int = 5,
    num_threads: int | None = 1,
    model: str | None = None,
    plot: bool = True,
) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns and writes the report."""
    if not seeds or not checkpoints or repeats < 1 or sorted(checkpoints) != list(checkpoints):
        raise ValueError("Need seeds, increasing checkpoints and repeats >= 1.")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with torch_threads(num_threads), tempfile.TemporaryDirectory() as run_dir:
        for seed in seeds:
            trainer = demo_trainer(
                model or str(DEMO_ASSET_DIR), run_dir, steps=max(1, checkpoints[-1]), seed=seed, use_jagg=True,
                save_strategy="no", report_to="none", **NFT_DEMO_OVERRIDES,
            )  # fmt: skip
            trainer.add_callback(_Probe(trainer, seed, checkpoints, repeats, rows))
            trainer.train()
    report = {
        "setting": {**NFT_DEMO_OVERRIDES, "repeats": repeats, "torch_threads": num_threads},
        "rows": rows,
        "summary": summarize(rows),
    }
    (out / JSON_NAME).write_text(json.dumps(report, indent=2) + "\n")
    if plot:
        plot_nft_jagg(rows, str(out / PNG_NAME))
    return report


class _Probe(TrainerCallback):
    """Measures at the listed optimizer steps of an exact-NFT run (step 0: before the first), then clears the
    gradients it left so the run goes on as if unprobed (its rollouts are seeded by the step)."""

    def __init__(self, trainer: Any, seed: int, checkpoints: Sequence[int], repeats: int, rows: list) -> None:
        self.trainer, self.seed, self.checkpoints, self.repeats, self.rows = trainer, seed, checkpoints, repeats, rows

    def _probe(self, step: int) -> None:
        if step in self.checkpoints:
            self.rows.append({"seed": self.seed, "step": step, **measure_checkpoint(self.trainer, self.repeats)})
            self.trainer.args.jagg_mode = "exact"  # the run itself trains exact (shared-noise) NFT
            self.trainer.model.zero_grad(set_to_none=True)
            print(json.dumps(self.rows[-1]), flush=True)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.args.jagg_mode = "exact"
        self._probe(0)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._probe(state.global_step)


def plot_nft_jagg(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Gradient cosine per seed against the optimizer step, and the update's CPU-time ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cos_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for seed in sorted({r["seed"] for r in rows}):
        mine = [r for r in rows if r["seed"] == seed]
        line = cos_ax.plot([r["step"] for r in mine], [r["cosine"] for r in mine], marker="o", label=f"seed {seed}")
        steps, fresh = [r["step"] for r in mine], [r["fresh_cosine"] for r in mine]
        cos_ax.plot(steps, fresh, marker="x", linestyle="--", color=line[0].get_color())
        speed_ax.plot([r["step"] for r in mine], [r["update_speedup"]["median"] for r in mine], marker="o")
    cos_ax.set(
        xlabel="optimizer step (exact NFT)",
        ylabel="cosine: JAGG vs shared noise (o), vs fresh noise (x)",
        title="JAGG-NFT gradient, W = 4",
    )
    speed_ax.set(xlabel="optimizer step", ylabel="exact / JAGG update CPU time", title="update speed-up")
    cos_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
