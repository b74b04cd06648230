"""The statistics of a finished ``trl-jagg bench quality`` race, read from its runs' records: reward at milestone
steps, the CPU time (and FLUX.1-dev FLOPs) to a reference variant's held-out reward, each seed paired with the same
seed's reference run, and their Markdown tables. Torch-free: the runs are plain JSON records
(:func:`trl_jagg.benchmarks.quality.run_record`), so a race run in several invocations (one per seed, say) is read
by concatenating their ``runs``."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any


def summarize(runs: Sequence[dict[str, Any]], at_steps: Sequence[int]) -> dict[str, Any]:
    """Per variant and milestone step: the rollout's reward and colour accuracy at that step, the evaluation's, and
    the training CPU seconds up to it, per seed (in run order) and their mean over seeds."""
    table: dict[str, Any] = {}
    for run in runs:
        for step in at_steps:
            if step not in run["step"]:
                continue
            i = run["step"].index(step)
            values = {
                "reward": run["reward"][i],
                "color_accuracy": run["color_accuracy"][i],
                "eval_reward": run["eval"].get(str(step), {}).get("reward", math.nan),
                "eval_color_accuracy": run["eval"].get(str(step), {}).get("color_accuracy", math.nan),
                "cpu_s": run["cpu_s"][i],
            }
            entry = table.setdefault(run["variant"], {}).setdefault(str(step), {"seeds": [], "per_seed": {}})
            entry["seeds"].append(run["seed"])
            for key, value in values.items():
                entry["per_seed"].setdefault(key, []).append(value)
    for variant in table.values():
        for entry in variant.values():
            entry["mean"] = {key: statistics.fmean(values) for key, values in entry["per_seed"].items()}
    return table


def first_reaching(run: dict[str, Any], target: float) -> tuple[int, int] | None:
    """``(step, index)`` of ``run``'s first evaluation whose held-out reward is at or above ``target`` (``index``
    into the run's logged steps), or ``None`` if none is."""
    reached = [int(s) for s in sorted(run["eval"], key=int) if run["eval"][s]["reward"] >= target]
    return (reached[0], run["step"].index(reached[0])) if reached else None


def time_to_reward(
    runs: Sequence[dict[str, Any]], reference: str = "exact", flops: Callable[[dict[str, int]], float] | None = None
) -> dict[str, Any]:
    """Per variant, the training CPU seconds to reach ``reference``'s held-out reward at its last step.

    The target is the mean over ``reference``'s seeds of its last evaluation's reward. Per run: the CPU seconds up to
    the first evaluated step whose held-out reward is at or above it (``None`` if none is); per variant their median
    over seeds (a run that never reaches it counts as slower than any that does; ``None`` when half or more never
    do) and ``reference``'s median CPU seconds to its last step over that median (``speedup``; over each seed's time:
    ``speedup_per_seed``, ``None`` where never reached). With ``flops`` (the
    FLOPs of a step's counted work, e.g. :func:`flux_dev_pricing`) and runs that carry their ``work``, the same for
    the FLOPs of the work done up to that step (``flops``, ``median_flops``, ``flop_speedup``): the time predicted at
    that size. Empty without a ``reference`` run."""
    own = [r for r in runs if r["variant"] == reference]
    if not own:
        return {}
    last = str(max(r["step"][-1] for r in own))
    targets = [r["eval"][last]["reward"] for r in own if last in r["eval"]]
    if not targets:
        return {}
    target = statistics.fmean(targets)
    priced = flops is not None and all("work" in r for r in runs)
    table: dict[str, Any] = {"target_eval_reward": target, "at_step": int(last), "reference": reference,
                             "reference_cpu_s": statistics.median(r["cpu_s"][-1] for r in own), "variants": {}}  # fmt: skip
    if priced:
        table["reference_flops"] = statistics.median(flops(r["work"][-1]) for r in own)
    for run in runs:
        step, i = first_reaching(run, target) or (None, None)
        entry = table["variants"].setdefault(run["variant"], {"seeds": [], "step": [], "cpu_s": []})
        entry["seeds"].append(run["seed"])
        entry["step"].append(step)
        entry["cpu_s"].append(None if i is None else run["cpu_s"][i])
        if priced:
            entry.setdefault("flops", []).append(None if i is None else flops(run["work"][i]))
    for entry in table["variants"].values():
        for key, median_key, speedup_key, total in (
            ("cpu_s", "median_cpu_s", "speedup", table["reference_cpu_s"]),
            ("flops", "median_flops", "flop_speedup", table.get("reference_flops")),
        ):
            if key not in entry:
                continue
            median = statistics.median(math.inf if c is None else c for c in entry[key])
            entry[median_key] = None if math.isinf(median) else median
            entry[speedup_key] = None if entry[median_key] is None else total / entry[median_key]
            entry[f"{speedup_key}_per_seed"] = [None if c is None else total / c for c in entry[key]]
    return table


def paired_race(runs: Sequence[dict[str, Any]], reference: str = "exact", last_evaluations: int = 3) -> dict:
    """The race as issue 38 asks it to be read: the target is ``reference``'s held-out reward averaged over its last
    ``last_evaluations`` evaluations and over its seeds (not one noisy point); per variant and seed, the training CPU
    seconds to the first evaluation at or above it, and the ratio against the *same seed's* ``reference`` CPU seconds
    to its last step. Per variant: those ratios' median, minimum and maximum over seeds (a seed that never reaches the
    target makes the minimum ``None``: the target is not met by the minimum), and the held-out reward at the last step
    per seed."""
    own = {r["seed"]: r for r in runs if r["variant"] == reference}
    if not own:
        return {}
    evaluated = sorted({int(s) for r in own.values() for s in r["eval"]})[-last_evaluations:]
    target = statistics.fmean(
        r["eval"][str(s)]["reward"] for r in own.values() for s in evaluated if str(s) in r["eval"]
    )
    table: dict[str, Any] = {"reference": reference, "target_eval_reward": target, "target_steps": evaluated,
                             "variants": {}}  # fmt: skip
    for run in runs:
        exact = own.get(run["seed"])
        if exact is None:
            continue
        reached = first_reaching(run, target)
        seconds = run["cpu_s"][reached[1]] if reached else None
        last = str(max(int(s) for s in run["eval"]))
        entry = table["variants"].setdefault(run["variant"], {"seeds": [], "cpu_s": [], "ratio": [], "final": []})
        entry["seeds"].append(run["seed"])
        entry["cpu_s"].append(seconds)
        entry["ratio"].append(None if seconds is None else exact["cpu_s"][-1] / seconds)
        entry["final"].append(run["eval"][last]["reward"])
    for entry in table["variants"].values():
        reached = [r for r in entry["ratio"] if r is not None]
        entry["median"] = statistics.median(math.inf if r is None else r for r in entry["ratio"]) if reached else None
        entry["median"] = None if entry["median"] == math.inf else entry["median"]
        entry["min"] = None if len(reached) < len(entry["ratio"]) else min(reached)
        entry["max"] = max(reached) if reached else None
        entry["final_mean"] = statistics.fmean(entry["final"])
    return table


def paired_race_table(table: dict[str, Any]) -> str:
    """:func:`paired_race` as a Markdown table."""

    def ratio(value: float | None) -> str:
        return "not reached" if value is None else f"{value:.2f}x"

    lines = [
        "| variant | held-out reward at the last step (mean; per seed) | CPU s to the target (per seed) | speed-up vs the "
        "same seed's exact, median [min, max] |",
        "|---|---|---|---|",
    ]
    for variant, entry in table["variants"].items():
        finals = ", ".join(f"{v:+.3f}" for v in entry["final"])
        seconds = ", ".join("-" if c is None else f"{c:.0f}" for c in entry["cpu_s"])
        lines.append(
            f"| `{variant}` | {entry['final_mean']:+.3f} ({finals}) | {seconds} | {ratio(entry['median'])} "
            f"[{ratio(entry['min'])}, {ratio(entry['max'])}] |"
        )
    return "\n".join(lines)


def flux_dev_pricing(work: dict[str, int]) -> float:
    """FLOPs of ``work`` (counts of :class:`TrainingWork`) at FLUX.1-dev's size, 1024 px with LoRA
    (:func:`~trl_jagg.benchmarks.flops.flux_dev_costs`, no checkpointing, as the demo trains): the compute the same
    schedule of rows, backwards, decodes and prompt encodings would take there."""
    from trl_jagg.benchmarks.flops import flux_dev_costs, step_flops

    return step_flops(flux_dev_costs()["lora"], work, checkpointing=False)


def _speedup_cell(entry: dict[str, Any], key: str) -> str:
    """``median [min, max]`` of a :func:`time_to_reward` speed-up over the seeds that reached the target ("-": none
    measured or the median not reached)."""
    reached = [x for x in entry.get(f"{key}_per_seed", []) if x is not None]
    if entry.get(key) is None:
        return "-"
    return f"{entry[key]:.2f}x [{min(reached):.2f}, {max(reached):.2f}]"


def time_to_reward_table(table: dict[str, Any]) -> str:
    """:func:`time_to_reward` as a Markdown table: per variant the median CPU seconds (the seeds' in brackets, "-"
    for a seed that never reached the target), the evaluated steps it took, and the speed-ups (median [min, max]
    over the seeds that reached it)."""
    if not table:
        return ""
    lines = [
        f"Time to {table['reference']}'s held-out reward at step {table['at_step']} "
        f"({table['target_eval_reward']:+.3f}; {table['reference']} takes {table['reference_cpu_s']:.0f} CPU s to "
        f"step {table['at_step']}):",
        "",
        "| variant | CPU s to target | step reached | speed-up vs exact's time | FLUX.1-dev speed-up (FLOPs) |",
        "|---|---|---|---|---|",
    ]
    for variant, entry in table["variants"].items():
        seconds = ", ".join("-" if c is None else f"{c:.0f}" for c in entry["cpu_s"])
        steps = ", ".join("-" if s is None else str(s) for s in entry["step"])
        median = "not reached" if entry["median_cpu_s"] is None else f"{entry['median_cpu_s']:.0f}"
        speedup, flop_speedup = (_speedup_cell(entry, key) for key in ("speedup", "flop_speedup"))
        lines.append(f"| {variant} | **{median}** [{seconds}] | {steps} | {speedup} | {flop_speedup} |")
    return "\n".join(lines)


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table: a row per variant and milestone, the mean over seeds with the per-seed
    values in brackets."""
    lines = [
        "| variant | step | seeds | rollout reward | rollout colour acc. | eval reward | eval colour acc. | CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, by_step in summary.items():
        for step, entry in by_step.items():
            cells = []
            for key, fmt in (("reward", "+.3f"), ("color_accuracy", ".2f"), ("eval_reward", "+.3f"),
                             ("eval_color_accuracy", ".2f"), ("cpu_s", ".0f")):  # fmt: skip
                per_seed = ", ".join(format(v, fmt) for v in entry["per_seed"][key])
                cells.append(f"**{format(entry['mean'][key], fmt)}** [{per_seed}]")
            seeds = ",".join(str(s) for s in entry["seeds"])
            lines.append(f"| {variant} | {step} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
