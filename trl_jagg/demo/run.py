"""The embedded CPU demo: GRPO + JAGG teaches a tiny Flux-architecture model to read colour words, in minutes.

The shipped pipeline (``trl_jagg/demo/assets/demo_flux``, made by ``trl_jagg/demo/pretrain.py``) was pretrained on
images of one shape in a random colour with captions that never name the colour: it draws the shape it is asked
for, in a random colour. The demo fine-tunes it with :class:`~trl_jagg.DDPOJaggTrainer` on prompts such as
"a red circle" and the ``prompt_color`` reward (mean over pixels of the named channel minus the largest other one),
so the reward rises only if the model learns to read the colour word. Measured (seed 0, 100 steps, one CPU thread):
reward -0.10 -> +0.19 and images in the named colour 28% -> 88% (chance 33%), in ~45 s of training.

    trl-jagg demo --output_dir runs/demo [--compare]

It writes to ``output_dir``: ``metrics.jsonl`` (the trainer's log history, one JSON object a line;
``metrics_exact.jsonl`` too with ``--compare``), ``reward_curve.png``, ``before_after.png``, the LoRA in the diffusers
format (``lora/``; ``lora_exact/`` with ``--compare``) and ``summary.json``, whose ``update_speedup_vs_exact`` is the
update stage of JAGG (with the on-policy velocity cache) against exact backward, timed in interleaved pairs on one
rollout after training. Everything runs offline; the default run takes about 1 minute on a 2-core CPU, ``--compare``
about 2. ``trl-jagg bench quality`` (:mod:`trl_jagg.benchmarks.quality`) trains it with exact updates, JAGG + cache and
the mixed ODE-SDE rollouts (MixGRPO's sliding window, ``jagg-fast-flux``'s held one) for several seeds and compares
their rewards, on the colour task or a fine-detail one.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

DEMO_ASSET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "demo_flux")
"""The shipped demo pipeline (``FluxPipeline.from_pretrained`` reads it like a Hub repository)."""
DEMO_COLORS: tuple[str, ...] = ("red", "green", "blue")
DEMO_SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DEMO_IMAGE_SIZE = 32
DEMO_MAX_SEQUENCE_LENGTH = 16
"""Prompt length in tokens the demo model was pretrained with (T5 pads every prompt to it)."""
DEMO_GUIDANCE_SCALE = 3.5
"""Embedded guidance value (FLUX.1-dev style) the demo model was pretrained with."""
DEMO_NUM_INFERENCE_STEPS = 9
"""Denoising steps of rollouts and sample images (the first 4 are stochastic and trained, see :func:`demo_config`)."""
DEFAULT_STEPS = 100
NUM_GENERATIONS = 8
"""GRPO group size G: images per prompt per step."""
LORA_RANK = 16
LORA_TARGET_MODULES: tuple[str, ...] = ("add_k_proj", "add_v_proj", "text_embedder.linear_1", "text_embedder.linear_2")
"""The LoRA changes only how the model reads the prompt: the text tokens' keys and values in the joint attention,
and the pooled-text embedder whose output modulates every block. How it draws is left alone, so the shapes survive
(adapting the image-side projections too learns the colour as well but turns the shapes into colour blobs)."""
EVAL_SEEDS = (0, 1)


def demo_prompts() -> list[str]:
    """Every colour x shape prompt, e.g. "a red circle"."""
    return [f"a {color} {shape}" for shape in DEMO_SHAPES for color in DEMO_COLORS]


# ------------------------------------------------------------------------------------------------ diagnostics
def _dominant_color(image: Any) -> str:
    """The palette colour whose channel is largest over most of the image's bright pixels ("none" if none)."""
    import numpy as np

    pixels = np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0
    foreground = pixels.max(axis=-1) > 90 / 255
    if foreground.sum() < 8:
        return "none"
    return DEMO_COLORS[int(np.bincount(pixels[foreground].argmax(axis=-1), minlength=3).argmax())]


def color_accuracy(prompts: Sequence[str], images: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when the image's dominant colour is the one its prompt names, else 0.0 (chance: 1/3).

    A diagnostic, trained with weight 0: the trainer logs its mean as ``rewards/color_accuracy/mean``.
    """
    from trl_jagg.rewards.programmatic import named_color

    return [float(_dominant_color(image) == named_color(prompt)) for prompt, image in zip(prompts, images)]


def shape_area(prompts: Sequence[str], images: Sequence[Any], **kwargs: Any) -> list[float]:
    """Fraction of the image's pixels that are bright (the shape), 0-1. A diagnostic, trained with weight 0.

    The prompt-colour reward grows with the area of the named colour, so a policy that has learned the colour keeps
    gaining by drawing bigger shapes (and, past the data's sizes, blobs): watch ``rewards/shape_area/mean``.
    """
    import numpy as np

    return [float((np.asarray(image.convert("RGB")).max(axis=-1) > 90).mean()) for image in images]


class GroupRewardStd:
    """Diagnostic "reward" (weight 0): every image gets the std of the trained reward (``prompt_color`` unless
    ``reward`` names another) within its GRPO group.

    Its logged mean, ``rewards/group_reward_std/mean``, is the mean per-group reward std: when it collapses towards 0
    the advantages are noise (a sign of reward gaming or of a saturated policy). Groups are the runs of
    ``num_generations`` consecutive images of a rollout, as the trainer lays them out.
    """

    __name__ = "group_reward_std"

    def __init__(self, num_generations: int, reward: str = "prompt_color"):
        from trl_jagg.rewards import load_reward_funcs

        self.num_generations = num_generations
        self.reward = load_reward_funcs(reward)[0]

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **kwargs: Any) -> list[float]:
        import numpy as np

        scores = np.asarray(self.reward(prompts=prompts, images=images), dtype=np.float64)
        if len(scores) % self.num_generations:
            return [float(scores.std(ddof=1))] * len(scores)
        stds = scores.reshape(-1, self.num_generations).std(axis=1, ddof=1)
        return np.repeat(stds, self.num_generations).tolist()


# ------------------------------------------------------------------------------------------------ training
def _progress_callback() -> Any:
    """The Trainer's tqdm bar, printing one short line per step instead of the whole metrics dict."""
    from transformers.trainer_callback import ProgressCallback

    class DemoProgress(ProgressCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if not state.is_world_process_zero or self.training_bar is None or not logs or "reward" not in logs:
                return
            self.training_bar.write(
                f"step {state.global_step:3d}  reward {logs['reward']:+.3f}  "
                f"colour accuracy {logs.get('rewards/color_accuracy/mean', float('nan')):.2f}  "
                f"group std {logs.get('rewards/group_reward_std/mean', float('nan')):.3f}  "
                f"latent std {logs.get('engine/latents/final_std', float('nan')):.2f}  "
                f"area {logs.get('rewards/shape_area/mean', float('nan')):.2f}  "
                f"rollout {logs.get('time/rollout_s', 0.0):.1f}s  update {logs.get('time/update_s', 0.0):.1f}s"
            )

    return DemoProgress


def demo_config(output_dir: str, *, steps: int, seed: int, use_jagg: bool = True, **overrides: Any) -> Any:
    """The demo's :class:`~trl_jagg.GRPOJaggConfig`.

    Every step samples all nine prompts 8 times (72 images; every colour in every batch, so prompt-independent
    pushes cancel) with 9 denoising steps. Stochastic SDE steps only in the first 4 (the high-noise steps where the
    colour is decided; Flow-GRPO-Fast's window), which are the trained steps: one JAGG group of W = 4 (one joint
    backward instead of four). The KL to the base model (``beta``) holds back reward gaming: with a weaker one (0.04)
    the shapes swell into blobs that cover more pixels of the named colour.
    """
    from trl_jagg import GRPOJaggConfig

    config: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=len(demo_prompts()) * NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        num_inference_steps=DEMO_NUM_INFERENCE_STEPS,
        height=DEMO_IMAGE_SIZE,
        width=DEMO_IMAGE_SIZE,
        guidance_scale=DEMO_GUIDANCE_SCALE,
        max_sequence_length=DEMO_MAX_SEQUENCE_LENGTH,
        sampler="sde",
        noise_level=0.7,
        train_timesteps="sde_window",
        sde_window_size=4,
        sde_window_schedule="fixed",
        sde_window_max_start=0,
        beta=0.15,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        use_jagg=use_jagg,
        jagg_group_size=4,
        jagg_frac=1.0,
        reward_weights=[1.0, 0.0, 0.0, 0.0],  # prompt_color; the three diagnostics are logged, not trained on
        seed=seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,  # a CPU demo, also on a machine with a GPU: the measured numbers and timings apply
    )
    config.update(overrides)
    return GRPOJaggConfig(**config)


def demo_lora_config() -> Any:
    """The demo's :class:`~peft.LoraConfig`: rank 16 (alpha 16) on :data:`LORA_TARGET_MODULES`."""
    from peft import LoraConfig

    return LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights="gaussian", target_modules=list(LORA_TARGET_MODULES)
    )


def demo_trainer(
    model: str, run_dir: str, *, steps: int, seed: int, use_jagg: bool = True, eval_dataset: Any = None,
    reward: str = "prompt_color", **overrides: Any,
) -> Any:  # fmt: skip
    """The demo's :class:`~trl_jagg.DDPOJaggTrainer` on :func:`demo_prompts`: :func:`demo_config` (with
    ``overrides``), :func:`demo_lora_config` initialised from ``seed``, the registered ``reward`` it trains on
    (``prompt_color``; ``trl-jagg bench quality --task detail`` trains ``high_frequency``) and the three
    diagnostics, and a one-line progress print per step."""
    import torch
    from datasets import Dataset
    from transformers.trainer_callback import ProgressCallback

    from trl_jagg import DDPOJaggTrainer

    torch.manual_seed(seed)  # the LoRA's random init
    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=[reward, color_accuracy, shape_area, GroupRewardStd(NUM_GENERATIONS, reward)],
        args=demo_config(run_dir, steps=steps, seed=seed, use_jagg=use_jagg, **overrides),
        train_dataset=Dataset.from_dict({"prompt": demo_prompts()}),
        eval_dataset=eval_dataset,
        peft_config=demo_lora_config(),
    )
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_progress_callback())
    return trainer


def _train(
    model: str, run_dir: str, *, steps: int, seed: int, use_jagg: bool, eval_prompts: list[str], **overrides: Any
) -> tuple[Any, list[list[Any]], list[list[Any]], float]:
    """Fine-tune one LoRA on the demo model; returns the trainer, the eval images before and after (one list per
    eval seed) and the seconds ``trainer.train()`` took."""
    trainer = demo_trainer(model, run_dir, steps=steps, seed=seed, use_jagg=use_jagg, **overrides)
    before = [trainer.sample_images(eval_prompts, seed=s) for s in EVAL_SEEDS]
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = [trainer.sample_images(eval_prompts, seed=s) for s in EVAL_SEEDS]
    trainer.save_model()
    return trainer, before, after, seconds


def interleaved_update_speedup(trainer: Any, repeats: int) -> dict[str, Any]:
    """The demo's update-stage speedup of JAGG (with the velocity cache, as trained) over exact backward, timed the
    way a ratio is meaningful on a busy machine: one fresh rollout, then both updates on it in alternating order
    (one warm-up pair, then ``repeats`` pairs); per-pair ratios, median/min/max."""
    from trl_jagg.benchmarks.trainer import time_update

    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    args = trainer.args
    exact, jagg = [], []
    for repeat in range(repeats + 1):
        order = ("exact", "jagg") if repeat % 2 == 0 else ("jagg", "exact")
        for name in order:
            if name == "exact":
                seconds = time_update(trainer, rollout, "exact_batched")
            else:
                seconds = time_update(trainer, rollout, "jagg_cache", args.jagg_group_size, args.jagg_frac)
            if repeat > 0:
                (exact if name == "exact" else jagg).append(seconds)
    trainer.model.zero_grad(set_to_none=True)
    ratios = [e / j for e, j in zip(exact, jagg)]
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "repeats": repeats,
        "update_exact_s": statistics.median(exact),
        "update_jagg_s": statistics.median(jagg),
        "timer": "process CPU time",  # the demo runs on the CPU; see trainer_benchmark.benchmark_clock
    }


def step_logs(log_history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step entries of a trainer's ``log_history`` (those with a reward), in step order."""
    return sorted((e for e in log_history if "reward" in e), key=lambda e: e["step"])


def summarize(log_history: Sequence[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """First/last reward, the rise, and the time split of one run."""
    logs = step_logs(log_history)
    rewards = [e["reward"] for e in logs]
    accuracy = [e.get("rewards/color_accuracy/mean", float("nan")) for e in logs]
    head, tail = rewards[: min(2, len(rewards))], rewards[-min(2, len(rewards)) :]
    return {
        "steps": len(logs),
        "reward_first": rewards[0],
        "reward_last": rewards[-1],
        "reward_rise": rewards[-1] - rewards[0],
        "reward_first2_mean": sum(head) / len(head),
        "reward_last2_mean": sum(tail) / len(tail),
        "reward_rise_mean2": sum(tail) / len(tail) - sum(head) / len(head),
        "color_accuracy_first": accuracy[0],
        "color_accuracy_last": accuracy[-1],
        "latent_std_first": logs[0].get("engine/latents/final_std"),
        "latent_std_last": logs[-1].get("engine/latents/final_std"),
        "shape_area_first": logs[0].get("rewards/shape_area/mean"),
        "shape_area_last": logs[-1].get("rewards/shape_area/mean"),
        "group_reward_std_first": logs[0].get("rewards/group_reward_std/mean"),
        "group_reward_std_last": logs[-1].get("rewards/group_reward_std/mean"),
        "train_seconds": seconds,
        "rollout_seconds": sum(e.get("time/rollout_s", 0.0) for e in logs),
        "update_seconds": sum(e.get("time/update_s", 0.0) for e in logs),
        "backward_calls_per_step": logs[0].get("engine/jagg/backward_calls"),
    }


# ------------------------------------------------------------------------------------------------ figures
def plot_reward_curves(runs: dict[str, list[dict[str, Any]]], path: str) -> str:
    """Four panels: the reward per step of each run, the share of images in the named colour, the reward-gaming
    watch (final latent std, shape area, per-group reward std) and each run's rollout / update seconds per step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = {"JAGG": "tab:orange", "exact": "tab:blue"}
    figure = Figure(figsize=(11, 7), dpi=100)
    FigureCanvasAgg(figure)
    (reward_ax, accuracy_ax), (watch_ax, time_ax) = figure.subplots(2, 2)
    watched = {
        "engine/latents/final_std": ("latent std", "-"),
        "rewards/shape_area/mean": ("shape area", "--"),
        "rewards/group_reward_std/mean": ("group reward std", ":"),
    }
    for name, logs in runs.items():
        steps = [e["step"] for e in logs]
        color = colors.get(name)
        reward_ax.plot(steps, [e["reward"] for e in logs], ".-", color=color, label=name)
        accuracy_ax.plot(steps, [e.get("rewards/color_accuracy/mean", math.nan) for e in logs], ".-", color=color)
        for key, (label, style) in watched.items():
            values = [e.get(key, math.nan) for e in logs]
            watch_ax.plot(steps, values, style, color=color, label=f"{label} ({name})")
    reward_ax.axhline(0.0, color="gray", lw=0.8, ls=":")
    reward_ax.set(xlabel="optimizer step", ylabel="mean reward", title="prompt_color reward: target - max(others)")
    reward_ax.legend(loc="upper left")
    accuracy_ax.axhline(1 / 3, color="gray", lw=0.8, ls=":", label="chance")
    accuracy_ax.set(xlabel="optimizer step", ylabel="fraction", title="Images in the named colour", ylim=(0, 1.02))
    accuracy_ax.legend(loc="upper left")
    watch_ax.set(xlabel="optimizer step", title="Reward-gaming watch", yscale="log")
    watch_ax.legend(fontsize=7, loc="upper left", ncol=len(runs))
    names = list(runs)
    rollout = [sum(e.get("time/rollout_s", 0.0) for e in runs[n]) / len(runs[n]) for n in names]
    update = [sum(e.get("time/update_s", 0.0) for e in runs[n]) / len(runs[n]) for n in names]
    time_ax.bar(names, rollout, color="lightgray", label="rollout (sampling + reward)")
    time_ax.bar(names, update, bottom=rollout, color=[colors.get(n, "tab:green") for n in names], label="update")
    for i, (r, u) in enumerate(zip(rollout, update)):
        time_ax.text(i, r + u / 2, f"update {u:.2f} s", ha="center", va="center", fontsize=9)
    time_ax.set(ylabel="seconds per step (mean)", title="Time per step")
    time_ax.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    return path


def before_after_grid(
    prompts: Sequence[str], rows: Sequence[tuple[str, Sequence[Any]]], path: str, scale: int = 3
) -> str:
    """A labelled grid: one column per prompt, one row per (label, images) entry; pixels enlarged ``scale`` times."""
    from PIL import Image, ImageDraw

    size = rows[0][1][0].width * scale
    label_w, header_h = 110, 28
    grid = Image.new("RGB", (label_w + size * len(prompts), header_h + size * len(rows)), "white")
    draw = ImageDraw.Draw(grid)
    for j, prompt in enumerate(prompts):
        words = prompt.removeprefix("a ").split()
        for line, text in enumerate((" ".join(words[:1]), " ".join(words[1:]))):
            draw.text((label_w + j * size + 4, 2 + 12 * line), text, fill="black")
    for i, (label, images) in enumerate(rows):
        y = header_h + i * size
        for line, text in enumerate(label.split("\n")):
            draw.text((4, y + size // 2 - 12 + 12 * line), text, fill="black")
        for j, image in enumerate(images):
            grid.paste(image.convert("RGB").resize((size, size), Image.Resampling.NEAREST), (label_w + j * size, y))
    grid.save(path)
    return path


# ------------------------------------------------------------------------------------------------ entry point
def run_demo(
    output_dir: str = "runs/demo",
    compare: bool = False,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    model: str = DEMO_ASSET_DIR,
    threads: int = 1,
    timing_repeats: int = 5,
) -> dict[str, Any]:
    """Fine-tune the shipped tiny Flux model with GRPO + JAGG on CPU and show that the reward rises.

    Args:
        output_dir: where the metrics, plots, LoRA weights and summary are written.
        compare: also train with exact per-step gradients (``use_jagg=False``, same seed) and plot both runs.
        steps: optimizer steps per run (each: 72 sampled images, then one update).
        seed: seed of the LoRA initialisation, the rollouts and the sample images.
        model: the pipeline to fine-tune, a local directory or a Hub id; the shipped demo model by default.
        threads: torch CPU threads while the demo runs (1 is fastest for these tiny kernels on a small machine).
        timing_repeats: after training, exact and JAGG updates timed in alternating pairs on one rollout (after a
            warm-up pair) for the summary's ``update_speedup_vs_exact``; 0 skips the measurement.

    Returns:
        The summary, also written to ``summary.json``.
    """
    import torch

    if steps < 1:
        raise ValueError(f"`steps` must be >= 1, got {steps}.")
    if timing_repeats < 0:
        raise ValueError(f"`timing_repeats` must be >= 0, got {timing_repeats}.")
    os.makedirs(output_dir, exist_ok=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        eval_prompts = demo_prompts()
        runs: dict[str, dict[str, Any]] = {}
        for name in ("JAGG", "exact") if compare else ("JAGG",):
            print(f"[demo] {name} run: {steps} GRPO steps on {model}", flush=True)
            suffix = "" if name == "JAGG" else "_exact"
            trainer, before, after, seconds = _train(
                model, os.path.join(output_dir, f"lora{suffix}"), steps=steps, seed=seed, use_jagg=name == "JAGG",
                eval_prompts=eval_prompts,
            )  # fmt: skip
            history = list(trainer.state.log_history)
            metrics_path = os.path.join(output_dir, f"metrics{suffix}.jsonl")
            with open(metrics_path, "w") as f:
                for entry in history:
                    f.write(json.dumps(entry) + "\n")
            runs[name] = {
                "logs": step_logs(history),
                "summary": summarize(history, seconds) | {"metrics": metrics_path, "lora": trainer.args.output_dir},
                "before": before,
                "after": after,
            }
            if name == "JAGG" and timing_repeats:
                print(f"[demo] timing exact vs JAGG updates ({timing_repeats} interleaved pairs)", flush=True)
                runs[name]["speedup"] = interleaved_update_speedup(trainer, timing_repeats)
            del trainer

        curve = plot_reward_curves(
            {n: r["logs"] for n, r in runs.items()}, os.path.join(output_dir, "reward_curve.png")
        )
        rows = [(f"before\nseed {s}", images) for s, images in zip(EVAL_SEEDS, runs["JAGG"]["before"])]
        for name, run in runs.items():
            rows += [(f"after {name}\nseed {s}", images) for s, images in zip(EVAL_SEEDS, run["after"])]
        grid = before_after_grid(eval_prompts, rows, os.path.join(output_dir, "before_after.png"))

        jagg = runs["JAGG"]["summary"]
        summary: dict[str, Any] = {"model": model, "seed": seed, **jagg}
        if "speedup" in runs["JAGG"]:
            summary["update_speedup_vs_exact"] = runs["JAGG"]["speedup"]
        if compare:
            summary["exact"] = runs["exact"]["summary"]
        summary["total_seconds"] = time.perf_counter() - start
        summary["files"] = {
            "metrics": jagg["metrics"],
            **({"metrics_exact": runs["exact"]["summary"]["metrics"]} if compare else {}),
            "reward_curve": curve,
            "before_after": grid,
            "lora": jagg["lora"],
            "summary": os.path.join(output_dir, "summary.json"),
        }
        with open(summary["files"]["summary"], "w") as f:
            json.dump(summary, f, indent=2)
    finally:
        torch.set_num_threads(previous_threads)

    _print_summary(summary, compare)
    return summary


def _print_summary(summary: dict[str, Any], compare: bool) -> None:
    def line(name: str, s: dict[str, Any]) -> str:
        return (
            f"{name}: reward {s['reward_first']:.2f} -> {s['reward_last']:.2f} ({s['reward_rise']:+.2f}) in "
            f"{s['train_seconds']:.0f} s; images in the named colour {s['color_accuracy_first']:.0%} -> "
            f"{s['color_accuracy_last']:.0%}; update stage {s['update_seconds']:.1f} s"
        )

    print()
    for key, path in summary["files"].items():
        print(f"[demo] {key:<13} {path}")
    lora = summary["files"]["lora"]
    print(
        f"[demo] load it:      pipe = FluxPipeline.from_pretrained({summary['model']!r}); pipe.load_lora_weights({lora!r})"
    )
    print(f"[demo] {line('JAGG', summary)}")
    if compare:
        print(f"[demo] {line('exact', summary['exact'])}")
    if "update_speedup_vs_exact" in summary:
        speedup = summary["update_speedup_vs_exact"]
        print(
            f"[demo] update stage: exact / JAGG = {speedup['median']:.2f}x (median of {speedup['repeats']} "
            f"interleaved pairs on one rollout, min {speedup['min']:.2f}x, max {speedup['max']:.2f}x)"
        )
