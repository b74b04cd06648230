"""GRPO on FLUX.1 Kontext (image editing), Flow-GRPO's recipe: LoRA, embedded guidance 2.5, JAGG in the update.

The `flow-grpo-kontext` preset (trl_jagg/recipes/, docs/models.md): 6 sampling steps at 512 px, SDE a = 0.9,
groups of 21 edits of one (instruction, source image), LoRA r 64 / alpha 128 on attention, feed-forward and the
single blocks' MLP; rewards: CLIP image similarity to the source + GenEval counting, 0.5 each. JAGG as in the paper:
of the 5 trained steps, one JAGG group of W = 4. The dataset has `prompt` (the instruction), `source_image` and
GenEval's metadata columns (`tag`, `include`, `exclude`), e.g. Flow-GRPO's dataset/counting_edit as JSON lines.

    accelerate launch --num_processes 8 examples/train_flux_kontext_edit.py --dataset_name train_metadata.jsonl
    python examples/train_flux_kontext_edit.py --tiny --output_dir /tmp/kontext-tiny   # CPU smoke test, seconds
"""

from trl_jagg.scripts.examples import COUNTING_EDIT, Example

EXAMPLE = Example(
    __file__,
    recipe="flow-grpo-kontext",
    model="black-forest-labs/FLUX.1-Kontext-dev",
    tiny="flux_kontext",
    output_dir="flux-kontext-edit",  # rewards: the preset's
    **COUNTING_EDIT,  # Flow-GRPO's dataset/counting_edit/train_metadata.jsonl: --dataset_name <its path>
)  # pytorch_lora_weights.safetensors: FluxKontextPipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
