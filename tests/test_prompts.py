"""Prompt and dataset inputs: checked row by row before the model loads; conversations reduced to the user text."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict, Features, IterableDataset, Value
from datasets import Image as HFImage
from peft import LoraConfig
from testing_utils import noise_image

import trl_jagg.trainer.ddpo_jagg_trainer as trainer_module
from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.models import load_adapter
from trl_jagg.trainer.backbone import prepare_backbone
from trl_jagg.utils.prompts import check_source_images, prompt_dataset, prompt_text, source_image


def test_strings_pass_unchanged():
    assert prompt_text("a red circle", "row 0") == "a red circle"


def test_conversation_gives_the_last_user_turn():
    conversation = [
        {"role": "system", "content": "You draw."},
        {"role": "user", "content": "a cat"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "a red circle"},
    ]
    assert prompt_text(conversation, "row 0") == "a red circle"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a red"}, {"type": "text", "text": "circle"}]}]
    assert prompt_text(parts, "row 0") == "a red circle"


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, "row 7 is NoneType None, not a prompt"),
        (1, "row 7 is int 1, not a prompt"),
        (["a", "b"], "row 7 is list"),
        ("", "row 7 is empty"),
        ("   ", "row 7 is empty"),
        ([{"role": "system", "content": "x"}], r"row 7 is a conversation without a user turn \(roles: \['system'\]\)"),
        ([{"role": "user", "content": 3}], "row 7: the user turn's content is int"),
        ([{"role": "user", "content": ""}], "row 7 is empty"),
    ],
    ids=["none", "int", "list", "empty", "blank", "no-user-turn", "bad-content", "empty-user-turn"],
)
def test_bad_prompts_name_the_row(value, match):
    with pytest.raises(ValueError, match=match):
        prompt_text(value, "row 7")


def test_dataset_rows_are_checked_with_their_index():
    with pytest.raises(ValueError, match="train_dataset row 2 'prompt' is NoneType"):
        prompt_dataset(Dataset.from_dict({"prompt": ["a", "b", None, "d"]}), 2)
    with pytest.raises(ValueError, match="train_dataset row 0 'prompt' is int"):
        prompt_dataset(Dataset.from_dict({"prompt": [1, 2]}), 1)


def test_lists_are_converted():
    assert prompt_dataset(["a", "b"], 2)["prompt"] == ["a", "b"]
    records = prompt_dataset([{"prompt": "a", "target": 1}, {"prompt": "b", "target": 2}], 2)
    assert records.column_names == ["prompt", "target"] and records["target"] == [1, 2]
    with pytest.raises(ValueError, match=r"train_dataset\[1\] is NoneType"):
        prompt_dataset(["a", None], 1)


def test_streaming_dataset_dict_and_other_types_are_refused():
    streaming = IterableDataset.from_generator(lambda: iter([{"prompt": "a"}]))
    with pytest.raises(TypeError, match="streaming IterableDataset.*streaming=True.*take"):
        prompt_dataset(streaming, 1)
    with pytest.raises(TypeError, match=r"DatasetDict \(splits \['train'\]\).*dataset\['train'\]"):
        prompt_dataset(DatasetDict({"train": Dataset.from_dict({"prompt": ["a"]})}), 1)
    with pytest.raises(TypeError, match="train_dataset is a dict"):
        prompt_dataset({"prompt": ["a"]}, 1)


@pytest.mark.parametrize("size", [0, 3])
def test_too_few_prompts_say_how_many_a_rollout_needs(size):
    with pytest.raises(ValueError, match=f"train_dataset has {size} prompts?; one rollout needs 4"):
        prompt_dataset(Dataset.from_dict({"prompt": ["p"] * size}), 4)


@pytest.mark.parametrize("column", ["prompts", "images", "completions", "trainer_state"])
def test_columns_named_like_reward_keywords_are_refused_with_a_rename(column):
    dataset = Dataset.from_dict({"prompt": ["a", "b"], column: [1, 2]})
    with pytest.raises(ValueError, match=rf"eval_dataset has column\(s\) \['{column}'\].*rename_column\('{column}'"):
        prompt_dataset(dataset, 1, name="eval_dataset")
    with pytest.raises(ValueError, match=rf"\['{column}'\]"):
        prompt_dataset([{"prompt": "a", column: 1}], 1)


# ---------------------------------------------------------------- through the trainer: refused before loading
@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the model fails the test: the errors below must come first. The model given is a local folder
    (`tmp_path`), which passes the model's reachability check."""

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(trainer_module, "load_adapter", fail)


def make_args(tmp_path, **overrides) -> GRPOJaggConfig:
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, report_to="none")
    return GRPOJaggConfig(**{**values, **overrides})


def reward(prompts, images, **kwargs):
    return [0.0] * len(images)


@pytest.mark.parametrize(
    ("dataset", "error", "match"),
    [
        (Dataset.from_dict({"prompt": []}), ValueError, "has 0 prompts; one rollout needs 2"),
        (Dataset.from_dict({"prompt": ["a"]}), ValueError, "has 1 prompt; one rollout needs 2"),
        (Dataset.from_dict({"prompt": ["a", None]}), ValueError, "row 1 'prompt' is NoneType"),
        (Dataset.from_dict({"text": ["a", "b"]}), ValueError, "no 'prompt' column"),
        (IterableDataset.from_generator(lambda: iter([{"prompt": "a"}])), TypeError, "streaming"),
        (Dataset.from_dict({"prompt": ["a", "b"], "images": [1, 2]}), ValueError, r"column\(s\) \['images'\]"),
        (Dataset.from_dict({"prompt": ["a", "b"], "completions": ["x", "y"]}), ValueError, "'completions'"),
    ],
    ids=["empty", "too-few", "none-row", "no-column", "streaming", "images-column", "completions-column"],
)
def test_trainer_refuses_bad_datasets_before_loading(tmp_path, no_model_load, dataset, error, match):
    with pytest.raises(error, match=match):
        DDPOJaggTrainer(str(tmp_path), reward, args=make_args(tmp_path), train_dataset=dataset)


@pytest.mark.parametrize(
    ("eval_dataset", "match"),
    [([{"text": "a"}], "eval_dataset has no 'prompt' column"), ([{"prompt": "a", "prompts": "b"}], "'prompts'")],
)
def test_trainer_refuses_a_bad_eval_dataset_before_loading(tmp_path, no_model_load, eval_dataset, match):
    with pytest.raises(ValueError, match=match):
        DDPOJaggTrainer(
            str(tmp_path), reward, args=make_args(tmp_path), train_dataset=["a", "b"], eval_dataset=eval_dataset
        )


def test_missing_resume_directory_is_refused_before_loading(tmp_path, no_model_load):
    (tmp_path / "checkpoint-2").mkdir()
    args = make_args(tmp_path, resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    with pytest.raises(RuntimeError, match=r"checkpoint-3'?: no such directory\. Checkpoints in .*checkpoint-2"):
        DDPOJaggTrainer(str(tmp_path), reward, args=args, train_dataset=["a", "b"])


@pytest.mark.parametrize("word", ["latest", "LAST", "true"])
def test_resume_from_the_latest_checkpoint_by_word_passes_the_input_checks(tmp_path, no_model_load, word):
    # The word is not a folder: the input checks let it through, and the model loading comes next.
    with pytest.raises(AssertionError, match="the model was loaded"):
        DDPOJaggTrainer(
            str(tmp_path), reward, args=make_args(tmp_path, resume_from_checkpoint=word), train_dataset=["a", "b"]
        )


def test_conversational_dataset_trains_on_the_user_text(tiny_flux_path, tmp_path):
    seen = []

    def record(prompts, images, **kwargs):
        seen.extend(prompts)
        return [0.0] * len(images)

    rows = [[{"role": "user", "content": text}] for text in ("a red circle", "a blue square")]
    trainer = DDPOJaggTrainer(
        tiny_flux_path, record, train_dataset=Dataset.from_dict({"prompt": rows}),
        args=make_args(tmp_path, num_inference_steps=3, height=32, width=32, max_steps=1, max_sequence_length=16,
                       jagg_group_size=2, save_strategy="no", disable_tqdm=True),
    )  # fmt: skip
    trainer.train()
    assert sorted(set(seen)) == ["a blue square", "a red circle"]


def test_lora_targets_that_match_nothing_are_named(tiny_flux_path, tmp_path):
    lora = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_kk", "to_vv"])
    with pytest.raises(ValueError, match=r"target_modules \['to_kk', 'to_vv'\] match no module.*did you mean 'to_k'"):
        DDPOJaggTrainer(tiny_flux_path, reward, args=make_args(tmp_path), train_dataset=["a", "b"], peft_config=lora)


@pytest.mark.parametrize("targets", [["all-linear"], "all-linear", ("ALL-LINEAR",)], ids=["list", "str", "tuple"])
def test_all_linear_lora_targets_every_linear_layer_of_the_backbone(tiny_flux_path, tmp_path, targets):
    # `--lora_target_modules all-linear` arrives as a list of one; peft's shorthand is the string.
    linear = {name for name, module in load_adapter(tiny_flux_path).transformer.named_modules()
              if type(module) is torch.nn.Linear}  # fmt: skip
    adapter = load_adapter(tiny_flux_path)
    prepare_backbone(adapter, make_args(tmp_path), LoraConfig(r=2, lora_alpha=2, target_modules=targets))
    adapted = {name for name, module in adapter.transformer.named_modules() if hasattr(module, "lora_A")}
    assert adapted == linear and len(linear) > 10


# ---------------------------------------------------------------- source images of editing datasets
def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_source_images_in_every_form_read_as_the_same_rgb_image(tmp_path):
    image = noise_image(0, size=8)
    path = tmp_path / "source.png"
    image.save(path)
    features = Features({"prompt": Value("string"), "source_image": HFImage()})
    cells = [image, str(path), path, _png(image), {"bytes": _png(image), "path": None}]
    dataset = Dataset.from_dict({"prompt": ["make it red"] * 2, "source_image": [image, str(path)]}, features=features)
    cells.append(dataset[0]["source_image"])  # what a datasets.Image column yields: a decoded PIL image
    for cell in cells:
        got = source_image(cell, "row 0")
        assert got.mode == "RGB" and np.array_equal(np.asarray(got), np.asarray(image)), type(cell)
    assert check_source_images(dataset, layout=lambda image: image.size) == [(8, 8), (8, 8)]  # each row's layout


@pytest.mark.parametrize(
    ("cell", "match"),
    [
        (None, "row 1 'source_image' is missing"),
        (3, "row 1 'source_image' is int, not an image"),
        (b"not an image", "row 1 'source_image' cannot be read as an image"),
        ("no/such/file.png", "row 1 'source_image' cannot be read as an image"),
        ("gray", r"row 1 'source_image' is a L image; editing models read RGB"),
        ("truncated", "row 1 'source_image' cannot be read as an image"),
    ],
)
def test_bad_source_image_is_a_clear_error(cell, match):
    if cell == "gray":
        cell = noise_image(0, size=8).convert("L")
    elif cell == "truncated":
        cell = _png(noise_image(0, size=64))[:200]
    with pytest.raises(ValueError, match=match):
        source_image(cell, "train_dataset row 1 'source_image'")


def test_dataset_validation_names_the_bad_row(tmp_path):
    good = tmp_path / "good.png"
    noise_image(0, size=8).save(good)
    dataset = Dataset.from_dict({"prompt": ["a", "b", "c"], "source_image": [str(good), str(good), "missing.png"]})
    with pytest.raises(ValueError, match="train_dataset row 2 'source_image' cannot be read"):
        check_source_images(dataset)


def test_editing_dataset_needs_the_source_image_column():
    dataset = Dataset.from_dict({"prompt": ["a", "b"], "image": [None, None]})
    with pytest.raises(ValueError, match="no 'source_image' column.*rename_column\\('image', 'source_image'\\)"):
        check_source_images(dataset)
    assert prompt_dataset(dataset, 2) is dataset  # text-to-image models ignore image columns
