"""Quality benchmark: does the faster step cost reward? The CPU demo trained with each update / rollout variant.

Every variant trains the demo (:mod:`trl_jagg.demo.run`: the shipped tiny Flux pipeline, LoRA, 9 colour x shape
prompts x 8 images per step, the ``prompt_color`` reward) from the same LoRA initialisation for each seed:

- ``exact``: one backward per trained step (``use_jagg=False``); the demo's fixed SDE window on steps 0-3.
- ``jagg_cache``: the demo as shipped, the window one JAGG group (W = 4) with the on-policy velocity cache.
- ``mix_jagg_cache``: MixGRPO-Flash on the demo at MixGRPO's cadence (see :func:`variant_overrides`): the 4-step
  SDE window moves one step every 20 rollouts, ODE elsewhere with DPM-Solver++ (order 2) on fewer steps,
  same-noise groups sharing the ODE before the window; the window is the JAGG group, with the cache.
- ``fast_jagg_cache``: the ``jagg-fast-flux`` preset's rollout on the demo: the same, with the window held on the
  first 4 (high-noise) steps and DPM-Solver++ on 40% of the 5 ODE steps after it (6 backbone calls instead of 9).
- ``nft``: DiffusionNFT (``objective="nft"``, :data:`~trl_jagg.benchmarks.nft.NFT_DEMO_OVERRIDES`): deterministic
  9-step rollouts, 4 of the 9 timesteps trained, exact per-timestep backward. ``nft_jagg``: the same with the 4
  timesteps as one JAGG group.
- ``awm`` / ``awm_jagg``: AWM (``objective="awm"``, :data:`AWM_DEMO_OVERRIDES`): the authors' loss, on-policy, 4
  stratified timesteps, exact per timestep or as one JAGG group.
- ``dgpo`` / ``dgpo_jagg``: DGPO (``objective="dgpo"``, :data:`DGPO_DEMO_OVERRIDES`): the group-level DPO loss on 4
  of the first 7 timesteps, the authors' PickScore settings, exact or as one JAGG group.
- ``dgpo_fast`` / ``dgpo_jagg_fast``: the same on the ``dgpo-sd35`` preset's rollout (:data:`DGPO_FAST_ROLLOUT`):
  DPM-Solver++ 2 on 6 steps instead of the demo's 9-step Euler.
- ``exact_low_kl``: ``exact`` at the KL coefficient of the forward-process variants (:data:`LOW_KL_BETA`, DGPO's),
  not the demo's 0.15: how much of their lead is the weaker anchor.

Three tasks (``task``): ``color``, the demo's ``prompt_color`` (the colour is settled in the first, high-noise
steps); ``detail``, the ``high_frequency`` reward (fine detail, which a window on the high-noise steps reaches only
through the shared weights); and ``stripes``, the ``horizontal_detail`` reward (oriented fine detail, far from its
ceiling, so that it does not saturate within a run).

Runs go seed by seed, the variants of a seed in rotating order (interleaved: a slower stretch of a shared machine
falls on every variant alike). Each run logs, per optimizer step, the rollout's mean reward, its share of images in
the named colour (``rewards/color_accuracy/mean``) and the process CPU time of training so far (evaluation left
out; one torch thread, so it counts the work and not the waits of a shared machine). At half-way and at the end the
trainer's ``evaluate`` renders the same held-out images for every run (the 9 prompts x ``eval_repeats`` seeds, the
full 9-step Euler ODE): the comparison that does not depend on how a variant samples its rollouts. Every
``eval_every`` steps (default a tenth of the run) it evaluates too, for the time to reward: per variant and seed the
training CPU time to the first evaluation at or above ``exact``'s mean held-out reward at the last step.

    trl-jagg bench quality --output_dir runs/quality [--task color] [--steps 100] [--seeds 0 1 2]

writes ``quality.json`` (rewritten after every run, so an interrupted benchmark keeps its finished runs) and
``quality.png`` (reward against optimizer step and against CPU time, mean over seeds and a thin line per seed).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trl_jagg.benchmarks.engine import torch_threads
from trl_jagg.benchmarks.nft import NFT_DEMO_OVERRIDES
from trl_jagg.benchmarks.race import flux_dev_pricing, markdown_table, summarize, time_to_reward, time_to_reward_table
from trl_jagg.demo.run import DEMO_ASSET_DIR, demo_prompts, demo_trainer
from trl_jagg.recipes import get_recipe

JSON_NAME = "quality.json"
PNG_NAME = "quality.png"
QUALITY_VARIANTS = (
    "exact", "jagg_cache", "mix_jagg_cache", "fast_jagg_cache", "nft", "nft_jagg", "awm", "awm_jagg", "dgpo",
    "dgpo_jagg", "exact_low_kl", "dgpo_fast", "dgpo_jagg_fast",
)  # fmt: skip

_FORWARD_PROCESS_DEMO = {
    "sde_window_size": 0, "sde_window_schedule": "random", "sde_window_max_start": None,
    "train_timesteps": "all_but_last",  # the default (the demo's "sde_window" is GRPO's): they draw their own
}  # fmt: skip
"""The demo's rollout as a forward-process objective samples it: deterministic ODE, no window."""
AWM_DEMO_OVERRIDES: dict[str, Any] = {
    **_FORWARD_PROCESS_DEMO, "objective": "awm", "awm_num_train_timesteps": 4, "awm_timestep_fraction": 0.9,
    "beta": 1e-4, "epsilon": 1.0, "jagg_group_size": 4, "jagg_frac": 1.0,
}  # fmt: skip
"""The demo as AWM's authors train (their KL 1e-4, KL-EMA 1, ghuber 0.25), 4 of the 9 timesteps per micro-batch
(one JAGG group of W = 4 in ``awm_jagg``), the demo's learning rate."""
DGPO_DEMO_OVERRIDES: dict[str, Any] = {
    **_FORWARD_PROCESS_DEMO, "objective": "dgpo", "dgpo_num_train_timesteps": 4, "dgpo_trunc_steps": 6,
    "dgpo_beta": 10.0, "beta": 1e-3, "epsilon": 5e-2, "jagg_group_size": 4, "jagg_frac": 1.0,
}  # fmt: skip
"""The demo as DGPO's authors train PickScore (DPO beta 10, KL 1e-3, clip 5e-2), 4 of the first 7 timesteps."""
DGPO_FAST_ROLLOUT: dict[str, Any] = {
    "num_inference_steps": 6, "ode_solver_order": 2, "dgpo_trunc_steps": 4, "eval_num_inference_steps": 9,
}  # fmt: skip
"""``dgpo_fast``'s rollout, at the ``dgpo-sd35`` preset's conventions: DPM-Solver++ 2 on 6 steps, the preset's 10 of
its 14 evaluation steps scaled to the demo's 9; 4 of the first 5 timesteps trained (the preset: of the first 7 of
10). The held-out evaluation stays the demo's 9-step Euler ODE, as for every variant."""
LOW_KL_BETA = 1e-3
"""``exact_low_kl``'s KL coefficient: DGPO's (the forward-process variants train with 1e-4 to 1e-3), against the
demo's 0.15."""
QUALITY_TASKS = {"color": "prompt_color", "detail": "high_frequency", "stripes": "horizontal_detail"}
"""The tasks by name, each the registered reward it trains on."""
FAST_PRESET = "jagg-fast-flux"
FAST_ROLLOUT_FIELDS = ("sde_window_schedule", "sde_window_max_start", "ode_solver_order", "ode_step_ratio",
                       "same_group_noise")  # fmt: skip
"""The fields of the fast preset's rollout that ``fast_jagg_cache`` takes as they are."""
MIX_WINDOW_SIZE = 4
"""The demo's window size (one JAGG group of W = 4), kept for the mixed rollout."""
MIX_SHIFT_INTERVAL = 20
"""Rollouts between two moves of the mixed rollout's window: MixGRPO-Flash's ``iters_per_group`` (the demo takes
one optimizer step per rollout, so also its optimizer steps)."""


def variant_overrides(variant: str, steps: int) -> dict[str, Any]:
    """The :func:`~trl_jagg.demo.run.demo_config` fields of ``variant`` for a run of ``steps`` optimizer steps.

    The mixed rollout is the ``mixgrpo-flux`` preset's (window 4, stride 1, a move every 20 rollouts, MixGRPO's end
    at ``num_steps - 2`` and roll-back, MixGRPO-Flash's count of DPM-Solver++ 2 steps after the window) on the
    demo's 9 steps, whatever ``steps``: 100 rollouts start it at steps 0-4 for 20 rollouts each (the last window,
    4-6, cut at MixGRPO's end), as MixGRPO-Flash's 300 rollouts cover starts 0-14 of 0-23 and never roll back.
    ``ode_step_ratio`` is 0.6, not 0.4: the demo's sides of the window have 1-5 ODE steps, and 0.4 would leave a
    single (first-order) DPM step after every window; 0.6 keeps 1-2 after it and 1-2 before it (6-7 backbone calls
    a rollout instead of 9). ``same_group_noise`` as in the preset (it lets a group share the ODE before the
    window).

    The fast variant takes :data:`FAST_ROLLOUT_FIELDS` from the ``jagg-fast-flux`` preset (window held at start 0,
    DPM-Solver++ 2 on 40% of the ODE steps: 2 for the demo's 5 after the window) and keeps the demo's window of 4.
    """
    if variant not in QUALITY_VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}: use one of {QUALITY_VARIANTS}.")
    if variant == "exact":
        return {"use_jagg": False}
    if variant == "exact_low_kl":
        return {"use_jagg": False, "beta": LOW_KL_BETA}
    if variant == "jagg_cache":
        return {"use_jagg": True, "jagg_cache_velocities": True}
    if variant in ("nft", "nft_jagg"):
        return {**NFT_DEMO_OVERRIDES, "use_jagg": variant == "nft_jagg"}
    if variant in ("awm", "awm_jagg"):
        return {**AWM_DEMO_OVERRIDES, "use_jagg": variant == "awm_jagg"}
    if variant in ("dgpo", "dgpo_jagg"):
        return {**DGPO_DEMO_OVERRIDES, "use_jagg": variant == "dgpo_jagg"}
    if variant in ("dgpo_fast", "dgpo_jagg_fast"):
        return {**DGPO_DEMO_OVERRIDES, **DGPO_FAST_ROLLOUT, "use_jagg": variant == "dgpo_jagg_fast"}
    if variant == "fast_jagg_cache":
        preset = get_recipe(FAST_PRESET).config
        return {"use_jagg": True, "jagg_cache_velocities": True, "sde_window_size": MIX_WINDOW_SIZE,
                **{name: preset[name] for name in FAST_ROLLOUT_FIELDS}}  # fmt: skip
    return {
        "use_jagg": True,
        "jagg_cache_velocities": True,
        "sde_window_size": MIX_WINDOW_SIZE,
        "sde_window_schedule": "progressive",
        "sde_window_max_start": None,
        "sde_window_stride": 1,
        "sde_window_shift_interval": MIX_SHIFT_INTERVAL,
        "ode_solver_order": 2,
        "ode_step_ratio": 0.6,
        "same_group_noise": True,
    }


def milestones(steps: int) -> list[int]:
    """The optimizer steps tabulated: half-way and the last (50 and 100 for the default run)."""
    return sorted({max(1, steps // 2), steps})


def evaluation_steps(steps: int, every: int) -> list[int]:
    """The optimizer steps evaluated: every ``every`` steps and the :func:`milestones`."""
    return sorted({*range(every, steps + 1, every), *milestones(steps)})


class EvaluateAt(TrainerCallback):
    """Asks the Trainer to evaluate at the end of the given optimizer steps (its own ``eval_steps`` is one period)."""

    def __init__(self, steps: Sequence[int]) -> None:
        self.steps = set(steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step in self.steps:
            control.should_evaluate = True
        return control


class TrainingCPUClock(TrainerCallback):
    """Process CPU seconds since ``train()`` began at the end of each optimizer step, evaluation time left out.

    The Trainer evaluates after ``on_step_end`` and calls ``on_evaluate`` when done, so the time between the two is
    the evaluation's (and the step's log line's), which later steps do not count.
    """

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.clock = clock
        self.seconds: dict[int, float] = {}
        self._start = 0.0
        self._last_step_end = 0.0
        self._excluded = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start = self._last_step_end = self.clock()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last_step_end = self.clock()
        self.seconds[state.global_step] = self._last_step_end - self._start - self._excluded

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = self.clock()
        self._excluded += now - self._last_step_end
        self._last_step_end = now


class TrainingWork(TrainerCallback):
    """The work of training so far at the end of each optimizer step, evaluation left out, as :class:`TrainingCPUClock`
    leaves out its time: ``counter`` is a :class:`~trl_jagg.benchmarks.whole_step.WorkCounter` (its ``counts``
    grow with every backbone row, backward row, decoded image and encoded prompt; ``close()`` removes its hooks)."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self.work: dict[int, dict[str, int]] = {}
        self._last_step_end: dict[str, int] = {}
        self._excluded: dict[str, int] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last_step_end = dict(self.counter.counts)
        self._excluded = dict(self.counter.counts)  # anything counted before training (none in the benchmark)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last_step_end = dict(self.counter.counts)
        self.work[state.global_step] = {k: v - self._excluded[k] for k, v in self._last_step_end.items()}

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = dict(self.counter.counts)
        self._excluded = {k: self._excluded[k] + now[k] - self._last_step_end[k] for k in now}
        self._last_step_end = now

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.counter.close()


def run_record(
    variant: str, seed: int, log_history: Sequence[dict[str, Any]], cpu_seconds: dict[int, float],
    work: dict[int, dict[str, int]] | None = None,
) -> dict:  # fmt: skip
    """One run's curves and evaluations from the trainer's ``log_history``, :class:`TrainingCPUClock`'s times and
    :class:`TrainingWork`'s counts (``work``: one dict per logged step, if given)."""
    logs = sorted((e for e in log_history if "reward" in e), key=lambda e: e["step"])
    evals = {e["step"]: e for e in log_history if "eval_reward" in e}
    record = {
        "variant": variant,
        "seed": seed,
        "step": [e["step"] for e in logs],
        "reward": [e["reward"] for e in logs],
        "color_accuracy": [e["rewards/color_accuracy/mean"] for e in logs],
        "cpu_s": [cpu_seconds[e["step"]] for e in logs],
        "eval": {
            str(step): {"reward": e["eval_reward"], "color_accuracy": e["eval_rewards/color_accuracy/mean"]}
            for step, e in sorted(evals.items())
        },
    }
    if work is not None:
        record["work"] = [work[e["step"]] for e in logs]
    return record


def plot_quality(runs: Sequence[dict[str, Any]], path: str, reward: str = "prompt_color") -> str:
    """Reward against optimizer step and against training CPU time, and colour accuracy against step: per variant
    the mean over its seeds (thick; CPU time also averaged), every seed (thin), and the evaluations' means
    (diamonds)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
               "tab:olive", "tab:cyan", "black", "gold", "darkred")  # fmt: skip
    colors = dict(zip(QUALITY_VARIANTS, palette))
    figure = Figure(figsize=(15, 4.5), dpi=90)
    FigureCanvasAgg(figure)
    step_ax, cpu_ax, accuracy_ax = figure.subplots(1, 3)
    for variant in QUALITY_VARIANTS:
        own = [r for r in runs if r["variant"] == variant]
        if not own:
            continue
        color = colors[variant]
        for run in own:
            step_ax.plot(run["step"], run["reward"], color=color, lw=0.6, alpha=0.45)
            cpu_ax.plot(run["cpu_s"], run["reward"], color=color, lw=0.6, alpha=0.45)
            accuracy_ax.plot(run["step"], run["color_accuracy"], color=color, lw=0.6, alpha=0.45)
        length = min(len(r["step"]) for r in own)
        mean = {key: [statistics.fmean(r[key][i] for r in own) for i in range(length)]
                for key in ("reward", "cpu_s", "color_accuracy")}  # fmt: skip
        label = f"{variant} (mean of {len(own)} seed{'s' * (len(own) > 1)})"
        step_ax.plot(own[0]["step"][:length], mean["reward"], color=color, lw=2.2, label=label)
        cpu_ax.plot(mean["cpu_s"], mean["reward"], color=color, lw=2.2, label=label)
        accuracy_ax.plot(own[0]["step"][:length], mean["color_accuracy"], color=color, lw=2.2, label=label)
        evaluated = sorted(set.intersection(*(set(r["eval"]) for r in own)), key=int)
        for ax, key in ((step_ax, "reward"), (accuracy_ax, "color_accuracy")):  # the held-out ODE images' means
            means = [statistics.fmean(r["eval"][s][key] for r in own) for s in evaluated]
            ax.plot([int(s) for s in evaluated], means, "D", color=color, ms=8, mec="black")
    step_ax.set(xlabel="optimizer step", ylabel=f"mean reward ({reward})",
                title="Reward per step (lines: rollouts; diamonds: held-out eval)")  # fmt: skip
    cpu_ax.set(xlabel="process CPU seconds of training (1 thread)", ylabel="rollout mean reward",
               title="Reward against CPU time")  # fmt: skip
    accuracy_ax.axhline(1 / 3, color="gray", lw=0.8, ls=":")
    accuracy_ax.set(xlabel="optimizer step", ylabel="fraction", title="Images in the named colour (diamonds: eval)",
                    ylim=(0, 1.02))  # fmt: skip
    for ax in (step_ax, cpu_ax, accuracy_ax):
        ax.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    return path


def run_order(seeds: Sequence[int], variants: Sequence[str]) -> list[tuple[int, str]]:
    """Seed by seed, the variants rotated by one at each seed (exact, jagg, mix; jagg, mix, exact; ...)."""
    order = []
    for i, seed in enumerate(seeds):
        shift = i % len(variants)
        order += [(seed, v) for v in (*variants[shift:], *variants[:shift])]
    return order


def run_quality_benchmark(
    output_dir: str,
    *,
    task: str = "color",
    steps: int = 100,
    seeds: Sequence[int] = (0, 1, 2),
    variants: Sequence[str] = QUALITY_VARIANTS,
    eval_repeats: int = 8,
    eval_every: int | None = None,
    model: str = DEMO_ASSET_DIR,
    num_threads: int = 1,
    price_flux: bool = True,
    beta: float | None = None,
) -> dict[str, Any]:
    """Train the demo with every variant and seed (see the module docstring); returns and writes the report.

    Args:
        output_dir: where ``quality.json``, ``quality.png`` and the runs' trainer folders go.
        task: a name of :data:`QUALITY_TASKS`: the reward trained and evaluated.
        steps: optimizer steps per run.
        seeds: training seeds (the LoRA initialisation and the rollouts); every variant runs each.
        variants: names from :data:`QUALITY_VARIANTS`.
        eval_repeats: held-out images per prompt at each evaluation (a different noise seed each).
        eval_every: optimizer steps between evaluations besides half-way and the last (default ``steps // 10``);
            the time to reward is read at these steps.
        model: the pipeline (the shipped demo model by default).
        num_threads: torch CPU threads while training; restored afterwards.
        price_flux: also price the time to reward in FLOPs at FLUX.1-dev's size (:func:`~trl_jagg.benchmarks.race.flux_dev_pricing`).
        beta: the KL coefficient of every variant (``None``: the demo's 0.15; the Flux presets train with 0).
    """
    import torch
    from datasets import Dataset

    from trl_jagg.benchmarks.whole_step import WorkCounter

    unknown = sorted(set(variants) - set(QUALITY_VARIANTS))
    if unknown:
        raise ValueError(f"Unknown `variants` {unknown}: use names of {list(QUALITY_VARIANTS)}.")
    if task not in QUALITY_TASKS:
        raise ValueError(f"Unknown `task` {task!r}: use one of {list(QUALITY_TASKS)}.")
    if steps < 1 or eval_repeats < 1 or not seeds:
        raise ValueError(f"Need `steps` >= 1, `eval_repeats` >= 1 and a seed, got {steps}, {eval_repeats}, {seeds}.")
    every = max(1, steps // 10) if eval_every is None else eval_every
    if every < 1:
        raise ValueError(f"`eval_every` must be >= 1 (or None: steps // 10), got {eval_every}.")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    at_steps = milestones(steps)
    kl = {} if beta is None else {"beta": beta}
    prompts = demo_prompts()
    eval_dataset = Dataset.from_dict({"prompt": prompts * eval_repeats})
    report: dict[str, Any] = {
        "config": {
            "model": model, "task": task, "reward": QUALITY_TASKS[task], "steps": steps,
            "evaluated_steps": evaluation_steps(steps, every), "seeds": list(seeds), "eval_steps": at_steps,
            "eval_images": len(prompts) * eval_repeats, "torch_threads": num_threads, "torch": torch.__version__,
            "timer": "process CPU time of training (process_time), evaluation excluded",
            "beta": beta,
            "variants": {v: {**variant_overrides(v, steps), **kl} for v in variants},
            "order": run_order(seeds, list(variants)),
        },
        "runs": [],
    }  # fmt: skip
    with torch_threads(num_threads):
        for seed, variant in report["config"]["order"]:
            print(f"[quality] {variant} seed {seed}: {steps} steps", flush=True)
            trainer = demo_trainer(
                model, str(out / f"{variant}_seed{seed}"), steps=steps, seed=seed, eval_dataset=eval_dataset,
                eval_strategy="steps", eval_steps=every, per_device_eval_batch_size=len(prompts),
                reward=QUALITY_TASKS[task], **variant_overrides(variant, steps), **kl,
            )  # fmt: skip
            clock, work = TrainingCPUClock(), TrainingWork(WorkCounter(trainer.adapter.pipeline))
            for callback in (EvaluateAt(report["config"]["evaluated_steps"]), clock, work):
                trainer.add_callback(callback)
            trainer.train()
            report["runs"].append(run_record(variant, seed, trainer.state.log_history, clock.seconds, work.work))
            del trainer
            report["summary"] = summarize(report["runs"], at_steps)
            report["time_to_reward"] = time_to_reward(report["runs"])
            (out / JSON_NAME).write_text(json.dumps(report, indent=2))
            plot_quality(report["runs"], str(out / PNG_NAME), QUALITY_TASKS[task])
    if price_flux:  # counting FLUX.1-dev's modules takes a minute or two, once
        report["time_to_reward"] = time_to_reward(report["runs"], flops=flux_dev_pricing)
        (out / JSON_NAME).write_text(json.dumps(report, indent=2))
    print(markdown_table(report["summary"]))
    print(time_to_reward_table(report["time_to_reward"]))
    print(f"wrote {out / JSON_NAME} and {out / PNG_NAME}")
    return report
