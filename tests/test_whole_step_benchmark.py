"""The whole-step benchmark runs rollout, rewards and update of the real trainer per variant, counts the work each
does by hooks and prices it with the FLOP model (never asserts on timings)."""

from __future__ import annotations

import json

import pytest

from trl_jagg.benchmarks import whole_step
from trl_jagg.benchmarks.flops import StepCosts
from trl_jagg.benchmarks.whole_step import JSON_NAME, run_whole_step_benchmark


def test_mixed_variants_count_the_work_of_their_rollout_and_update(tmp_path, monkeypatch):
    # Made-up unit costs (the real ones take a minute to count on the meta device; tests/test_flops.py checks them).
    # A LoRA backward is about one forward (no weight gradients of the base), its forward a little dearer;
    # checkpointing recomputes a little less than a forward (the embedders and proj_out are not recomputed).
    costs = {
        "full": StepCosts(forward_row=10.0, backward_row=20.0, recompute_row=9.0, vae_decode=3.0, text_encode=1.0),
        "lora": StepCosts(forward_row=11.0, backward_row=12.0, recompute_row=10.0, vae_decode=3.0, text_encode=1.0),
    }
    monkeypatch.setattr(whole_step, "flux_dev_costs", lambda *args: costs)
    report = run_whole_step_benchmark(
        str(tmp_path), variants=("mix_exact", "mix_jagg_cache_prefix_dpm"), resolution=32, max_sequence_length=16,
        num_layers=1, num_single_layers=1, repeats=1,
    )  # fmt: skip
    assert json.loads((tmp_path / JSON_NAME).read_text()) == json.loads(json.dumps(report))
    exact, fast = report["results"]
    # The timed repeat's window is steps 7-10 of 16, one group of G = 12 (12 images decoded, one prompt encoded).
    # MixGRPO's cost: 16 rollout steps x 12 rows, then 4 trained steps, each a 12-row forward with graph and its
    # backward.
    images_and_prompt = {"decoded_images": 12, "encoded_prompts": 1}
    assert exact["counted"] == {"graph_rows": 48, "no_grad_rows": 192, "backward_rows": 48, **images_and_prompt}
    # Compressed path [0, 2, 4 | 7, 8, 9, 10 | 11, 13, 16]: the 3 steps before the window on one row (the shared
    # prefix), 6 steps on 12; the update is one JAGG group: two 12-row endpoints, one joint backward, no
    # intermediate forward (the velocity cache).
    assert fast["counted"] == {"graph_rows": 24, "no_grad_rows": 3 + 6 * 12, "backward_rows": 24, **images_and_prompt}
    # Full fine-tuning as mixgrpo-flux trains (blocks checkpointed: each backward row recomputes them), the LoRA as
    # flow-grpo-flux (not checkpointed).
    full = (10 * (48 + 192) + (20 + 9) * 48 + 3 * 12 + 1) / (10 * (24 + 75) + (20 + 9) * 24 + 3 * 12 + 1)
    lora = (11 * (48 + 192) + 12 * 48 + 3 * 12 + 1) / (11 * (24 + 75) + 12 * 24 + 3 * 12 + 1)
    assert fast["predicted_speedup_vs_mix_exact"] == pytest.approx({"full": full, "lora": lora})
    assert fast["predicted_checkpointing"] == exact["predicted_checkpointing"] == {"full": True, "lora": False}
    assert len(fast["speedup_vs_mix_exact"]["per_repeat"]) == 1 and "speedup_vs_mix_exact" not in exact
    assert report["config"]["flop_model"]["flops"] == {
        "full": costs["full"].as_dict(),
        "lora": costs["lora"].as_dict(),
    }
    assert report["config"]["flop_model"]["training"]["lora"]["preset"] == "flow-grpo-flux"

    # Repricing the saved report at other costs recomputes the predictions from its counted work, and nothing else.
    saved = tmp_path / "saved.json"
    saved.write_text((tmp_path / JSON_NAME).read_text())
    dearer = {"full": StepCosts(10.0, 20.0, 9.0, 30.0, 1.0), "lora": StepCosts(11.0, 12.0, 10.0, 30.0, 1.0)}
    monkeypatch.setattr(whole_step, "flux_dev_costs", lambda *args: dearer)
    repriced = run_whole_step_benchmark(str(tmp_path / "repriced"), reprice_report=str(saved))
    full = (10 * (48 + 192) + 29 * 48 + 30 * 12 + 1) / (10 * (24 + 75) + 29 * 24 + 30 * 12 + 1)
    assert repriced["results"][1]["predicted_speedup_vs_mix_exact"]["full"] == pytest.approx(full)
    for before, after in zip(report["results"], repriced["results"]):
        assert {k: v for k, v in after.items() if not k.startswith("predicted")} == json.loads(
            json.dumps({k: v for k, v in before.items() if not k.startswith("predicted")})
        )


def test_unknown_variant_raises(tmp_path):
    with pytest.raises(ValueError, match="Unknown `variants`"):
        run_whole_step_benchmark(str(tmp_path), variants=("mix_fast",))
