"""GRPO on FLUX.2 dev with CLIP and PickScore rewards (Flow-Factory's recipe): LoRA, embedded guidance 4, JAGG.

The `flow-factory-flux2-dev` preset (trl_jagg/recipes/, docs/models.md): 8 sampling steps at 512 px with embedded
guidance 4 (one backbone call per step, no negative prompt), SDE noise level a = 1.0, G = 16, CLIP (weight 1) and
PickScore (0.5) aggregated with GDPO, LoRA r 64 / alpha 128 on the attention and feed-forward of both streams; JAGG as
in the paper, W = 4 and jagg_frac = 0.6 (of the 7 trained steps, one JAGG group of 4; the remaining 3 run exact).

    accelerate launch --num_processes 8 examples/train_flux2_dev_clip_pickscore.py --output_dir flux2-dev-grpo
    python examples/train_flux2_dev_clip_pickscore.py --tiny --output_dir /tmp/flux2-dev-tiny   # CPU smoke test
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="flow-factory-flux2-dev",
    model="black-forest-labs/FLUX.2-dev",
    tiny="flux2_dev",
    output_dir="flux2-dev-grpo",  # rewards: the preset's
)  # pytorch_lora_weights.safetensors: Flux2Pipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
