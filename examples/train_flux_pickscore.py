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

import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import set_seed

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.scripts.utils import CommandParser, UsageError

RECIPE = get_recipe("flow-grpo-flux")
SCRIPT = "examples/train_flux_pickscore.py"


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default="black-forest-labs/FLUX.1-dev", metadata={"help": "Hub id or folder."})
    dataset_name: str = field(default="nateraw/parti-prompts", metadata={"help": "Hub dataset of prompts."})
    dataset_prompt_column: str = field(default="Prompt", metadata={"help": "The dataset's column of prompts."})
    tiny: bool = field(default=False, metadata={"help": "A tiny Flux built from config, on CPU, in seconds."})


def main(script_args: ScriptArguments, training_args: GRPOJaggConfig) -> None:
    # Rewards: registry names, http(s):// URLs of a reward server, or functions f(prompts, images, **columns) -> list.
    reward_funcs = ["pickscore"]
    if script_args.tiny:  # a tiny pipeline saved to a temporary folder, the weight-free prompt_color reward
        from trl_jagg.testing.tiny_models import tiny_run

        tiny = tiny_run("flux")
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
        peft_config=RECIPE.lora_config(),  # or your own peft.LoraConfig
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)  # FluxPipeline.load_lora_weights(output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if script_args.tiny else script_args.dataset_name)
    trainer.end()  # the trackers finish and the process group is destroyed, as TRL's scripts end


def parse_args(argv: list[str]) -> tuple[ScriptArguments, GRPOJaggConfig] | None:
    """Defaults: the preset < this script's values < --tiny's < the --config YAML < flags; None after --help."""
    defaults = {**RECIPE.config, "output_dir": "flux-pickscore-grpo", "max_steps": 1000, "save_steps": 100}
    defaults |= {RECIPE.mixed_precision: True, "report_to": "tensorboard"}
    if "--tiny" in argv or "--tiny=true" in argv:
        from trl_jagg.testing.tiny_models import tiny_config

        defaults |= tiny_config("flux")
    parser = CommandParser((ScriptArguments, GRPOJaggConfig), SCRIPT, __doc__.split("\n")[0], prog=f"python {SCRIPT}")
    return parser.parse_command_line(argv, lambda argv, config: defaults)


if __name__ == "__main__":
    try:
        parsed = parse_args(sys.argv[1:])
    except UsageError as error:
        sys.exit(f"python {SCRIPT}: error: {error} (all flags: --help)")
    if parsed is not None:
        main(*parsed)
