"""Flow-GRPO on Qwen-Image with the HPSv2.1 reward: LoRA, FSDP2 across GPUs, JAGG in the update stage.

The `flow-grpo-qwenimage` preset (trl_jagg/recipes/, docs/models.md): true CFG 4 with norm rescaling, SDE noise
level a = 1.2 in a 2-step window of the 10 steps (the trained steps), G = 16, LoRA r 64 / alpha 128 on the attention
projections and both MLPs, two optimizer steps per rollout, bf16 over float32 weights, activation checkpointing; JAGG
with W = 2, the window (exact at W = 2: one joint backward instead of two). The preset's reward is PickScore; this
example trains on HPSv2.1 (`pip install -e ".[rewards]"`).

FSDP comes from the training arguments below (`fsdp`, `fsdp_config`): each QwenImageTransformerBlock is sharded,
and JAGG's joint backward gathers each block's parameters once for both endpoint forwards. The Trainer refuses
FSDP in a single process, so it is switched on only when launched on several:

    accelerate launch --num_processes 8 examples/train_qwenimage_hpsv2.py --output_dir qwenimage-hpsv2
    python examples/train_qwenimage_hpsv2.py --tiny --output_dir /tmp/qwen-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="flow-grpo-qwenimage",
    model="Qwen/Qwen-Image",
    reward_funcs=["hpsv2.1"],
    tiny="qwenimage",
    output_dir="qwenimage-hpsv2",
    fsdp_blocks=["QwenImageTransformerBlock"],  # FSDP2 units, when launched on several processes
)  # QwenImagePipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
