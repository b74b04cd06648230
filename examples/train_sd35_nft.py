"""DiffusionNFT on Stable Diffusion 3.5 Medium with the PickScore reward (LoRA): `objective="nft"`.

A script to copy and edit, in the shape of TRL's trl/scripts/grpo.py: the parser, the dataset, the reward, the
trainer, train, save and push are below (swap the reward for your own function, transform the dataset, ...).

The `nft-sd35` preset (trl_jagg/recipes/diffusion_nft.py, docs/models.md): 512 px, 10 deterministic rollout steps with
DPM-Solver 2 and no CFG, sampled by an old policy that follows the trained weights after each rollout; 24 images per
prompt; the negative-aware flow-matching loss on 99% of the rollout's timesteps (beta 1, KL 1e-4); LoRA r 32 / alpha
64 on the attention projections; constant lr 3e-4; one optimizer step per rollout; fp16 autocast as DiffusionNFT.
JAGG across timesteps is an option (`--use_jagg true`): it groups 4 of a sample's timesteps into one joint backward.
Every GRPOJaggConfig field is a flag and `--config x.yaml` sets any.

    accelerate launch --num_processes 8 examples/train_sd35_nft.py --output_dir sd35-nft
    python examples/train_sd35_nft.py --tiny --output_dir /tmp/sd35-nft-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trl_jagg.scripts.examples import ExampleParser, ScriptArguments

if TYPE_CHECKING:
    from trl_jagg import GRPOJaggConfig

# Defaults, lowest first: the preset < these values < --tiny's (a tiny SD3 on CPU) < the --config YAML < flags.
PARSER = ExampleParser(
    __file__,
    recipe="nft-sd35",
    tiny="sd3",
    values={
        "model_name_or_path": "stabilityai/stable-diffusion-3.5-medium",
        "dataset_name": "nateraw/parti-prompts",
        "dataset_prompt_column": "Prompt",
        "output_dir": "sd35-nft",
    },
)


def main(script_args: ScriptArguments, training_args: GRPOJaggConfig) -> None:
    # Imported here, not at the top, so that --help and a misspelt flag answer before these load.
    from datasets import load_dataset
    from transformers import set_seed

    from trl_jagg import DDPOJaggTrainer

    # Rewards: registry names, http(s):// URLs of a reward server, or functions f(prompts, images, **columns) -> list.
    reward_funcs = ["pickscore"]
    if script_args.tiny:  # a tiny pipeline saved to a temporary folder, the weight-free prompt_color reward
        tiny = PARSER.tiny_run()
        model, reward_funcs, dataset = tiny.model, [tiny.reward], tiny.dataset
    else:
        model = script_args.model_name_or_path
        dataset = load_dataset(script_args.dataset_name, split="train")
        # The trainer reads a "prompt" column; the other columns reach the rewards as keyword arguments.
        dataset = dataset.rename_column(script_args.dataset_prompt_column, "prompt")
    set_seed(training_args.seed)  # the LoRA weights are drawn when the trainer adds the adapter
    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,  # objective="nft": the preset's; the trainer keeps the old policy that samples
        train_dataset=dataset,
        peft_config=PARSER.preset.lora_config(),  # LoRA r 32 / alpha 64, or your own peft.LoraConfig
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # StableDiffusion3Pipeline.load_lora_weights(output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if script_args.tiny else script_args.dataset_name)
    trainer.end()  # the trackers finish and the process group is destroyed, as TRL's scripts end


if __name__ == "__main__":
    script_args, training_args = PARSER.parse_args()  # exits after --help, or with status 2 on a usage error
    main(script_args, training_args)
