"""DGPO (Direct Group Preference Optimization) on Stable Diffusion 3.5 Medium with PickScore (LoRA): `objective="dgpo"`.

The `dgpo-sd35` preset (trl_jagg/recipes/dgpo.py, docs/peers/dgpo.md): the DGPO authors' PickScore config: 512 px, 10
deterministic rollout steps (DPM-Solver++ 2) with CFG 4.5, 24 images per prompt, 192 images per optimizer step on 4
processes; the group-level DPO loss (beta 10) against the base model on 4 of the first 7 timesteps, without CFG, its
ratio clipped at 5e-2 against an old policy that samples from step 200; LoRA r 64 / alpha 128 on the attention
projections; constant lr 3e-4. JAGG across timesteps is an option (`--use_jagg true`).

    accelerate launch --num_processes 4 examples/train_sd35_dgpo.py --output_dir sd35-dgpo
    python examples/train_sd35_dgpo.py --tiny --output_dir /tmp/sd35-dgpo-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="dgpo-sd35",
    model="stabilityai/stable-diffusion-3.5-medium",
    reward_funcs=["pickscore"],
    tiny="sd3",
    tiny_steps=8,  # the preset trains indices 0..6: a rollout of more steps
    output_dir="sd35-dgpo",
)  # LoRA r 64 / alpha 128: StableDiffusion3Pipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
