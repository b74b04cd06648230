"""The FLOP model counts the real Flux transformer's products on the meta device, and prices counted work."""

from __future__ import annotations

import pytest

from trl_jagg.benchmarks.flops import (
    FLUX_DEV_TRANSFORMER,
    StepCosts,
    backbone_costs,
    checkpointed_fraction,
    flux_dev_lora,
    preset_checkpointed_fraction,
    step_flops,
    transformer_flops,
)

TINY = FLUX_DEV_TRANSFORMER | {
    "in_channels": 8, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
    "joint_attention_dim": 12, "pooled_projection_dim": 10, "axes_dims_rope": (4, 6, 6),
}  # fmt: skip


def flux_outside_blocks_flops(c: dict, image_tokens: int, text_tokens: int) -> int:
    """The products of Flux's forward outside its transformer blocks, 2 FLOPs per multiply-add (inputs x outputs x
    rows): the embedders before the blocks, norm_out's modulation and proj_out after them."""
    i, n, t = c["num_attention_heads"] * c["attention_head_dim"], image_tokens, text_tokens
    macs = n * c["in_channels"] * i + t * c["joint_attention_dim"] * i  # x_embedder, context_embedder
    macs += 2 * (256 * i + i * i) + c["pooled_projection_dim"] * i + i * i  # timestep, guidance, pooled text
    macs += 2 * i * i + n * i * c["in_channels"]  # norm_out's modulation, proj_out
    return 2 * macs


def flux_forward_flops(c: dict, image_tokens: int, text_tokens: int) -> int:
    """Flux's forward written out from its architecture: 2 FLOPs per multiply-add of every linear layer (inputs
    x outputs x rows it runs on) plus attention's two products (4 x tokens^2 x width) per block."""
    i, n, t = c["num_attention_heads"] * c["attention_head_dim"], image_tokens, text_tokens
    s = n + t
    # Joint block: two AdaLN-Zero modulations (6i each, one row); q, k, v, out and the 4x MLP of each stream.
    double = 2 * 6 * i * i + s * 4 * i * i + s * 8 * i * i
    # Single block: AdaLN (3i), q, k, v, the MLP's up-projection (4i) and proj_out from 5i, on all tokens.
    single = 3 * i * i + s * (3 * i * i + 4 * i * i + 5 * i * i)
    macs = c["num_layers"] * double + c["num_single_layers"] * single
    attention = (c["num_layers"] + c["num_single_layers"]) * 4 * s * s * i
    return flux_outside_blocks_flops(c, n, t) + 2 * macs + attention


# Flow-GRPO's FLUX.1 LoRA targets, written out: the attention projections of both streams (the single blocks'
# attention has no output projection: attn.to_q, to_k and to_v match there too) and the joint blocks' feed-forwards.
LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
    "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
]  # fmt: skip


def flux_full_backward_flops(c: dict, image_tokens: int, text_tokens: int) -> int:
    """Full fine-tuning: every linear layer computes its weight's gradient and its input's (one forward's products
    each), attention's backward four products (twice its forward), except the input gradients nothing needs: the
    embedders of the latents, the text, the timestep, the guidance and the pooled text take inputs without grad."""
    i = c["num_attention_heads"] * c["attention_head_dim"]
    skipped = image_tokens * c["in_channels"] * i + text_tokens * c["joint_attention_dim"] * i
    skipped += 2 * 256 * i + c["pooled_projection_dim"] * i
    return 2 * flux_forward_flops(c, image_tokens, text_tokens) - 2 * skipped


def flux_lora_flops(c: dict, image_tokens: int, text_tokens: int, r: int) -> tuple[int, int]:
    """Forward and backward of a rank-``r`` LoRA on ``LORA_TARGETS`` over the frozen base.

    Forward: each adapted linear a -> b on m rows adds its adapter's m r (a + b) multiply-adds. Backward (autograd
    computes a product only where a gradient is needed): a frozen linear costs its input's gradient (m a b) if
    its input depends on an adapter, else nothing; an adapter costs B's weight and input gradients (2 m r b), A's
    weight gradient (m a r) and, if its input depends on an adapter, A's input gradient (m a r). So nothing below
    the first joint block's q, k, v adapters costs a backward: the embedders, and every AdaLN modulation (fed by
    the timestep embedding, frozen). Attention's backward is four products, as in full fine-tuning."""
    i, n, t = c["num_attention_heads"] * c["attention_head_dim"], image_tokens, text_tokens
    s, joint, single = n + t, c["num_layers"], c["num_single_layers"]
    # Per token of a joint block: q, k, v, out (i -> i) and the MLP (i -> 4i -> i) of its stream; a single block:
    # q, k, v (i -> i).
    adapter_macs = joint * s * r * (4 * 2 * i + 2 * 5 * i) + single * s * r * 3 * 2 * i
    forward = flux_forward_flops(c, n, t) + 2 * adapter_macs
    # The first joint block: q, k, v have inputs without grad (adapters only: 2 r i + i r each); out and the MLP
    # have inputs with grad (the base's input gradient: i^2 for out, 8 i^2 for the MLP; the adapters twice their
    # forward).
    first = s * (9 * i * i + 3 * 3 * r * i + 2 * r * 2 * i + 2 * 2 * r * 5 * i)
    # Later joint blocks: q, k, v, out and the MLP (12 i^2), the adapters twice their forward (36 r i).
    later = (joint - 1) * s * (12 * i * i + 2 * r * 18 * i)
    # Single blocks: the frozen proj_mlp (4 i^2) and proj_out (from 5i: 5 i^2), q, k, v (3 i^2), their adapters.
    singles = single * s * (12 * i * i + 2 * r * 6 * i)
    proj_out = n * i * c["in_channels"]  # norm_out's modulation needs nothing: temb has no grad
    attention = (joint + single) * 8 * s * s * i
    return forward, 2 * (first + later + singles + proj_out) + attention


def test_tiny_flux_forward_flops_match_the_architecture_and_scale_with_rows():
    forward, backward = transformer_flops(TINY, image_tokens=16, text_tokens=8)
    assert forward == flux_forward_flops(TINY, 16, 8)
    # Full fine-tuning: weight and activation gradients, twice the forward less the embedders' input gradients.
    assert backward == flux_full_backward_flops(TINY, 16, 8)
    assert transformer_flops(TINY, image_tokens=16, text_tokens=8, rows=2) == (2 * forward, 2 * backward)


def test_checkpointed_backward_recomputes_the_blocks_forward_only():
    # diffusers checkpoints each joint and single block: the backward runs their forward again (with the adapters'
    # products under LoRA), never the embedders, norm_out or proj_out outside them. The forward is unchanged.
    lora = {"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS}
    outside = flux_outside_blocks_flops(TINY, 16, 8)
    full_forward = flux_forward_flops(TINY, 16, 8)
    full = (full_forward, flux_full_backward_flops(TINY, 16, 8) + full_forward - outside)
    assert transformer_flops(TINY, image_tokens=16, text_tokens=8, checkpointing=True) == full
    lora_forward, lora_backward = flux_lora_flops(TINY, 16, 8, r=4)
    lora_costs = backbone_costs(TINY, image_tokens=16, text_tokens=8, lora=lora)
    assert lora_costs == {
        "forward_row": lora_forward, "backward_row": lora_backward, "recompute_row": lora_forward - outside,
    }  # fmt: skip


def test_tiny_flux_lora_flops_count_only_the_gradients_the_adapters_need():
    # Two joint blocks: the first one's q, k, v adapters are the lowest trained weights, the second has inputs
    # with grad everywhere. Exact integers: FlopCounterMode counts products by shape.
    lora = {"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS}
    forward, backward = transformer_flops(TINY, image_tokens=16, text_tokens=8, lora=lora)
    assert (forward, backward) == flux_lora_flops(TINY, 16, 8, r=4)
    # No weight gradient of the base: far below full fine-tuning's backward.
    assert backward < 0.7 * transformer_flops(TINY, image_tokens=16, text_tokens=8)[1]
    # The costs price the LoRA preset this formula models: rank 64 on these targets.
    preset = flux_dev_lora()
    assert (preset["r"], sorted(preset["target_modules"])) == (64, sorted(LORA_TARGETS))


def test_step_flops_prices_the_counted_work():
    costs = StepCosts(forward_row=10.0, backward_row=21.0, recompute_row=9.0, vae_decode=3.0, text_encode=0.5)
    counts = {"graph_rows": 4, "no_grad_rows": 6, "backward_rows": 4, "decoded_images": 2, "encoded_prompts": 1}
    assert step_flops(costs, counts, checkpointing=False) == pytest.approx(10 * 10.0 + 4 * 21.0 + 2 * 3.0 + 0.5)
    # Checkpointing: each backward row also runs the blocks' forward again.
    checkpointed = 10 * 10.0 + 4 * (21.0 + 9.0) + 2 * 3.0 + 0.5
    assert step_flops(costs, counts, checkpointing=True) == pytest.approx(checkpointed)
    # Every 2nd block of 5 checkpointed (blocks 0, 2, 4): 3/5 of the blocks' forward recomputed per backward row.
    assert checkpointed_fraction(5, 2) == pytest.approx(3 / 5)
    assert checkpointed_fraction(57, 1) == 1.0 and checkpointed_fraction(57, 3) == pytest.approx(19 / 57)
    thinned = 10 * 10.0 + 4 * (21.0 + 9.0 * 3 / 5) + 2 * 3.0 + 0.5
    assert step_flops(costs, counts, checkpointing=checkpointed_fraction(5, 2)) == pytest.approx(thinned)


def test_presets_price_their_checkpointing(monkeypatch):
    from dataclasses import replace

    from trl_jagg.benchmarks import flops

    # DanceGRPO's and MixGRPO's full fine-tuning checkpoints every block (their scripts pass
    # --gradient_checkpointing), Flow-GRPO's FLUX.1 LoRA none (activation_checkpointing False in its config/base.py).
    fractions = [preset_checkpointed_fraction(n) for n in ("dancegrpo-flux", "mixgrpo-flux", "flow-grpo-flux")]
    assert fractions == [1.0, 1.0, 0.0]
    # A preset checkpointing every 4th of FLUX.1-dev's 19 + 38 blocks: blocks 0, 4, ..., 56, i.e. 15 of 57.
    recipe = flops.get_recipe("dancegrpo-flux")
    every_4th = replace(recipe, config={**recipe.config, "activation_checkpointing_kwargs": {"every_n_layers": 4}})
    monkeypatch.setattr(flops, "get_recipe", lambda name: every_4th)
    assert preset_checkpointed_fraction("dancegrpo-flux") == pytest.approx(15 / 57)
