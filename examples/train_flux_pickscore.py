"""Flow-GRPO on FLUX.1-dev with the PickScore reward: LoRA, JAGG on the high-noise 60% of the step groups.

A script to copy and edit, in the shape of TRL's trl/scripts/grpo.py: the parser, the dataset, the reward, the
trainer, train, save and push are below (swap the reward for your own function, transform the dataset, ...).

The `flow-grpo-flux` preset (trl_jagg/recipes/, docs/models.md) gives the defaults: 6 sampling steps, embedded
guidance 3.5, SDE noise level a = 0.9, LoRA r 64 / alpha 128 on the attention projections and the feed-forward
layers, G = 24, every step trained but the last, two optimizer steps per rollout, bf16 autocast over float32 weights;
JAGG as in the paper, W = 4 and jagg_frac = 0.6. Every GRPOJaggConfig field is a flag and `--config x.yaml` sets any.

    accelerate launch --num_processes 8 examples/train_flux_pickscore.py --output_dir flux-pickscore-grpo
    python examples/train_flux_pickscore.py --tiny --output_dir /tmp/flux-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trl_jagg.scripts.examples import ExampleParser, ScriptArguments

if TYPE_CHECKING:
    from trl_jagg import GRPOJaggConfig

# Defaults, lowest first: the preset < these values < --tiny's (a tiny Flux on CPU) < the --config YAML < flags.
PARSER = ExampleParser(
    __file__,
    recipe="flow-grpo-flux",
    tiny="flux",
    values={
        "model_name_or_path": "black-forest-labs/FLUX.1-dev",
        "dataset_name": "nateraw/parti-prompts",
        "dataset_prompt_column": "Prompt",
        "output_dir": "flux-pickscore-grpo",
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
        args=training_args,
        train_dataset=dataset,
        peft_config=PARSER.preset.lora_config(),  # LoRA r 64 / alpha 128, or your own peft.LoraConfig
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # FluxPipeline.load_lora_weights(output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if script_args.tiny else script_args.dataset_name)
    trainer.end()  # the trackers finish and the process group is destroyed, as TRL's scripts end


if __name__ == "__main__":
    script_args, training_args = PARSER.parse_args()  # exits after --help, or with status 2 on a usage error
    main(script_args, training_args)
