"""GRPO on FLUX.2 klein base with the PickScore reward (Flow-Factory's recipe): LoRA, CFG 4, JAGG in the update.

The `flow-factory-flux2-klein-base` preset (trl_jagg/recipes/, docs/models.md): 8 sampling steps at 384 px with
CFG 4 (the pipeline's empty negative prompt), SDE noise level a = 0.7, G = 16, LoRA r 64 / alpha 128 on the attention
and feed-forward of both streams; JAGG as in the paper, W = 4 and jagg_frac = 0.6 (of the 7 trained steps, one JAGG
group of 4; the remaining 3 run exact).

    accelerate launch --num_processes 8 examples/train_flux2_klein_pickscore.py --output_dir flux2-klein-pickscore
    python examples/train_flux2_klein_pickscore.py --tiny --output_dir /tmp/flux2-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="flow-factory-flux2-klein-base",
    model="black-forest-labs/FLUX.2-klein-base-9B",
    reward_funcs=["pickscore"],
    tiny="flux2_klein",
    output_dir="flux2-klein-pickscore",
)  # pytorch_lora_weights.safetensors: Flux2KleinPipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
