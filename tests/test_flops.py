"""The FLOP model counts the real Flux transformer's products on the meta device, and prices counted work."""

from __future__ import annotations

import pytest

from trl_jagg.benchmarks.flops import FLUX_DEV_TRANSFORMER, StepCosts, step_flops, transformer_flops

TINY = FLUX_DEV_TRANSFORMER | {
    "in_channels": 8, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
    "joint_attention_dim": 12, "pooled_projection_dim": 10, "axes_dims_rope": (4, 6, 6),
}  # fmt: skip


def flux_forward_flops(c: dict, image_tokens: int, text_tokens: int) -> int:
    """Flux's forward written out from its architecture: 2 FLOPs per multiply-add of every linear layer (inputs
    x outputs x rows it runs on) plus attention's two products (4 x tokens^2 x width) per block."""
    i, n, t = c["num_attention_heads"] * c["attention_head_dim"], image_tokens, text_tokens
    s = n + t
    macs = n * c["in_channels"] * i + t * c["joint_attention_dim"] * i  # x_embedder, context_embedder
    macs += 2 * (256 * i + i * i) + c["pooled_projection_dim"] * i + i * i  # timestep, guidance, pooled text
    # Joint block: two AdaLN-Zero modulations (6i each, one row); q, k, v, out and the 4x MLP of each stream.
    double = 2 * 6 * i * i + s * 4 * i * i + s * 8 * i * i
    # Single block: AdaLN (3i), q, k, v, the MLP's up-projection (4i) and proj_out from 5i, on all tokens.
    single = 3 * i * i + s * (3 * i * i + 4 * i * i + 5 * i * i)
    macs += c["num_layers"] * double + c["num_single_layers"] * single
    macs += 2 * i * i + n * i * c["in_channels"]  # norm_out's modulation, proj_out
    attention = (c["num_layers"] + c["num_single_layers"]) * 4 * s * s * i
    return 2 * macs + attention


def test_tiny_flux_forward_flops_match_the_architecture_and_scale_with_rows():
    forward, backward = transformer_flops(TINY, image_tokens=16, text_tokens=8)
    assert forward == flux_forward_flops(TINY, 16, 8)
    # Full fine-tuning: weight and activation gradients, about twice the forward (the embedders' inputs need none).
    assert 1.8 * forward < backward < 2.1 * forward
    assert transformer_flops(TINY, image_tokens=16, text_tokens=8, rows=2) == (2 * forward, 2 * backward)


def test_step_flops_prices_the_counted_work():
    costs = StepCosts(forward_row=10.0, backward_row=21.0, vae_decode=3.0, text_encode=0.5)
    counts = {"graph_rows": 4, "no_grad_rows": 6, "backward_rows": 4, "decoded_images": 2, "encoded_prompts": 1}
    assert step_flops(costs, counts) == pytest.approx(10 * 10.0 + 4 * 21.0 + 2 * 3.0 + 0.5)
