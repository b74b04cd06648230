"""GRPO on Wan2.2-T2V-A14B (two experts) with PickScore per frame (Flow-Factory's recipe): LoRA on both, JAGG.

The `flow-factory-wan2.2` preset (trl_jagg/recipes/flow_factory.py, docs/models.md): 5-frame 480x480 videos, 10
steps, CFG 4 on the high-noise expert `transformer` and 3 on the low-noise `transformer_2` (the pipeline's switch at
`boundary_ratio`), G = 16, LoRA r 64 / alpha 128 on both experts (`train_experts="both"`; or "high_noise" /
"low_noise"); JAGG groups of W = 4 on each side of the switch, never across it.

    accelerate launch --num_processes 8 examples/train_wan22_pickscore.py --dataset_name <prompts> --output_dir wan22
    python examples/train_wan22_pickscore.py --tiny --output_dir /tmp/wan22-tiny   # CPU smoke test
"""

from trl_jagg.scripts.examples import Example

EXAMPLE = Example(
    __file__,
    recipe="flow-factory-wan2.2",
    model="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    reward_funcs=["pickscore"],
    tiny="wan22",
    output_dir="wan22",
    dataset=None,  # Flow-Factory trains on dataset/pickscore: --dataset_name
    prompt_column="prompt",
)  # one folder per trained expert: pipe.load_lora_weights(f"{output_dir}/transformer")

if __name__ == "__main__":
    EXAMPLE.main()
