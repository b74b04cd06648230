"""Inputs that cannot train as asked are refused when the trainer is built, before the first rollout, by an error
naming the field and the fix: data a text-to-image model would ignore, rewards the model or the prompts cannot
feed, and arguments of the wrong kind (tiny Flux pipeline, offline)."""

from __future__ import annotations

import re

import pytest
from datasets import Dataset
from testing_utils import noise_image, redness

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.rewards import LazyModelReward, load_reward_funcs

PROMPTS = ['a sign that says "OPEN"', 'a mug that says "TEA"']


def build(path, tmp_path, *, train=None, eval_dataset=None, reward_funcs=redness, **overrides) -> DDPOJaggTrainer:
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, height=32, width=32,
                  num_inference_steps=2, max_sequence_length=16, report_to="none", use_jagg=False)  # fmt: skip
    return DDPOJaggTrainer(
        model=path, reward_funcs=reward_funcs, args=GRPOJaggConfig(**config | overrides),
        train_dataset=train if train is not None else Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=eval_dataset,
    )  # fmt: skip


@pytest.fixture
def reward_weights_reachable(monkeypatch):
    """The offline test cache holds no reward weights, and their check runs first; tests of the dataset checks that
    follow it treat the weights as reachable (tests/test_hub_access.py covers the weight check itself)."""
    monkeypatch.setattr(LazyModelReward, "check_weights", lambda self: None)


@pytest.mark.parametrize("split", ["train_dataset", "eval_dataset"])
def test_a_source_image_column_on_a_text_to_image_model_is_refused(tiny_flux_path, tmp_path, split):
    with_images = Dataset.from_dict({"prompt": PROMPTS, "source_image": [noise_image(0, 32)] * 2})
    datasets = {"train": with_images} if split == "train_dataset" else {"eval_dataset": with_images}
    with pytest.raises(
        ValueError,
        match=f"{split} has a 'source_image' column, but FluxAdapter trains from text only: "
        "image conditioning is not supported, so the images would be ignored. Drop the column",
    ):
        build(tiny_flux_path, tmp_path, **datasets)


def test_an_edit_reward_on_a_text_to_image_model_is_refused(tiny_flux_path, tmp_path, reward_weights_reachable):
    with pytest.raises(ValueError, match="Reward 'clip-edit' scores edits against their source images, but the model "
                       "generates from text only"):  # fmt: skip
        build(tiny_flux_path, tmp_path, reward_funcs=["pickscore", "clip-edit"])


def test_edit_reward_caption_columns_come_in_pairs():
    (reward,) = load_reward_funcs("clip-edit")
    both = Dataset.from_dict({"prompt": ["x"], "source_caption": ["a"], "target_caption": ["b"]})
    reward.check_dataset(both, name="train_dataset", edits_images=True)
    with pytest.raises(ValueError, match="train_dataset has only one of the 'source_caption' and 'target_caption'"):
        reward.check_dataset(both.remove_columns("target_caption"), name="train_dataset", edits_images=True)


@pytest.mark.parametrize(
    ("split", "prompt"), [("train_dataset", "a sign that says OPEN"), ("eval_dataset", 'a blank sign " "')]
)
def test_ocr_prompts_without_quoted_text_are_refused(tiny_flux_path, tmp_path, split, prompt):
    bad = Dataset.from_dict({"prompt": [PROMPTS[0], prompt]})
    datasets = {"train": bad} if split == "train_dataset" else {"eval_dataset": bad}
    with pytest.raises(ValueError, match=f"{split} row 1 'prompt' quotes no text to render"):
        build(tiny_flux_path, tmp_path, reward_funcs="ocr", **datasets)


@pytest.mark.parametrize("reward_funcs", [None, []])
def test_missing_reward_funcs_are_named(tiny_flux_path, tmp_path, reward_funcs):
    with pytest.raises(ValueError, match=re.escape(f"`reward_funcs` is {reward_funcs}: give a reward name")):
        build(tiny_flux_path, tmp_path, reward_funcs=reward_funcs)


def test_an_empty_eval_dataset_is_named_as_such(tiny_flux_path, tmp_path):
    with pytest.raises(ValueError, match="eval_dataset holds no prompts: an evaluation would score nothing"):
        build(tiny_flux_path, tmp_path, eval_dataset=Dataset.from_dict({"prompt": []}))


def test_a_scalar_eval_prompts_names_the_field(tmp_path):
    with pytest.raises(TypeError, match="GRPOJaggConfig.eval_prompts is int 5, not a list of prompts"):
        GRPOJaggConfig(output_dir=str(tmp_path), eval_prompts=5)
    assert GRPOJaggConfig(output_dir=str(tmp_path), eval_prompts="a cat").eval_prompts == ["a cat"]  # one prompt


def test_the_cli_names_a_scalar_eval_prompts_and_an_empty_eval_file(tmp_path):
    from trl_jagg.scripts import train

    config = tmp_path / "recipe.yaml"
    config.write_text("model_name_or_path: x\nreward_funcs: prompt_color\nprompts: [a cat]\neval_prompts: 5\n")
    base = ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(train.UsageError, match="GRPOJaggConfig.eval_prompts is int 5, not a list of prompts"):
        train.parse_train_args(["--config", str(config), *base])
    (tmp_path / "held_out.json").write_text("[]")
    script_args, args = train.parse_train_args(
        ["--model_name_or_path", "x", "--reward_funcs", "prompt_color", "--prompts", "a", "--eval_strategy", "steps",
         "--eval_dataset_name", str(tmp_path / "held_out.json"), *base]
    )  # fmt: skip
    with pytest.raises(train.UsageError, match=r"eval_dataset_name .*held_out.json holds no prompts"):
        train.load_eval_dataset(script_args, args)


def test_geneval_metadata_is_checked_at_init(tiny_flux_path, tmp_path, reward_weights_reachable):
    """GenEval's `check_dataset` runs when the trainer is built: missing columns and bad rows are named."""
    geneval = load_reward_funcs("geneval", detector_id="not-loaded", clip_id="not-loaded")
    with pytest.raises(ValueError, match="train_dataset has no 'tag' or 'include' column"):
        build(tiny_flux_path, tmp_path, reward_funcs=geneval)
    include = [[{"class": "cat", "count": 1}], [{"class": "cat", "count": 1, "color": "mauve"}]]
    rows = Dataset.from_dict({"prompt": PROMPTS, "tag": ["colors"] * 2, "include": include})
    with pytest.raises(
        ValueError, match=re.escape("train_dataset row 1: GenEval metadata 'include[0].color' is 'mauve'")
    ):
        build(tiny_flux_path, tmp_path, train=rows, reward_funcs=geneval)
