"""HPSv3 on FLUX.1-dev (LoRA) with the `flow-grpo-flux` settings, JAGG in the update stage.

Not a peer's published recipe: no peer ships a FLUX.1-dev run on HPSv3. DanceGRPO's FLUX LoRA trainer has the
switch (`--use_hpsv3`, fastvideo/train_grpo_flux_lora.py:641-643, 1130-1135 @15cc71d; its script passes
--use_hpsv2), Pref-GRPO's train_flux.py takes `hpsv3` in --reward_spec (README.md:418,
fastvideo/rewards/dispatcher.py:44 @3e787f6), and VeRL-Omni's one HPSv3 run is DanceGRPO on Wan2.2-TI2V-5B
(examples/dancegrpo_trainer/wan22/run_wan22_5b_t2v_hpsv3_auto.sh @a1139ba), for which trl_jagg has no preset
yet. The rest is the `flow-grpo-flux` preset: 6 steps at 512 px, embedded guidance 3.5, SDE a = 0.9, G = 24, LoRA
r 64 / alpha 128 on attention and feed-forward, lr 3e-4, no KL. HPSv3 (Qwen2-VL-7B + an MLP head, ~17 GB in
bfloat16) runs in process on every GPU, beside FLUX.1-dev; it reads MizzenAI/HPSv3 and Qwen/Qwen2-VL-7B-Instruct.

    accelerate launch --num_processes 8 examples/train_flux_hpsv3.py --output_dir flux-hpsv3
    python examples/train_flux_hpsv3.py --tiny --output_dir /tmp/flux-hpsv3-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from trl_jagg.scripts.examples import Example, ExampleArguments

if TYPE_CHECKING:  # the heavy modules are imported where they are used: --help answers before them
    from trl_jagg import GRPOJaggConfig
    from trl_jagg.testing.tiny_models import TinyRun


class HPSv3Example(Example):
    def tiny_setup(self, args: ExampleArguments, config: GRPOJaggConfig) -> TinyRun:
        """The tiny Flux, and HPSv3's real code on a tiny random Qwen2-VL + head (its folder removed at exit)."""
        from trl_jagg.testing.tiny_models import temporary_folder
        from trl_jagg.testing.tiny_rewards import save_tiny_hpsv3

        hpsv3 = save_tiny_hpsv3(temporary_folder("tiny-hpsv3-"))
        config.reward_kwargs = {"hpsv3": {"base_model": hpsv3.base_model, "checkpoint": hpsv3.checkpoint}}
        return replace(super().tiny_setup(args, config), reward="hpsv3")


EXAMPLE = HPSv3Example(
    __file__,
    recipe="flow-grpo-flux",
    model="black-forest-labs/FLUX.1-dev",
    reward_funcs=["hpsv3"],
    tiny="flux",
    output_dir="flux-hpsv3",
    values={"reward_kwargs": {"hpsv3": {"dtype": "bfloat16"}}},
)  # pytorch_lora_weights.safetensors: FluxPipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
