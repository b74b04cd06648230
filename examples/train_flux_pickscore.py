"""Flow-GRPO on FLUX.1-dev with the PickScore reward: LoRA, JAGG on the high-noise 60% of the step groups.

The `flow-grpo-flux` preset (trl_jagg/recipes/, docs/models.md): 6 sampling steps, embedded guidance 3.5, SDE noise
level a = 0.9, LoRA r 64 / alpha 128 on the attention projections and the feed-forward layers, G = 24, every step
trained but the last, two optimizer steps per rollout, bf16 autocast over float32 weights; JAGG as in the paper, W = 4
and jagg_frac = 0.6 (the 5 trained steps make one JAGG group and one exact step).

    accelerate launch --num_processes 8 examples/train_flux_pickscore.py --output_dir flux-pickscore-grpo
    python examples/train_flux_pickscore.py --tiny --output_dir /tmp/flux-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="flow-grpo-flux",
    model="black-forest-labs/FLUX.1-dev",
    reward_funcs=["pickscore"],
    tiny="flux",
    output_dir="flux-pickscore-grpo",
)  # pytorch_lora_weights.safetensors: FluxPipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
