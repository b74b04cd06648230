"""Model cards for trained checkpoints: diffusers-style, naming the base model, the recipe and JAGG."""

from __future__ import annotations

import os
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

JAGG_CITATION = """@article{jagg2026,
  title   = {JAGG: Jacobian-Aggregated Group Gradient for Efficient GRPO Training of Diffusion Models},
  journal = {arXiv preprint arXiv:2607.17572},
  year    = {2026}
}"""

_TEMPLATE = """---
{card_data}
---

# {model_name}

{summary}

## How to use

```python
{usage}
```

## Training

Trained with [trl_jagg](https://github.com/huggingface/trl-jagg): GRPO on the denoising trajectory of a flow-matching
model, with JAGG group gradients in the update stage.

| setting | value |
|---|---|
{settings}

Rewards: {rewards}.

## Citation

```bibtex
{citation}
```
"""


def _usage(base_model: str, pipeline_class: str, is_lora: bool, repo: str) -> str:
    lines = ["import torch", f"from diffusers import {pipeline_class}", ""]
    lines.append(f'pipe = {pipeline_class}.from_pretrained("{base_model}", torch_dtype=torch.bfloat16).to("cuda")')
    if is_lora:
        lines.append(f'pipe.load_lora_weights("{repo}")')
    else:
        transformer_class = {
            "FluxPipeline": "FluxTransformer2DModel",
            "StableDiffusion3Pipeline": "SD3Transformer2DModel",
        }
        cls = transformer_class.get(pipeline_class, "QwenImageTransformer2DModel")
        lines[1] = f"from diffusers import {pipeline_class}, {cls}"
        lines.insert(3, f'transformer = {cls}.from_pretrained("{repo}", torch_dtype=torch.bfloat16)')
        lines[4] = lines[4].replace(
            "torch_dtype=torch.bfloat16)", "transformer=transformer, torch_dtype=torch.bfloat16)"
        )
    lines.append('image = pipe("a photo of a red fox in the snow").images[0]')
    return "\n".join(lines)


def write_model_card(
    output_dir: str,
    *,
    base_model: str | None,
    pipeline_class: str,
    is_lora: bool,
    args: Any,
    reward_names: list[str],
    tags: list[str],
    model_name: str | None = None,
    dataset_name: str | None = None,
    hub_model_id: str | None = None,
) -> str:
    """Write ``README.md`` into ``output_dir`` and return its path."""
    model_name = model_name or os.path.basename(os.path.normpath(output_dir))
    base = base_model or "<base model>"
    data = ModelCardData(
        base_model=base_model,
        library_name="diffusers",
        pipeline_tag="text-to-image",
        tags=list(dict.fromkeys(tags)),
        datasets=[dataset_name] if dataset_name else None,
    )
    kind = "LoRA adapter" if is_lora else "fully fine-tuned transformer"
    settings = {
        "base model": base,
        "method": "GRPO + JAGG" if args.use_jagg else "GRPO (exact per-step gradients)",
        "JAGG group size / frac / mode": f"{args.jagg_group_size} / {args.jagg_frac} / {args.jagg_mode}",
        "sampler / noise level": f"{args.sampler} / {args.noise_level}",
        "steps / resolution": f"{args.num_inference_steps} / {args.height}x{args.width}",
        "images per prompt (G)": args.num_generations,
        "trained steps": args.train_timesteps,
        "learning rate": args.learning_rate,
        "KL beta / clip range": f"{args.beta} / {args.clip_range}",
    }
    card = ModelCard(
        _TEMPLATE.format(
            card_data=data.to_yaml(),
            model_name=model_name,
            summary=f"A {kind} for [{base}](https://huggingface.co/{base}), aligned with GRPO.",
            usage=_usage(base, pipeline_class, is_lora, hub_model_id or model_name),
            settings="\n".join(f"| {k} | {v} |" for k, v in settings.items()),
            rewards=", ".join(reward_names) or "custom",
            citation=JAGG_CITATION,
        )
    )
    path = os.path.join(output_dir, "README.md")
    os.makedirs(output_dir, exist_ok=True)
    card.save(path)
    return path
