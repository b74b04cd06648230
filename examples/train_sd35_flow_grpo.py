"""Flow-GRPO on Stable Diffusion 3.5 Medium with the PickScore reward (LoRA), JAGG in the update stage.

The `flow-grpo-sd35` preset (trl_jagg/recipes/, docs/models.md): 512 px, 10 sampling steps, CFG 4.5, SDE noise
level a = 0.7, G = 24 images per prompt, LoRA r 32 / alpha 64 on the attention projections of `attn` (not SD3.5's
`attn2`), constant lr 3e-4, KL beta 0.01 (Flow-GRPO's PickScore value), every step trained but the last; JAGG as in
the paper, W = 4 and jagg_frac = 0.6 (the 9 trained steps make two JAGG groups and one exact step). Each process
samples 24 images, one whole group, per rollout and takes two optimizer steps on them (each image used once), in fp16
autocast over float32 weights, as Flow-GRPO.

    accelerate launch --num_processes 8 examples/train_sd35_flow_grpo.py --output_dir sd35-flow-grpo
    python examples/train_sd35_flow_grpo.py --tiny --output_dir /tmp/sd35-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="flow-grpo-sd35",
    model="stabilityai/stable-diffusion-3.5-medium",
    reward_funcs=["pickscore"],
    tiny="sd3",
    output_dir="sd35-flow-grpo",
)  # LoRA r 32 / alpha 64: StableDiffusion3Pipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
