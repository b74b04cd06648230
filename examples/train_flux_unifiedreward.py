"""Pref-GRPO-style rewards on FLUX.1-dev: UnifiedReward-Think pairwise win rates (a VLM judge served by vLLM) mixed
with CLIPScore, LoRA, JAGG in the update stage.

Pref-GRPO (CodeGoat24/Pref-GRPO, scripts/lora/lora_ur_think_prefgrpo_flux.sh) weights the judge's win rate 0.4
and CLIP 0.6 with G = 8 images per prompt; every two images of a prompt are one judge request (28 per prompt).
The rest is the `flow-grpo-flux` preset (trl_jagg/recipes/). Serve the judge first (docs/rewards.md):

    vllm serve CodeGoat24/UnifiedReward-Think-qwen3vl-8b --served-model-name UnifiedReward --port 8080 \\
        --limit-mm-per-prompt.image 2 --enable-prefix-caching
    accelerate launch --num_processes 8 examples/train_flux_unifiedreward.py --judge_url http://localhost:8080/v1
    python examples/train_flux_unifiedreward.py --tiny --output_dir /tmp/flux-tiny   # CPU smoke test, no judge
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="flux-unifiedreward-grpo")
    parser.add_argument("--judge_url", default=None, help="the judge's API base; default $TRL_JAGG_JUDGE_URL")
    parser.add_argument("--judge_model", default=None, help="the served model name; default $TRL_JAGG_JUDGE_MODEL")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-grpo-flux")
    # The judge by name, configured in reward_kwargs (a recipe YAML or `trl-jagg train --reward_kwargs` say the same).
    judge = {"url": args.judge_url, "model": args.judge_model, "judge": "unifiedreward-think-pairwise",
             "max_concurrency": 32}  # fmt: skip
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  num_generations=8, reward_weights=[0.4, 0.6], reward_kwargs={"vlm-judge": judge})  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 or bf16 autocast, GPUs)
    model, reward_funcs = "black-forest-labs/FLUX.1-dev", ["vlm-judge", "clipscore"]
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("flux")
        model, reward_funcs, dataset = tiny.model, [tiny.reward], tiny.dataset
        config.update(tiny.config, reward_weights=None, reward_kwargs=None)
    else:
        dataset = load_dataset(args.dataset, split="train").rename_column(args.prompt_column, "prompt")

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 64 / alpha 128
    )
    trainer.train()
    trainer.save_model()  # pytorch_lora_weights.safetensors: FluxPipeline.load_lora_weights(output_dir)


if __name__ == "__main__":
    main()
