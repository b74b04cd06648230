"""The backbone's conditioning of a rollout's prompts: encoded now, or looked up in a table encoded once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.models.base import Conditioning
from trl_jagg.trainer.placement import FrozenModules


def negative_prompt(adapter: FlowMatchingAdapter, args: GRPOJaggConfig) -> str | None:
    """The negative prompt to encode, when the guidance settings use an unconditional branch."""
    uses_it = adapter.needs_negative_prompt(args.guidance_scale, args.true_cfg_scale)
    return args.negative_prompt if uses_it else None


class PromptConditioner:
    """Conditioning of distinct prompts. With ``precompute_prompt_embeds``, each prompt is encoded once, alone (as
    DanceGRPO does: its encoding never depends on the batch it lands in), kept on the CPU and collated per rollout;
    a prompt met for the first time is added to the table."""

    def __init__(self, adapter: FlowMatchingAdapter, args: GRPOJaggConfig, frozen: FrozenModules):
        self.adapter = adapter
        self.args = args
        self.frozen = frozen
        self.table: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def negative_prompt(self) -> str | None:
        return negative_prompt(self.adapter, self.args)

    def precompute(self, prompts: Sequence[str]) -> None:
        """Encode the prompts not yet in the table (and, the first time, the negative prompt)."""
        unique = [p for p in dict.fromkeys(prompts) if p not in self.table]
        if not unique:
            return
        with torch.no_grad(), self.frozen.on_accelerator(self.frozen.text_encoders):
            for prompt in unique:
                encoded = self.adapter.encode_prompts([prompt], self.args.max_sequence_length)
                self.table[prompt] = {key: value.cpu() for key, value in encoded.items() if value is not None}
            if self.negative_prompt is not None:  # the adapter encodes it once (cached per device): now
                self(unique[:1])

    def __call__(self, prompts: list[str], source_images: list | None = None) -> Conditioning:
        """The conditioning of distinct ``prompts`` (of each sample's prompt when editing: with one source image
        per prompt, ``source_images``)."""
        args = self.args
        if args.precompute_prompt_embeds:
            self.precompute(prompts)
            collated = self.adapter.collate([self.table[p] for p in prompts])
            encoded = {key: value.to(self.frozen.device) for key, value in collated.items()}
            # The negative prompt was encoded with the table; an editing family's source images still encode now.
            context = self.frozen.on_accelerator(self.frozen.vae if self.adapter.edits_images else [])
        else:
            encoded, context = None, self.frozen.on_accelerator(self.frozen.conditioning)
        with context:
            return self.adapter.condition(
                prompts,
                height=args.height,
                width=args.width,
                negative_prompt=self.negative_prompt,
                max_sequence_length=args.max_sequence_length,
                encoded=encoded,
                source_images=source_images,
            )
