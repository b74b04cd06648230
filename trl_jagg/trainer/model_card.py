"""Model cards of trained weights, written with every save: the Hub metadata (base model, license, tags, widget), a
usage snippet with the sampling settings used in training, the recipe and JAGG settings.

The card is built with ``huggingface_hub.ModelCard`` / ``ModelCardData`` and diffusers' ``populate_model_card``.
diffusers' ``load_or_create_model_card`` does not fit here: it returns an existing card unchanged (a card rewritten
at every save would go stale) and reads it from the Hub.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from diffusers.utils.hub_utils import populate_model_card
from huggingface_hub import ModelCard, ModelCardData

from trl_jagg.config.objective_registry import get_objective
from trl_jagg.trainer.files import EMA_DIR, LORA_WEIGHTS_NAME

JAGG_CITATION = """@article{jagg2026,
  title   = {JAGG: Jacobian-Aggregated Group Gradient for Efficient GRPO Training of Diffusion Models},
  journal = {arXiv preprint arXiv:2607.17572},
  year    = {2026}
}"""

TRL_CITATION = """@software{vonwerra2020trl,
  title   = {TRL: Transformers Reinforcement Learning},
  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and
             Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},
  license = {Apache-2.0},
  url     = {https://github.com/huggingface/trl},
  year    = {2020}
}"""

REPOSITORY_URL = "https://github.com/huggingface/trl-jagg"
"""trl_jagg's repository (pyproject.toml's ``Repository`` URL), linked from every card."""

FRAMEWORKS = {
    "trl_jagg": "trl-jagg",
    "TRL": "trl",
    "Diffusers": "diffusers",
    "Transformers": "transformers",
    "PEFT": "peft",
    "Accelerate": "accelerate",
    "PyTorch": "torch",
    "Datasets": "datasets",
}
"""The "Framework versions" of a card (as TRL's cards list theirs): display name -> distribution name."""

TRAINING_TAGS = ("diffusers-training",)
"""Tags of every card besides the trainer's: diffusers' training scripts tag their cards ``diffusers-training``
(and LoRA cards ``template:sd-lora``, the Hub's LoRA page with the widget)."""

FAMILY_TAGS: dict[str, tuple[str, ...]] = {
    "FluxPipeline": ("flux", "flux-diffusers"),
    "FluxKontextPipeline": ("flux", "flux-kontext", "flux-diffusers"),
    "Flux2Pipeline": ("flux2", "flux2-diffusers"),
    "Flux2KleinPipeline": ("flux2", "flux2-klein", "flux2-diffusers"),
    "StableDiffusion3Pipeline": ("sd3", "sd3-diffusers"),
    "QwenImagePipeline": ("qwen-image",),
    "QwenImageEditPipeline": ("qwen-image", "qwen-image-edit"),
    "QwenImageEditPlusPipeline": ("qwen-image", "qwen-image-edit"),
    "ZImagePipeline": ("z-image",),
    "WanPipeline": ("wan", "wan-diffusers"),
}
"""Hub tags of each pipeline family (as diffusers' training scripts tag them)."""

KNOWN_LICENSES: dict[str, dict[str, str]] = {
    "black-forest-labs/FLUX.1-dev": {
        "license": "other",
        "license_name": "flux-1-dev-non-commercial-license",
        "license_link": "https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/LICENSE.md",
    },
    "black-forest-labs/FLUX.1-schnell": {"license": "apache-2.0"},
    "stabilityai/stable-diffusion-3.5-medium": {
        "license": "other",
        "license_name": "stabilityai-ai-community",
        "license_link": "https://huggingface.co/stabilityai/stable-diffusion-3.5-medium/blob/main/LICENSE.md",
    },
    "stabilityai/stable-diffusion-3.5-large": {
        "license": "other",
        "license_name": "stabilityai-ai-community",
        "license_link": "https://huggingface.co/stabilityai/stable-diffusion-3.5-large/blob/main/LICENSE.md",
    },
    "Qwen/Qwen-Image": {"license": "apache-2.0"},
}
"""Licenses of the base models of the presets, as their model cards state them (a derivative inherits them)."""

_TEMPLATE = """
# {model_name}

{summary}

## How to use

```python
{usage}
```

{sampling_note}{ema_note}

## Training

Trained with [trl_jagg]({repository}): {training_summary}

| setting | value |
|---|---|
{settings}

Rewards: {rewards}.

### Framework versions

{versions}

## Citations

Cite JAGG as:

```bibtex
{jagg_citation}
```

Cite {objective_name} as:

```bibtex
{objective_citation}
```

Cite TRL as:

```bibtex
{trl_citation}
```
"""


def framework_versions() -> str:
    """The card's "Framework versions" list: the installed version of each of :data:`FRAMEWORKS`."""
    lines = []
    for name, distribution in FRAMEWORKS.items():
        try:
            lines.append(f"- {name}: {importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:  # a source checkout of trl_jagg that was never installed
            continue
    return "\n".join(lines)


def as_hub_id(name_or_path: str | None) -> str | None:
    """The Hub id ``name_or_path`` stands for: itself when it is not a local path, the repository of a Hub cache
    snapshot (``.../models--org--name/snapshots/<sha>``), else ``None`` (a local pipeline has no Hub page)."""
    if not name_or_path:
        return None
    if not os.path.exists(name_or_path):
        return name_or_path
    match = re.search(r"models--([^/\\]+)--([^/\\]+)[/\\]snapshots", os.path.abspath(name_or_path))
    return f"{match.group(1)}/{match.group(2)}" if match else None


@functools.cache
def base_model_license(repo_id: str | None) -> dict[str, str]:
    """``license`` (and ``license_name`` / ``license_link`` for ``other``) of a base model: the known presets', else
    the base model's own card when the Hub is reachable, else nothing."""
    if repo_id is None:
        return {}
    if repo_id in KNOWN_LICENSES:
        return dict(KNOWN_LICENSES[repo_id])
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return {}
    try:
        data = ModelCard.load(repo_id).data
    except Exception:  # no card, no network, gated: the card then names no license rather than a wrong one
        return {}
    return {key: getattr(data, key) for key in ("license", "license_name", "license_link") if getattr(data, key, None)}


def sampling_kwargs(args: Any, guidance_is_cfg: bool, embedded_guidance: bool) -> dict[str, Any]:
    """The pipeline-call arguments that reproduce the training-time sampling of ``args`` (a ``GRPOJaggConfig``).

    ``guidance_is_cfg``: the family reads ``guidance_scale`` as a CFG scale (SD3); otherwise ``true_cfg_scale`` is
    its CFG scale (Flux, Qwen-Image; Qwen-Image's pipeline defaults to 4 but runs CFG only with a negative prompt,
    so both are always written). ``embedded_guidance``: the backbone takes ``guidance_scale`` as an input
    (guidance-distilled, FLUX.1-dev).
    """
    kwargs: dict[str, Any] = {
        "num_inference_steps": args.num_inference_steps,
        "height": args.height,
        "width": args.width,
    }
    if guidance_is_cfg:
        kwargs["guidance_scale"] = args.guidance_scale
        if args.guidance_scale > 1:
            kwargs["negative_prompt"] = args.negative_prompt
    else:
        if embedded_guidance:
            kwargs["guidance_scale"] = args.guidance_scale
        kwargs["true_cfg_scale"] = args.true_cfg_scale
        if args.true_cfg_scale > 1:
            kwargs["negative_prompt"] = args.negative_prompt
    if args.max_sequence_length:
        kwargs["max_sequence_length"] = args.max_sequence_length
    if getattr(args, "num_frames", None):  # a video model's clip length
        kwargs["num_frames"] = args.num_frames
    return kwargs


TASK_CALLS: dict[str, tuple[str, str, str]] = {
    "text-to-image": ("a photo of a red fox in the snow", "image", ".images[0]"),
    "image-to-image": ("make the fox's fur white", "image", ".images[0]"),
    "text-to-video": ("a red fox running through the snow", "video", ".frames[0]"),
}
"""The card's pipeline task (its ``pipeline_tag``) -> the snippet's prompt, the name of what the call returns and
how it is read from the pipeline's output (Wan's ``WanPipelineOutput`` holds ``frames``, one video per prompt)."""


def usage_snippet(
    *,
    base: str,
    repo: str,
    pipeline_class: str,
    transformer_class: str,
    is_lora: bool,
    dtype: str,
    scheduler_class: str | None,
    call_kwargs: dict[str, Any],
    experts: Sequence[str] = (),
    task: str = "text-to-image",
    ema: bool = False,
    local_base: bool = False,
    local_dir: str | None = None,
    device: str = "cuda",
) -> str:
    """Python that loads the trained weights into the base pipeline and samples as in training. ``experts``: the
    component folders of a two-expert backbone's trained experts (Wan2.2: ``transformer``, ``transformer_2``).
    ``task`` (a key of :data:`TASK_CALLS`): an editing model's call takes the image to edit, a video model's
    result is written as an MP4. ``ema``: load the EMA weights (the ``ema/`` folder), which render the samples;
    ``local_dir`` (the folder the run saved to) gets its own line for them, since diffusers reads a local folder's
    root weights before its ``subfolder``'s. ``local_base``: ``base`` is the directory the run loaded (no Hub id).
    ``device``: where the run trained (``"cpu"``: no ``.to(...)``)."""
    to_device = "" if device == "cpu" else f'.to("{device}")'

    def load(call: str, source: str, name: str | None, rest: str) -> list[str]:
        """``call(source, subfolder=...)`` of the weights in component ``name`` (None: the root): from the Hub
        repository, and with ``ema`` from the local folder too (the path of its ema/ folder)."""
        path = "/".join(part for part in (EMA_DIR if ema else None, name) if part)
        lines = [f'{call}("{source}"' + (f', subfolder="{path}"' if path else "") + f"{rest})"]
        if ema and local_dir:
            local = f"{local_dir.rstrip('/')}/{EMA_DIR}"
            lines.insert(
                0,
                f'# from the local folder: {call}("{local}"' + (f', subfolder="{name}"' if name else "") + f"{rest})",
            )
        return lines

    imports = (
        [pipeline_class] + ([] if is_lora else [transformer_class]) + ([scheduler_class] if scheduler_class else [])
    )
    utils = {"image-to-image": ["load_image"], "text-to-video": ["export_to_video"]}.get(task, [])
    lines = ["import torch", f"from diffusers import {', '.join(imports)}"]
    lines += [f"from diffusers.utils import {', '.join(utils)}"] if utils else []
    lines.append("")
    if local_base:
        lines.append(f"# The base was a local {pipeline_class} (no Hub id): the directory the run loaded it from.")
    if ema:
        lines += [
            f"# The EMA weights ({EMA_DIR}/), which rendered the samples; the raw trained weights are at the repository",
            f'# root (drop "{EMA_DIR}" from `subfolder`). From a local folder, diffusers reads the root weights before a',
            f"# subfolder's: load the path of its {EMA_DIR}/ folder instead, as the commented line does.",
        ]
    weight = f', weight_name="{LORA_WEIGHTS_NAME}"'
    if experts and is_lora:  # diffusers' Wan loader puts a file's `transformer.` keys into transformer_2 on request
        lines.append(f'pipe = {pipeline_class}.from_pretrained("{base}", dtype=torch.{dtype}){to_device}')
        for name in experts:
            into = ", load_into_transformer_2=True" if name == "transformer_2" else ""
            lines += load("pipe.load_lora_weights", repo, name, weight + into)
    elif experts:
        for name in experts:
            lines += load(f"{name} = {transformer_class}.from_pretrained", repo, name, f", dtype=torch.{dtype}")
        loaded = ", ".join(f"{name}={name}" for name in experts)
        lines.append(f'pipe = {pipeline_class}.from_pretrained("{base}", {loaded}, dtype=torch.{dtype}){to_device}')
    elif is_lora:
        lines.append(f'pipe = {pipeline_class}.from_pretrained("{base}", dtype=torch.{dtype}){to_device}')
        lines += load("pipe.load_lora_weights", repo, None, weight)
    else:
        lines += load(f"transformer = {transformer_class}.from_pretrained", repo, None, f", dtype=torch.{dtype}")
        lines.append(
            f'pipe = {pipeline_class}.from_pretrained("{base}", transformer=transformer, dtype=torch.{dtype}){to_device}'
        )
    if scheduler_class:
        lines.append("# The schedule used in training (it differs from the base model's):")
        lines.append(f'pipe.scheduler = {scheduler_class}.from_pretrained("{repo}", subfolder="scheduler")')
    prompt, result, read = TASK_CALLS[task]
    if task == "image-to-image":
        lines.append('source = load_image("path/to/the/image/to/edit.png")')
    lines.append(f"{result} = pipe(")
    lines.append(f'    prompt="{prompt}",')
    if task == "image-to-image":
        lines.append("    image=source,")
    lines += [f"    {key}={value!r}," for key, value in call_kwargs.items()]
    lines.append(f"){read}")
    if task == "text-to-video":
        lines.append('export_to_video(video, "fox.mp4", fps=16)  # Wan samples 16 frames per second')
    return "\n".join(lines)


def training_device(args: Any) -> str:
    """The device type the run of ``args`` trained on (``cuda``, ``cpu``, ``mps``, ...), for the snippet's line."""
    if getattr(args, "use_cpu", False):
        return "cpu"
    try:
        return args.device.type
    except Exception:  # no device set up (a card written outside a run): the pipelines' usual device
        return "cuda"


def rewards_text(reward_names: Sequence[str], reward_weights: Sequence[float] | None) -> str:
    """The card's "Rewards: ..." text: the trained rewards (with their weights when they differ), then the
    functions logged with weight 0 (diagnostics: scored, not trained on)."""
    weights = list(reward_weights) if reward_weights and len(reward_weights) == len(reward_names) else None
    if weights is None:
        return ", ".join(reward_names) or "custom"
    trained = [(name, w) for name, w in zip(reward_names, weights) if w != 0]
    logged = [name for name, w in zip(reward_names, weights) if w == 0]
    show_weights = len({w for _, w in trained}) > 1
    text = ", ".join(f"{name} (weight {w:g})" if show_weights else name for name, w in trained) or "none"
    if logged:
        text += f". Logged with weight 0 (diagnostics, not trained on): {', '.join(logged)}"
    return text


def write_model_card(
    output_dir: str,
    *,
    base_model: str | None,
    pipeline_class: str,
    transformer_class: str,
    is_lora: bool,
    args: Any,
    reward_names: Sequence[str],
    tags: Sequence[str],
    guidance_is_cfg: bool,
    embedded_guidance: bool,
    scheduler_class: str | None = None,
    samples: Sequence[tuple[str, str]] = (),
    model_name: str | None = None,
    dataset_name: str | None = None,
    hub_model_id: str | None = None,
    experts: Sequence[str] = (),
    task: str = "text-to-image",
    source_call_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Write ``README.md`` into ``output_dir`` and return its path.

    Args:
        experts: the trained experts' component folders of a two-expert backbone (see :func:`usage_snippet`).
        task: the Hub ``pipeline_tag``, a key of :data:`TASK_CALLS` (editing: ``image-to-image``, video:
            ``text-to-video``).
        source_call_kwargs: an editing model's call arguments for conditioning on the source as training did
            (the adapter's ``source_call_kwargs``).
        base_model: what the pipeline was loaded from; only a Hub id reaches the metadata (see :func:`as_hub_id`).
        scheduler_class: the scheduler's class when the weights come with a ``scheduler/`` folder that differs
            from the base model's (a recipe's override): the snippet loads it.
        samples: ``(prompt, path relative to the repository root)`` of logged sample images: the card's widget.
        guidance_is_cfg, embedded_guidance: how the family reads ``guidance_scale`` (see :func:`sampling_kwargs`).
    """
    model_name = model_name or os.path.basename(os.path.normpath(output_dir))
    base_id = as_hub_id(base_model)
    dataset_id = as_hub_id(dataset_name)  # a local prompt file is not a Hub dataset either
    family = list(FAMILY_TAGS.get(pipeline_class, ()))
    data = ModelCardData(
        base_model=base_id,
        base_model_relation=("adapter" if is_lora else "finetune") if base_id else None,
        pipeline_tag=task,
        datasets=[dataset_id] if dataset_id else None,
        widget=[{"text": prompt, "output": {"url": path}} for prompt, path in samples] or None,
        **base_model_license(base_id),
    )
    kind = "LoRA adapter" if is_lora else "fully fine-tuned transformer"
    objective = get_objective(args.objective)
    objective_name = objective.title
    training_summary = objective.card_training_summary(args.use_jagg)
    base_text = f"[{base_id}](https://huggingface.co/{base_id})" if base_id else f"a local `{pipeline_class}`"
    settings = {
        "base model": base_id or f"local {pipeline_class}",
        "method": f"{objective_name} + JAGG" if args.use_jagg else f"{objective_name} (exact per-step gradients)",
        "JAGG group size / frac / mode": f"{args.jagg_group_size} / {args.jagg_frac} / {args.jagg_mode}",
        **objective.card_rows(args),
        "steps / resolution": f"{args.num_inference_steps} / {args.height}x{args.width}",
        "images per prompt (G)": args.num_generations,
        "trained steps": args.train_timesteps,
        "learning rate": args.learning_rate,
        "KL beta / clip range": f"{args.beta} / {args.epsilon}",
    }
    call_kwargs = sampling_kwargs(args, guidance_is_cfg, embedded_guidance) | dict(source_call_kwargs or {})
    sampling_note = (
        "The call repeats the sampling settings of training (steps, resolution, guidance"
        + (" and the negative prompt" if "negative_prompt" in call_kwargs else "")
        + (", the scheduler" if scheduler_class else "")
        + (
            f"); training sampled them with the ODE (solver order {args.ode_solver_order}), as the pipeline does."
            if objective.deterministic_rollout
            else f"); training sampled them with the `{args.sampler}` SDE sampler, the pipeline samples the ODE."
        )
    )
    ema = args.ema_decay > 0
    ema_note = (
        f"\n\nThe snippet loads the EMA weights (decay {args.ema_decay}) from `{EMA_DIR}/`: they rendered the "
        "card's sample images (its widget) and the evaluations. The weights of the last optimizer step, without "
        f"averaging, are at the repository root, in the same format: drop `{EMA_DIR}` from `subfolder` to load them."
        if ema
        else ""
    )
    card = ModelCard(
        f"---\n{data.to_yaml()}\n---\n"
        + _TEMPLATE.format(
            model_name=model_name,
            summary=f"A {kind} for {base_text}, aligned with {objective_name}.",
            usage=usage_snippet(
                base=base_id or base_model or "path/to/the/base/pipeline",
                repo=hub_model_id or model_name,
                pipeline_class=pipeline_class,
                transformer_class=transformer_class,
                is_lora=is_lora,
                dtype=args.dtype,
                scheduler_class=scheduler_class,
                call_kwargs=call_kwargs,
                experts=experts,
                task=task,
                ema=ema,
                local_base=base_id is None,
                local_dir=args.output_dir,
                device=training_device(args),
            ),
            sampling_note=sampling_note,
            ema_note=ema_note,
            settings="\n".join(f"| {k} | {v} |" for k, v in settings.items()),
            rewards=rewards_text(reward_names, args.reward_weights),
            repository=REPOSITORY_URL,
            versions=framework_versions(),
            jagg_citation=JAGG_CITATION,
            training_summary=training_summary,
            objective_name=objective_name,
            objective_citation=objective.citation,
            trl_citation=TRL_CITATION,
        )
    )
    # The Hub's LoRA page template (its widget) is for text-to-image adapters, as diffusers' scripts use it.
    lora_tags = (["lora", "template:sd-lora"] if task == "text-to-image" else ["lora"]) if is_lora else []
    tags = list(dict.fromkeys([*TRAINING_TAGS, *tags, task, *objective.tags, *family, *lora_tags]))
    populate_model_card(card, tags=tags)
    path = os.path.join(output_dir, "README.md")
    os.makedirs(output_dir, exist_ok=True)
    card.save(path)
    return path
