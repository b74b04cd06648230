"""``make gpu-check``: the project's speed and exactness claims measured on one GPU at FLUX.1-dev size, in under 8
minutes, most important first, each part written out as soon as it ends.

The transformer is ``FluxTransformer2DModel`` built from FLUX.1-dev's published config with random weights,
directly on the GPU in bfloat16 (nothing is downloaded; :func:`trl_jagg.benchmarks.gpu.build_pipeline`: tiny text
encoders and VAE with the real output widths), at 512 px (1024 image tokens) and 512 text tokens, rewarded by the
weight-free ``prompt_color``. The parts, in order, with the time each may take (``PARTS``; a part starts only if its
budget still fits in ``--time_limit_s``, 420 s by default; otherwise it is recorded as skipped):

====================  ======  ==================================================================================
part                  budget  what
====================  ======  ==================================================================================
``numerics``          90 s    builds the 12B transformer (19 + 38 blocks) with Flow-GRPO's LoRA (r 64), 9 steps
                              (8 trained), G = 4 in micro-batches of 2; on one rollout: the update's gradient of
                              W = 2, ``jagg_frac = 0`` and JAGG (with and without the velocity cache) at W = 4 and
                              8 against exact (cosine, relative error; exact twice as the noise floor); cached
                              velocities against recomputed ones; the rollout-vs-update log-prob gap with and
                              without the cache and the first PPO ratio (:func:`~.gpu_measure.numerics`)
``cadence_dancegrpo`` 80 s    whole steps at ``dancegrpo-flux``'s cadence (``train()``: 12 micro-batches of one,
                              3 optimizer steps per rollout, a random 60% of 15 steps trained, checkpointing):
                              exact DanceGRPO and the preset's JAGG + cache, interleaved, a warm-up and 2 repeats,
                              on a 5 + 10-block transformer of FLUX.1-dev's widths (all 57 blocks: about 40 s a
                              rollout by the FLOP model); synchronised wall time, peak CUDA memory, the backbone's
                              achieved TFLOP/s from the FLOP model and MFU against 790 TFLOP/s; the share of
                              JAGG intermediates the velocity cache served (the default ``recompute``: those
                              before the rollout's first optimizer step)
``cadence_fast_mix``  60 s    the same for MixGRPO-Flash (``mixgrpo-flux`` with an exact update) and the fast
                              preset (:data:`FAST_PRESETS`, where registered), against ``cadence_dancegrpo``'s
                              exact step (not interleaved with it: the GPU is not shared); each ``train()``
                              call starts at optimizer step 0: a sliding window is timed at its first position
``update_stage``      120 s   the update stage exact / JAGG / JAGG + cache at W = 4 and W = 8 on the numerics'
                              trainer (:func:`~trl_jagg.benchmarks.trainer.time_variants`: interleaved, a warm-up
                              and 2 repeats, each on a fresh rollout, peak memory)
====================  ======  ==================================================================================

The budgets are estimates (FLOP counts at about 45% of the bf16 peak, no GPU run yet); the first run's
``elapsed_s`` per part replaces them. Start-up (installing the wheels, importing torch and diffusers) takes about 30 s
more. It writes
``gpu_check.json`` (everything, rewritten after every part), ``gpu_check.png`` (the timing bars and the numerics
table) and ``gpu_check.md`` (the section of ``docs/benchmarks.md``) to ``--output_dir`` and prints the summary table.
``--tiny`` runs every part with a tiny transformer on the CPU in seconds (the suite's dry run). ``--render_docs``
writes a report's section into ``docs/benchmarks.md`` (between its ``gpu-check`` markers)::

    make gpu-check OUT=runs/gpu_check                                            # on the GPU machine
    python -m trl_jagg.benchmarks.gpu_check --output_dir runs/gpu_check --tiny   # the dry run, on a CPU
    python -m trl_jagg.benchmarks.gpu_check --render_docs runs/gpu_check/gpu_check.json docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

JSON_NAME, PNG_NAME, MD_NAME = "gpu_check.json", "gpu_check.png", "gpu_check.md"
TIME_LIMIT_S = 420.0
"""No part starts after this many seconds unless its budget fits: start-up included, the run ends within 8 minutes."""
FAST_PRESETS = ("jagg-fast-flux",)
"""The project's fast preset(s) the cadence part times, where :mod:`trl_jagg.recipes` registers them at run time."""
CADENCE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dancegrpo-exact": ("dancegrpo-flux", {"use_jagg": False}),
    "dancegrpo-flux": ("dancegrpo-flux", {}),
    "mixgrpo-flash": ("mixgrpo-flux", {"use_jagg": False}),
    **{name: (name, {}) for name in FAST_PRESETS},
}
"""Whole-step variants: the preset and the fields it changes (exact DanceGRPO; MixGRPO-Flash: DPM-Solver++ outside
the window, an exact update)."""
EXACT = "dancegrpo-exact"
CADENCE_BLOCKS = (5, 10)
"""Double- and single-stream blocks of the cadence parts' transformer (FLUX.1-dev's widths)."""
TINY_CADENCE = {"num_generations": 4, "steps_per_generation": 4, "gradient_accumulation_steps": 2}
"""``--tiny`` only: fewer images per rollout, still two optimizer steps per rollout (the dry run checks the path)."""
DOCS_BEGIN, DOCS_END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"


@dataclass(frozen=True)
class Part:
    name: str
    budget_s: float
    run: Callable[[Session], dict[str, Any]]


class Session:
    """What the parts share: the sizes, the device and the models, built by the first part that needs them."""

    def __init__(self, ns: argparse.Namespace, workdir: str):
        from trl_jagg.benchmarks.flops import FLUX_DEV_TRANSFORMER
        from trl_jagg.benchmarks.gpu import TINY_TRANSFORMER

        self.tiny, self.workdir = ns.tiny, workdir
        self.cuda = torch.cuda.is_available() and not ns.tiny
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.resolution, self.text_tokens, self.repeats = ns.resolution, ns.max_sequence_length, ns.repeats
        self.lora_rank = 4 if ns.tiny else 64
        self.full_config = TINY_TRANSFORMER if ns.tiny else FLUX_DEV_TRANSFORMER
        blocks = dict(zip(("num_layers", "num_single_layers"), ns.cadence_blocks))
        self.cadence_config = TINY_TRANSFORMER if ns.tiny else FLUX_DEV_TRANSFORMER | blocks
        self._lora_trainer: Any = None
        self._cadence_pipe: Any = None
        self.cadence_costs: Any = None

    def lora_trainer(self) -> Any:
        """The numerics' and update stage's trainer: Flow-GRPO's LoRA on the full-depth transformer."""
        if self._lora_trainer is None:
            from datasets import Dataset
            from peft import LoraConfig

            from trl_jagg.benchmarks.gpu import build_pipeline
            from trl_jagg.benchmarks.trainer import PROMPTS
            from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
            from trl_jagg.recipes import get_recipe
            from trl_jagg.trainer.ddpo_jagg_trainer import DDPOJaggTrainer

            pipe = build_pipeline(self.full_config, self.device, self.dtype)
            lora = get_recipe("flow-grpo-flux").lora | {"r": self.lora_rank, "lora_alpha": 2 * self.lora_rank}
            args = GRPOJaggConfig(
                output_dir=os.path.join(self.workdir, "lora"), num_generations=4, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, height=self.resolution, width=self.resolution,
                max_sequence_length=self.text_tokens, num_inference_steps=9, guidance_scale=3.5, epsilon=1e-4,
                jagg_frac=1.0, use_cpu=not self.cuda, report_to="none", disable_tqdm=True, seed=0,
            )  # fmt: skip
            torch.manual_seed(0)
            self._lora_trainer = DDPOJaggTrainer(
                model=pipe, reward_funcs="prompt_color", args=args,
                train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=LoraConfig(**lora),
            )  # fmt: skip
        return self._lora_trainer

    def cadence_trainers(self, names: Sequence[str]) -> dict[str, Any]:
        """A :class:`~.gpu_measure.CadenceRun` per variant of ``names`` on the shared cadence transformer (built
        once, priced once)."""
        from trl_jagg.benchmarks.gpu import build_pipeline
        from trl_jagg.benchmarks.gpu_measure import backbone_step_costs, build_cadence_trainer

        if self._cadence_pipe is None:
            self._cadence_pipe = build_pipeline(self.cadence_config, self.device, self.dtype)
            self.cadence_costs = backbone_step_costs(self.cadence_config, self.resolution, self.text_tokens)
        run = {"height": self.resolution, "width": self.resolution, "max_sequence_length": self.text_tokens,
               "use_cpu": not self.cuda, "bf16": self.cuda, "seed": 0,
               **(TINY_CADENCE if self.tiny else {})}  # fmt: skip
        return {
            name: build_cadence_trainer(self._cadence_pipe, *CADENCE_VARIANTS[name], self.workdir, **run)
            for name in names
        }


# ---------------------------------------------------------------------------------------------- the parts
def _numerics(session: Session) -> dict[str, Any]:
    from trl_jagg.benchmarks.gpu_measure import numerics

    return numerics(session.lora_trainer())


def _cadence(names: Sequence[str]) -> Callable[[Session], dict[str, Any]]:
    def run(session: Session) -> dict[str, Any]:
        from trl_jagg.benchmarks.gpu_measure import cadence_steps
        from trl_jagg.recipes import RECIPES

        missing = {n: f"preset {CADENCE_VARIANTS[n][0]!r} is not registered" for n in names
                   if CADENCE_VARIANTS[n][0] not in RECIPES}  # fmt: skip
        present = [n for n in names if n not in missing]
        trainers = session.cadence_trainers(present)
        try:
            results = cadence_steps(trainers, session.cadence_costs, repeats=session.repeats)
        finally:
            del trainers
            gc.collect()
        return {"variants": results, "skipped_variants": missing,
                "transformer_blocks": [session.cadence_config["num_layers"],
                                       session.cadence_config["num_single_layers"]]}  # fmt: skip

    return run


def _update_stage(session: Session) -> dict[str, Any]:
    from trl_jagg.benchmarks.trainer import time_variants

    results, rollout_s = time_variants(
        session.lora_trainer(), group_sizes=(4, 8), jagg_fracs=(1.0,), repeats=session.repeats, memory=session.cuda
    )  # the CPU's peak-memory probe is slow and measured by the suite elsewhere
    return {"results": results, "rollout_s": rollout_s}


PARTS = (
    Part("numerics", 90.0, _numerics),
    Part("cadence_dancegrpo", 80.0, _cadence((EXACT, "dancegrpo-flux"))),
    Part("cadence_fast_mix", 60.0, _cadence(("mixgrpo-flash", *FAST_PRESETS))),
    Part("update_stage", 120.0, _update_stage),
)
"""The parts in the order they run (most important first) and each one's time budget in seconds on one H200."""


# ---------------------------------------------------------------------------------------------- the report
def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for name in ("torch", "transformers", "diffusers", "accelerate", "peft", "trl", "datasets", "trl_jagg"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _cadence_speedups(parts: dict[str, Any]) -> None:
    """Add each cadence variant's speedup over exact DanceGRPO (median step time of ``cadence_dancegrpo``)."""
    exact = parts.get("cadence_dancegrpo", {}).get("result", {}).get("variants", {}).get(EXACT)
    for name in ("cadence_dancegrpo", "cadence_fast_mix"):
        for entry in parts.get(name, {}).get("result", {}).get("variants", {}).values():
            entry["speedup_vs_exact"] = exact["step_s"]["median"] / entry["step_s"]["median"] if exact else None


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The summary table: (part, measurement, value) rows of every part that finished; the others' status."""
    rows: list[tuple[str, str, str]] = []
    parts = report["parts"]
    for name, part in parts.items():
        if part["status"] != "done":
            rows.append((name, part["status"], part.get("reason") or part.get("error", "")[:80]))
            continue
        result = part["result"]
        if name == "numerics":
            for check, g in result["gradients"].items():
                rows.append((name, f"grad {check} vs exact: cosine / rel error",
                             f"{g['cosine']:.6f} / {g['rel_error']:.2e}"))  # fmt: skip
            for how, v in result["velocity"].items():
                rows.append((name, f"cached velocity vs {how}: max abs / bitwise",
                             f"{v['max_abs']:.2e} / {'yes' if v['bitwise_equal'] else 'no'}"))  # fmt: skip
            for how, gap in result["log_prob_gap"].items():
                rows.append((name, f"log-prob gap ({how}): mean / max abs, first ratio max abs(r - 1)",
                             f"{gap['mean_abs']:.2e} / {gap['max_abs']:.2e}, {gap['ratio_max_dev']:.2e}"))  # fmt: skip
            rows.append(
                (name, "first PPO ratio logged (exact)", f"{result['exact_logged'].get('ratio', float('nan')):.6f}")
            )
        elif name.startswith("cadence"):
            for variant, v in result["variants"].items():
                s, speedup = v["step_s"], v.get("speedup_vs_exact")
                peak = "-" if v["peak_gib"] is None else f"{v['peak_gib']:.1f} GiB"
                rows.append((name, f"{variant}: step s [min, max], vs exact, opt steps, TFLOP/s, MFU, peak",
                             f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}], "
                             f"{'-' if speedup is None else f'{speedup:.2f}x'}, {v['optimizer_steps']}, "
                             f"{v['achieved_tflops']:.0f}, {v['mfu']:.1%}, {peak}"))  # fmt: skip
                if v.get("cache_served") is not None:
                    rows.append((name, f"{variant}: JAGG intermediates the velocity cache served",
                                 f"{v['cache_served']:.0%}"))  # fmt: skip
            for variant, reason in result["skipped_variants"].items():
                rows.append((name, f"{variant}: skipped", reason))
        elif name == "update_stage":
            for r in result["results"]:
                u = r["update_speedup"]
                rows.append((name, f"{r['variant']} W={r['group_size'] or '-'}: update speedup [min, max], model",
                             f"{u['median']:.2f}x [{u['min']:.2f}, {u['max']:.2f}], "
                             f"{r['theory_update_speedup']:.2f}x"))  # fmt: skip
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The ``docs/benchmarks.md`` section of ``report``: command, machine, versions, the summary table."""
    config = report["config"]
    versions = ", ".join(f"{k} {v}" for k, v in config["versions"].items() if v)
    lines = [
        f"Measured by `{config['command']}` on {config['device']} (commit {config['commit'] or 'unknown'}), "
        f"{report['elapsed_s']:.0f} s; {versions}.",
        "",
        "| part | measurement | value |",
        "|---|---|---|",
        *(f"| {part} | {what} | {value} |" for part, what, value in summary_rows(report)),
    ]
    return "\n".join(lines)


def fill_docs(section: str, docs: str | Path) -> None:
    """Replace what stands between the ``gpu-check`` markers of ``docs`` by ``section``."""
    path = Path(docs)
    text = path.read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise ValueError(f"{docs} has no {DOCS_BEGIN} ... {DOCS_END} markers to fill.")
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    path.write_text(f"{head}{DOCS_BEGIN}\n{section}\n{DOCS_END}{tail}")


def plot(report: dict[str, Any], path: Path) -> None:
    """The timing bars (whole step at each preset's cadence, update-stage speedups) and the numerics table."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 6), dpi=100)
    FigureCanvasAgg(figure)
    steps, update, table = figure.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 2]})
    variants = {k: v for p in ("cadence_dancegrpo", "cadence_fast_mix")
                for k, v in report["parts"].get(p, {}).get("result", {}).get("variants", {}).items()}  # fmt: skip
    if variants:
        medians = [v["step_s"]["median"] for v in variants.values()]
        spread = [[m - v["step_s"]["min"] for m, v in zip(medians, variants.values())],
                  [v["step_s"]["max"] - m for m, v in zip(medians, variants.values())]]  # fmt: skip
        steps.bar(range(len(variants)), medians, yerr=spread, capsize=3, color="tab:blue")
        steps.set_xticks(range(len(variants)), list(variants), rotation=30, fontsize=8)
    steps.set(ylabel="s per rollout (synchronised)", title="whole step at each preset's cadence")
    results = report["parts"].get("update_stage", {}).get("result", {}).get("results", [])
    if results:
        labels = [f"{r['variant']}\nW={r['group_size'] or '-'}" for r in results]
        update.bar(range(len(results)), [r["update_speedup"]["median"] for r in results], color="tab:orange")
        update.set_xticks(range(len(results)), labels, rotation=90, fontsize=7)
    update.axhline(1.0, color="gray", lw=0.8)
    update.set(ylabel="speedup over exact", title="update stage (LoRA)")
    table.axis("off")
    rows = [(what[:60], value) for part, what, value in summary_rows(report) if part == "numerics"]
    if rows:
        cells = table.table(
            cellText=rows, colLabels=[f"numerics ({report['config']['dtype']})", "value"], loc="center", cellLoc="left"
        )
        cells.auto_set_font_size(False)
        cells.set_fontsize(7)
    figure.suptitle(f"make gpu-check: {report['config']['device']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)


def write(report: dict[str, Any], out: Path) -> None:
    """Write the JSON, the PNG and the Markdown section (after every part: a run cut short still reports)."""
    _cadence_speedups(report["parts"])
    (out / JSON_NAME).write_text(json.dumps(report, indent=2))
    plot(report, out / PNG_NAME)
    (out / MD_NAME).write_text(markdown(report) + "\n")


# ---------------------------------------------------------------------------------------------- the run
def run(ns: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Run the parts of ``ns.parts`` in :data:`PARTS`' order under the time guard; returns the report."""
    start = time.perf_counter()
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    selected = [p for p in PARTS if p.name in ns.parts]
    report: dict[str, Any] = {
        "config": {
            "command": " ".join(["python -m trl_jagg.benchmarks.gpu_check", *argv]),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not ns.tiny else "cpu",
            "dtype": "bfloat16" if torch.cuda.is_available() and not ns.tiny else "float32",
            "tiny": ns.tiny,
            "resolution": ns.resolution,
            "text_tokens": ns.max_sequence_length,
            "repeats": ns.repeats,
            "cadence_blocks": list(ns.cadence_blocks),
            "time_limit_s": ns.time_limit_s,
            "budgets_s": {p.name: p.budget_s for p in PARTS},
            "versions": _versions(),
            "commit": _commit(),
        },  # fmt: skip
        "parts": {p.name: {"status": "pending", "budget_s": p.budget_s} for p in selected},
        "elapsed_s": 0.0,
    }
    write(report, out)  # the machine and versions, even if the first part never ends
    with tempfile.TemporaryDirectory() as workdir:
        session = Session(ns, workdir)
        for part in selected:
            entry = report["parts"][part.name]
            began = time.perf_counter() - start
            if began + part.budget_s > ns.time_limit_s:
                entry.update(status="skipped", reason=f"{began:.0f} s + budget {part.budget_s:.0f} s > limit")
            else:
                print(f"[gpu-check] {part.name} (budget {part.budget_s:.0f} s) at {began:.0f} s", flush=True)
                try:
                    entry.update(status="done", result=part.run(session))
                except Exception as error:  # recorded, and the next part runs: one failure must not lose the rest
                    traceback.print_exc()
                    entry.update(status="error", error=f"{type(error).__name__}: {error}")
                    if session.cuda:
                        torch.cuda.empty_cache()
                entry["elapsed_s"] = time.perf_counter() - start - began
            report["elapsed_s"] = time.perf_counter() - start
            write(report, out)
    for part, what, value in summary_rows(report):
        print(f"{part:<18} {what:<75} {value}")
    print(f"[gpu-check] wrote {out / JSON_NAME}, {out / PNG_NAME}, {out / MD_NAME} in {report['elapsed_s']:.0f} s")
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="runs/gpu_check")
    parser.add_argument("--tiny", action="store_true", help="A tiny transformer on the CPU: checks the script.")
    parser.add_argument("--parts", nargs="+", default=[p.name for p in PARTS], choices=[p.name for p in PARTS])
    parser.add_argument("--resolution", type=int, default=None, help="Pixels (512; 32 with --tiny).")
    parser.add_argument("--max_sequence_length", type=int, default=None, help="Text tokens (512; 8 with --tiny).")
    parser.add_argument("--repeats", type=int, default=None, help="Timed repeats after a warm-up (2; 1 with --tiny).")
    parser.add_argument("--cadence_blocks", type=int, nargs=2, default=list(CADENCE_BLOCKS),
                        help="Double- and single-stream blocks of the cadence parts' transformer.")  # fmt: skip
    parser.add_argument("--time_limit_s", type=float, default=TIME_LIMIT_S, help="No part starts past its budget.")
    parser.add_argument("--render_docs", nargs=2, metavar=("REPORT", "DOCS"),
                        help="Write REPORT's section into DOCS between its gpu-check markers, and stop.")  # fmt: skip
    ns = parser.parse_args(argv)
    if ns.render_docs:
        report_path, docs = ns.render_docs
        fill_docs(markdown(json.loads(Path(report_path).read_text())), docs)
        return None
    if not ns.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: the GPU check needs one (--tiny runs it on the CPU).")
    for key, (full, tiny) in {"resolution": (512, 32), "max_sequence_length": (512, 8), "repeats": (2, 1)}.items():
        if getattr(ns, key) is None:
            setattr(ns, key, tiny if ns.tiny else full)
    if ns.resolution % 16:
        parser.error(f"--resolution must be a multiple of 16, got {ns.resolution}.")
    return run(ns, argv)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
