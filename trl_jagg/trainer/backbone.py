"""Preparing the backbone for training: every pipeline module frozen, LoRA (checked targets) or full fine-tuning,
the frozen reference copy for the KL term, a config the tracker callbacks can read."""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from diffusers.configuration_utils import FrozenDict
from diffusers.training_utils import cast_training_params
from peft import LoraConfig
from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.config.objective_registry import get_objective
from trl_jagg.models import FlowMatchingAdapter


class TrackableConfig(FrozenDict):
    """A diffusers config that also answers the transformers config API the tracker callbacks call
    (``model.config.to_json_string()`` / ``.to_dict()``)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)


def use_peft_shorthand(peft_config: LoraConfig) -> None:
    """A list holding only ``"all-linear"`` (a YAML or ``--lora_target_modules all-linear`` value, TRL's idiom) becomes
    peft's own string form, in place: peft then targets every linear layer of the backbone (on a diffusers model, not
    a transformers one, it keeps them all, output projection included), instead of a module named 'all-linear'."""
    targets = peft_config.target_modules
    if isinstance(targets, (list, set, tuple)) and len(targets) == 1:
        (only,) = targets
        if str(only).lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND:
            peft_config.target_modules = INCLUDE_LINEAR_LAYERS_SHORTHAND


def check_lora_targets(transformer: torch.nn.Module, peft_config: LoraConfig) -> None:
    """Every name in a list of LoRA ``target_modules`` matches a module (peft only refuses a list matching none)."""
    targets = peft_config.target_modules
    if not isinstance(targets, (list, set, tuple)):
        return  # a regex or "all-linear": peft's own matching
    names = [name for name, _ in transformer.named_modules()]
    unmatched = sorted(t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names))
    if unmatched:
        linear = sorted({n.split(".")[-1] for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)})
        close = {t: difflib.get_close_matches(t, linear, n=1) for t in unmatched}
        hints = "; ".join(f"{t!r}: did you mean {c[0]!r}?" for t, c in close.items() if c)
        raise ValueError(
            f"LoraConfig.target_modules {unmatched} match no module of {type(transformer).__name__}"
            f"{' (' + hints + ')' if hints else ''}. Its linear layers are named {linear[:24]}."
        )


def prepare_backbone(
    adapter: FlowMatchingAdapter, args: GRPOJaggConfig, peft_config: LoraConfig | None
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """Freeze the pipeline, make the backbone trainable (LoRA or all of it) and return it with the frozen reference
    copy of full fine-tuning with ``beta > 0`` (``None`` otherwise: LoRA's reference is the base weights). Only the
    adapter's :meth:`~trl_jagg.models.base.FlowMatchingAdapter.trained_parts` get LoRA or trainable weights (Wan2.2
    training one expert: the other keeps none)."""
    pipeline = adapter.pipeline
    pipeline.set_progress_bar_config(disable=True)
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            component.requires_grad_(False).eval()
    transformer = adapter.transformer
    parts = adapter.trained_parts(transformer)
    config_owner = adapter.config_module(transformer)
    config_owner._internal_dict = TrackableConfig(config_owner._internal_dict)
    if peft_config is not None:
        use_peft_shorthand(peft_config)
    for part in parts.values():
        if peft_config is not None:
            check_lora_targets(part, peft_config)
            part.add_adapter(peft_config)
            # Trainable LoRA weights live in float32 even when the backbone runs in bf16.
            cast_training_params(part, dtype=torch.float32)
        else:
            part.requires_grad_(True)
    ref_transformer = None
    # The KL reference, or a loss that reads the base model (DGPO's): a frozen copy, LoRA disabling its adapters.
    if (args.beta > 0 or get_objective(args.objective).needs_reference) and peft_config is None:
        ref_transformer = copy.deepcopy(transformer).requires_grad_(False).eval()
    if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
        # transformers' own switch calls a transformers-only method; diffusers has its own.
        every = (args.activation_checkpointing_kwargs or {}).get("every_n_layers", 1)
        for part in parts.values():
            part.enable_gradient_checkpointing(every_nth_block_checkpointed(part, every) if every > 1 else None)
        args.gradient_checkpointing = args.activation_checkpointing = False
    if args.compile_repeated_blocks:
        for backbone in (transformer, ref_transformer):
            if backbone is not None:
                compile_blocks(backbone, backend=args.compile_backend)
    return transformer, ref_transformer


def repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The backbone's repeated transformer blocks in module order: the classes of its ``_repeated_blocks`` or, where
    it declares none (SD3), of its ``_no_split_modules``."""
    names = set(
        getattr(transformer, "_repeated_blocks", None) or getattr(transformer, "_no_split_modules", None) or ()
    )
    return [module for module in transformer.modules() if type(module).__name__ in names]


def every_nth_block_checkpointed(transformer: torch.nn.Module, every: int) -> Callable[..., Any]:
    """A ``gradient_checkpointing_func`` for diffusers' ``enable_gradient_checkpointing`` that checkpoints blocks 0,
    ``every``, ``2 every``, ... of :func:`repeated_blocks` (``activation_checkpointing_kwargs={"every_n_layers":
    every}``, as transformers counts layers) and runs the others as usual, keeping their activations: a backward
    then recomputes about ``1 / every`` of the blocks' forward instead of all of it."""
    blocks = repeated_blocks(transformer)
    if not blocks:
        raise ValueError(
            f"GRPOJaggConfig.activation_checkpointing_kwargs: {type(transformer).__name__} declares no repeated blocks "
            "to choose every n-th of. Remove `every_n_layers` to checkpoint every block."
        )
    checkpointed = {id(block) for block in blocks[::every]}

    def checkpoint_or_run(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if id(module) in checkpointed:
            # As diffusers' default checkpointing function.
            return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, **kwargs)
        return module(*args, **kwargs)

    return checkpoint_or_run


def compile_blocks(transformer: torch.nn.Module, **compile_kwargs: Any) -> None:
    """Regional compilation of ``transformer`` in place: ``torch.compile(**compile_kwargs)`` of each repeated block,
    through diffusers' ``compile_repeated_blocks``; a backbone without ``_repeated_blocks`` (SD3) compiles its
    transformer blocks, the ``_no_split_modules`` classes. LoRA layers must be added before."""
    if getattr(transformer, "_repeated_blocks", None):
        transformer.compile_repeated_blocks(**compile_kwargs)
        return
    blocks = repeated_blocks(transformer)
    if not blocks:
        raise ValueError(
            f"GRPOJaggConfig.compile_repeated_blocks: {type(transformer).__name__} declares no repeated blocks "
            "(`_repeated_blocks` and `_no_split_modules` are empty). Set it to False."
        )
    for block in blocks:
        block.compile(**compile_kwargs)


def has_active_dropout(module: torch.nn.Module) -> bool:
    """Dropout active in training mode makes a recomputed velocity differ from the rollout's (eval mode)."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules())
