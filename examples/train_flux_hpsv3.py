"""HPSv3 on FLUX.1-dev (LoRA) with the `flow-grpo-flux` settings, JAGG in the update stage.

Not a peer's published recipe: no peer ships a FLUX.1-dev run on HPSv3. DanceGRPO's FLUX LoRA trainer has the
switch (`--use_hpsv3`, fastvideo/train_grpo_flux_lora.py:641-643, 1130-1135 @15cc71d; its script passes
--use_hpsv2), Pref-GRPO's train_flux.py takes `hpsv3` in --reward_spec (README.md:418,
fastvideo/rewards/dispatcher.py:44 @3e787f6), and VeRL-Omni's one HPSv3 run is DanceGRPO on Wan2.2-TI2V-5B
(examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_auto.sh @a1139ba), for which trl_jagg has no preset
yet. The rest is the `flow-grpo-flux` preset: 6 steps at 512 px, embedded guidance 3.5, SDE a = 0.9, G = 24, LoRA
r 64 / alpha 128 on attention and feed-forward, lr 3e-4, no KL. HPSv3 (Qwen2-VL-7B + an MLP head, ~17 GB in
bfloat16) runs in process on every GPU, beside FLUX.1-dev; it reads MizzenAI/HPSv3 and Qwen/Qwen2-VL-7B-Instruct.

    accelerate launch --num_processes 8 examples/train_flux_hpsv3.py --output_dir flux-hpsv3
    python examples/train_flux_hpsv3.py --tiny --output_dir /tmp/flux-hpsv3-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import temporary_folder, tiny_run
from trl_jagg.testing.tiny_rewards import save_tiny_hpsv3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="flux-hpsv3")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--tiny", action="store_true", help="tiny Flux and a tiny random Qwen2-VL + head, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-grpo-flux")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  reward_kwargs={"hpsv3": {"dtype": "bfloat16"}})  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (bf16 autocast, GPUs)
    model = "black-forest-labs/FLUX.1-dev"
    if args.tiny:  # the same architectures built small from config: the reward's real code on random weights
        tiny = tiny_run("flux")
        model, dataset = tiny.model, tiny.dataset
        hpsv3 = save_tiny_hpsv3(temporary_folder("tiny-hpsv3-"))  # removed at exit
        config.update(tiny.config, reward_kwargs={"hpsv3": {"base_model": hpsv3.base_model,
                                                            "checkpoint": hpsv3.checkpoint}})  # fmt: skip
    else:
        dataset = load_dataset(args.dataset, split="train").rename_column(args.prompt_column, "prompt")

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs="hpsv3",
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 64 / alpha 128
    )
    trainer.train()
    trainer.save_model()  # pytorch_lora_weights.safetensors: FluxPipeline.load_lora_weights(output_dir)


if __name__ == "__main__":
    main()
