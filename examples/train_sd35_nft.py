"""DiffusionNFT on Stable Diffusion 3.5 Medium with the PickScore reward (LoRA): `objective="nft"`.

The `nft-sd35` preset (trl_jagg/recipes/diffusion_nft.py, docs/models.md): 512 px, 10 deterministic rollout steps with
DPM-Solver 2 and no CFG, sampled by an old policy that follows the trained weights after each rollout; 24 images per
prompt; the negative-aware flow-matching loss on 99% of the rollout's timesteps (beta 1, KL 1e-4); LoRA r 32 / alpha
64 on the attention projections; constant lr 3e-4; one optimizer step per rollout; fp16 autocast as DiffusionNFT.
JAGG across timesteps is an option (`--use_jagg true`): it groups 4 of a sample's timesteps into one joint backward.

    accelerate launch --num_processes 8 examples/train_sd35_nft.py --output_dir sd35-nft
    python examples/train_sd35_nft.py --tiny --output_dir /tmp/sd35-nft-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="nft-sd35",
    model="stabilityai/stable-diffusion-3.5-medium",
    reward_funcs=["pickscore"],
    tiny="sd3",
    output_dir="sd35-nft",
)  # LoRA r 32 / alpha 64: StableDiffusion3Pipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
