"""GRPO on Wan2.1-T2V-1.3B text-to-video with the OCR reward per frame (Flow-GRPO's recipe): LoRA, JAGG.

The `flow-grpo-wan2.1` preset (trl_jagg/recipes.py, docs/models.md): 33-frame 240x416 videos, 20 steps, CFG 4.5
with both branches in one backbone call, G = 4, LoRA r 32 / alpha 64 on the attention projections; the OCR reward
scores every frame and a video gets the mean; JAGG as in the paper, W = 4 and jagg_frac = 0.6 on the 19 trained steps.

    accelerate launch --num_processes 8 examples/train_wan_ocr.py --output_dir wan-ocr
    python examples/train_wan_ocr.py --tiny --output_dir /tmp/wan-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="flow-grpo-wan2.1",
    model="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    reward_funcs=["ocr"],
    tiny="wan",
    output_dir="wan-ocr",
    dataset=None,  # prompts naming the text to render, such as Flow-GRPO's dataset/ocr: --dataset_name
    prompt_column="prompt",
)  # pytorch_lora_weights.safetensors: WanPipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
