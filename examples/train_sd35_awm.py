"""AWM (Advantage Weighted Matching) on Stable Diffusion 3.5 Medium with the PickScore reward (LoRA): `objective="awm"`.

The `awm-sd35` preset (trl_jagg/recipes/awm.py, docs/peers/awm.md): the AWM authors' PickScore config: 512 px, 14
deterministic rollout steps (DPM-Solver++ 2) without CFG, 24 images per prompt, 576 images per optimizer step on 8
processes, one step per rollout; advantage-weighted flow matching (ghuber 0.25) on 6 stratified timesteps, KL 1e-4 to
the base model and 1 to a KL-EMA copy; LoRA r 32 / alpha 64 on the attention projections; constant lr 3e-4.
JAGG across timesteps is an option (`--use_jagg true`).

    accelerate launch --num_processes 8 examples/train_sd35_awm.py --output_dir sd35-awm
    python examples/train_sd35_awm.py --tiny --output_dir /tmp/sd35-awm-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="awm-sd35",
    model="stabilityai/stable-diffusion-3.5-medium",
    reward_funcs=["pickscore"],
    tiny="sd3",
    tiny_steps=8,  # room for the preset's 6 strata in the first 90% of the rollout's indices
    output_dir="sd35-awm",
)  # LoRA r 32 / alpha 64: StableDiffusion3Pipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
