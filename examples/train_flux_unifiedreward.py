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

from dataclasses import dataclass, field
from typing import Any

from trl_jagg.scripts.examples import Example, ExampleArguments


@dataclass
class JudgeArguments(ExampleArguments):
    judge_url: str | None = field(
        default=None, metadata={"help": "The judge's API base; default $TRL_JAGG_JUDGE_URL."}
    )
    judge_model: str | None = field(
        default=None, metadata={"help": "Its served model; default $TRL_JAGG_JUDGE_MODEL."}
    )


class JudgeExample(Example):
    def extra_values(self, args: JudgeArguments) -> dict[str, Any]:
        """The judge by name, configured in reward_kwargs (as a recipe YAML or `--reward_kwargs` would)."""
        judge = {"url": args.judge_url, "model": args.judge_model, "judge": "unifiedreward-think-pairwise",
                 "max_concurrency": 32}  # fmt: skip
        return {"reward_kwargs": {"vlm-judge": judge}}


EXAMPLE = JudgeExample(
    __file__,
    recipe="flow-grpo-flux",
    model="black-forest-labs/FLUX.1-dev",
    reward_funcs=["vlm-judge", "clipscore"],
    tiny="flux",
    output_dir="flux-unifiedreward-grpo",
    values={"num_generations": 8, "reward_weights": [0.4, 0.6]},
    arguments=JudgeArguments,
)  # pytorch_lora_weights.safetensors: FluxPipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
