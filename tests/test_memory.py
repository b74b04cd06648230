"""Memory controls of the trainer: gradient checkpointing, frozen components off the accelerator, precomputed prompt
embeddings. Each must leave the update's gradient (or the rollout's conditioning) unchanged."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

PROMPTS = ["a red circle", "a green square"]


def make_trainer(path: str, output_dir, *, lora: bool = True, **overrides) -> DDPOJaggTrainer:
    args = GRPOJaggConfig(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=1, learning_rate=1e-2, clip_range=0.1, jagg_group_size=2, jagg_frac=1.0,
        max_sequence_length=16, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=1,
        **overrides,
    )  # fmt: skip
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights=False)
    return DDPOJaggTrainer(
        model=path, reward_funcs="prompt_color", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft_config if lora else None,
    )  # fmt: skip


def update_gradients(trainer: DDPOJaggTrainer, batch: dict) -> dict[str, torch.Tensor]:
    trainer.model.zero_grad(set_to_none=True)
    trainer._update(trainer.model, batch)
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_gradient_checkpointing_gives_the_same_gradient(tiny_flux_path, tmp_path, lora):
    """diffusers' gradient checkpointing recomputes each block in the backward (counted here), and the update's
    gradient equals the one without it to 1e-6."""
    plain = make_trainer(tiny_flux_path, tmp_path / "plain", lora=lora, beta=0.1)
    batch = plain._generate_and_score([{"prompt": p} for p in PROMPTS for _ in range(2)])
    expected = update_gradients(plain, batch)

    checkpointed = make_trainer(tiny_flux_path, tmp_path / "ckpt", lora=lora, beta=0.1, gradient_checkpointing=True)
    assert checkpointed.model.gradient_checkpointing
    calls = []
    checkpointed.model.transformer_blocks[0].register_forward_pre_hook(lambda *_: calls.append("ckpt"))
    got = update_gradients(checkpointed, batch)
    plain.model.transformer_blocks[0].register_forward_pre_hook(lambda *_: calls.append("plain"))
    update_gradients(plain, batch)
    # Checkpointing re-runs the block in the backward (a pre-hook: the recomputation stops once it has what it needs).
    assert calls.count("ckpt") > calls.count("plain") > 0

    assert got.keys() == expected.keys() and sum(g.abs().sum() for g in expected.values()) > 0
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-6, msg=name)
