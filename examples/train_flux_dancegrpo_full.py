"""DanceGRPO on FLUX.1-dev with the HPSv2.1 reward: full fine-tuning, constant-eta SDE, a random 60% of steps trained.

The `dancegrpo-flux` preset (trl_jagg/recipes/, docs/models.md): 720 px, 16 sampling steps with a fixed time shift
3 (a scheduler override, applied to the pipeline below), eta 0.3, full fine-tuning at a constant lr 1e-5, a random
60% of the first 15 denoising steps trained per sample, G = 12 samples per process and three optimizer steps on them
(each used once), bf16 autocast over float32 weights; JAGG as in the paper, W = 4 and jagg_frac = 0.6 over the trained
steps. Full fine-tuning a 12B backbone needs its optimizer state sharded, so FSDP2 (per transformer block) is
switched on when launched on more than one process:

    accelerate launch --num_processes 8 examples/train_flux_dancegrpo_full.py --output_dir flux-dancegrpo
    python examples/train_flux_dancegrpo_full.py --tiny --output_dir /tmp/dance-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="dancegrpo-flux",
    model="black-forest-labs/FLUX.1-dev",
    reward_funcs=["hpsv2.1"],
    tiny="flux",
    output_dir="flux-dancegrpo",
    values={"max_steps": 300, "save_steps": 50},
    tiny_steps=8,
    fsdp_blocks=["FluxTransformerBlock", "FluxSingleTransformerBlock"],  # FSDP2 units, on several processes
)  # the transformer in the diffusers layout: FluxTransformer2DModel.from_pretrained(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
