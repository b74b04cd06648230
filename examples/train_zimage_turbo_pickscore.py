"""GRPO on Z-Image-Turbo with the PickScore reward (Flow-Factory's recipe): LoRA, JAGG on the high-noise groups.

The `flow-factory-z-image-turbo` preset (trl_jagg/recipes/, docs/models.md): 6 sampling steps without CFG (the
distilled Turbo samples at guidance_scale 0), SDE noise level a = 0.7, G = 16, LoRA r 64 / alpha 128 on the attention
projections and the feed-forward; JAGG as in the paper, W = 4 and jagg_frac = 0.6 (the 5 trained steps make one JAGG
group and one exact step).

    accelerate launch --num_processes 8 examples/train_zimage_turbo_pickscore.py --output_dir zimage-pickscore
    python examples/train_zimage_turbo_pickscore.py --tiny --output_dir /tmp/zimage-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="flow-factory-z-image-turbo",
    model="Tongyi-MAI/Z-Image-Turbo",
    reward_funcs=["pickscore"],
    tiny="zimage",
    output_dir="zimage-pickscore",
)  # pytorch_lora_weights.safetensors: ZImagePipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
