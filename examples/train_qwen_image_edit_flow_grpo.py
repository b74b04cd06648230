"""GRPO on Qwen-Image-Edit (Flow-GRPO's counting-edit recipe): LoRA, true CFG 4, JAGG on the high-noise groups.

The `flow-grpo-qwenimage-edit` preset (trl_jagg/recipes/, docs/models.md): 10 steps, SDE a = 1.0 on every step but
the last, G = 16, LoRA r 64 / alpha 128 on attention and MLPs, the GenEval reward (Flow-GRPO adds 0.2 of an image
similarity reward, which trl_jagg does not have). The dataset is Flow-GRPO's dataset/counting_edit: JSON lines with
an instruction (`prompt`), the image it edits (`image`, a path relative to the file) and GenEval's metadata.

    accelerate launch --config_file fsdp.yaml examples/train_qwen_image_edit_flow_grpo.py \\
        --dataset_name counting_edit/train_metadata.jsonl
    python examples/train_qwen_image_edit_flow_grpo.py --tiny --output_dir /tmp/qwen-edit-tiny   # CPU, seconds
"""

from trl_jagg.scripts.examples import COUNTING_EDIT, Example

EXAMPLE = Example(
    __file__,
    recipe="flow-grpo-qwenimage-edit",
    model="Qwen/Qwen-Image-Edit",
    tiny="qwenimage_edit",
    output_dir="qwen-image-edit-geneval",  # rewards: the preset's
    **COUNTING_EDIT,  # Flow-GRPO's dataset/counting_edit/train_metadata.jsonl: --dataset_name <its path>
)  # pytorch_lora_weights.safetensors: QwenImageEditPipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
