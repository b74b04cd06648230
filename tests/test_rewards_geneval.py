"""The GenEval-style reward: GenEval's rules checked by hand on given detections (presence, counting, colour,
position, two objects, exclude), the greedy NMS against torchvision's, and the whole reward on a tiny random OWLv2
and CLIP built from config (the count compared with transformers' own post-processing and torchvision's NMS)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

import trl_jagg.rewards as rewards
from trl_jagg.rewards.geneval import COLORS, geneval_score, greedy_nms, relative_position
from trl_jagg.testing.tiny_rewards import save_tiny_geneval_models

LEFT, RIGHT = (0, 0, 10, 10), (30, 0, 40, 10)


def no_colors(name, boxes):
    raise AssertionError("no colour clause here")


def test_relative_position_by_hand():
    # Centres 30 px apart on x, sizes 10 + 10: revised offset -(30 - 0.1 * 20) = -28, over |offset| 30 < -0.5.
    assert relative_position(LEFT, RIGHT) == {"left of"} and relative_position(RIGHT, LEFT) == {"right of"}
    assert relative_position((0, 0, 10, 10), (0, 30, 10, 40)) == {"above"}
    # 30 px right and 30 px down: each axis 28 / 42.4 = 0.66 > 0.5.
    assert relative_position((30, 30, 40, 40), LEFT) == {"right of", "below"}
    assert relative_position((0, 0, 10, 10), (1, 1, 11, 11)) == set()  # within 0.1 x sizes: no relation


@pytest.mark.parametrize(
    ("include", "boxes", "colors", "expected"),
    [
        ([{"class": "cat", "count": 1}], {"cat": [LEFT]}, None, (1.0, True)),
        ([{"class": "cat", "count": 1}], {}, None, (0.0, False)),
        ([{"class": "cat", "count": 3}], {"cat": [LEFT, RIGHT]}, None, (1 - 1 / 3, False)),
        ([{"class": "cat", "count": 1}], {"cat": [LEFT, RIGHT, LEFT]}, None, (1 - 2, False)),
        ([{"class": "cat", "count": 1, "color": "red"}], {"cat": [LEFT]}, ["red"], (1.0, True)),
        ([{"class": "cat", "count": 1, "color": "red"}], {"cat": [LEFT]}, ["blue"], ((1 + 0) / 2, False)),
        ([{"class": "cat", "count": 2, "color": "red"}], {"cat": [LEFT]}, None, ((0.5 + 0) / 2, False)),
        (
            [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
            {"dog": [RIGHT], "cat": [LEFT]}, None, (1.0, True),
        ),
        (
            [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
            {"dog": [LEFT], "cat": [RIGHT]}, None, ((1 + 1 + 0) / 3, False),
        ),
        (  # the target clause failed: no target, position 0
            [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["left of", 0]}],
            {"cat": [LEFT]}, None, ((0 + 1 + 0) / 3, False),
        ),
        ([{"class": "cat", "count": 1}, {"class": "bench", "count": 1}], {"cat": [LEFT]}, None, (0.5, False)),
    ],
)  # fmt: skip
def test_geneval_rules_by_hand(include, boxes, colors, expected):
    score, correct = geneval_score(boxes, {"include": include}, no_colors if colors is None else lambda n, b: colors)
    assert (score, correct) == (pytest.approx(expected[0]), expected[1])


def test_exclude_clauses_break_strict_correctness_only():
    metadata = {"include": [{"class": "cat", "count": 1}], "exclude": [{"class": "cat", "count": 2}]}
    assert geneval_score({"cat": [LEFT]}, metadata, no_colors) == (1.0, True)
    assert geneval_score({"cat": [LEFT, RIGHT]}, metadata, no_colors) == (pytest.approx(0.0), False)


def test_greedy_nms_matches_torchvision():
    torchvision = pytest.importorskip("torchvision")
    generator = torch.Generator().manual_seed(0)
    corners = torch.rand(40, 2, generator=generator) * 50
    boxes = torch.cat([corners, corners + 5 + torch.rand(40, 2, generator=generator) * 20], dim=1)
    scores = torch.rand(40, generator=generator)
    assert greedy_nms(boxes, scores, 0.5) == torchvision.ops.nms(boxes, scores, 0.5).tolist()


@pytest.fixture(scope="module")
def tiny_geneval_dirs(tmp_path_factory):
    return save_tiny_geneval_models(tmp_path_factory.mktemp("geneval"))


def test_geneval_reward_on_tiny_random_models(tiny_geneval_dirs):
    from transformers import AutoProcessor, Owlv2ForObjectDetection

    torchvision = pytest.importorskip("torchvision")
    detector_dir, clip_dir = tiny_geneval_dirs
    reward = rewards.load_reward_funcs("geneval", detector_id=detector_dir, clip_id=clip_dir, device="cpu")[0]
    image = Image.new("RGB", (48, 32), (200, 30, 30))
    include = [[{"class": "cat", "count": 1}], [{"class": "cat", "count": 1, "color": "red"}]]
    scores = reward(["a photo of a cat"] * 2, [image, image], tag=["single_object", "colors"], include=include)

    # The count by transformers' post-processing (boxes in the padded square) and torchvision's NMS.
    processor, model = (
        AutoProcessor.from_pretrained(detector_dir),
        Owlv2ForObjectDetection.from_pretrained(detector_dir),
    )
    inputs = processor(text=[["a photo of a cat"]], images=image, return_tensors="pt")
    with torch.no_grad():
        outputs = model(**inputs)
    (found,) = processor.image_processor.post_process_object_detection(outputs, threshold=0.2, target_sizes=[(48, 48)])
    count = len(torchvision.ops.nms(found["boxes"].clamp(min=0), found["scores"], 0.5)) if len(found["scores"]) else 0
    assert scores[0] == pytest.approx(1 - abs(1 - count))
    assert scores[1] == pytest.approx((1 - abs(1 - count)) / 2 if count != 1 else scores[1])
    crops = reward.colors_of(image, "cat", [(0, 0, 20, 20), (10, 5, 40, 30)])
    assert len(crops) == 2 and set(crops) <= set(COLORS)
    with pytest.raises(ValueError, match="'tag' and 'include'"):
        reward(["a cat"], [image])


CAT = {"class": "cat", "count": 1}


class Columns(dict):
    """A dataset's columns as the reward's check reads them (``column_names``, ``dataset[column]``): pyarrow cannot
    hold the mixed types of bad rows, which a JSON-lines file loaded with ``datasets`` does."""

    @property
    def column_names(self) -> list[str]:
        return list(self)

    def __len__(self) -> int:
        return len(self["prompt"])


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ({"include": []}, "'include'", "non-empty list"),
        ({"include": None}, "'include'", "non-empty list"),
        ({"include": [CAT, {"class": "dog", "count": 1, "position": ["left of", 1]}]}, "'include[1].position'",
         "names clause 1, which is not an earlier include clause (0..0)"),
        ({"include": [{"class": "dog", "count": 1, "position": ["left of", 3]}]}, "'include[0].position'",
         "names clause 3"),
        ({"include": [CAT, {"class": "dog", "count": 1, "position": ["near", 0]}]}, "'include[1].position'",
         "relation one of"),
        ({"include": [{"class": "cat", "count": 1, "color": "mauve"}]}, "'include[0].color'", "'mauve', not one of"),
        ({"include": [{"class": "cat", "count": 0}]}, "'include[0].count'", "is 0"),
        ({"include": [{"class": "cat", "count": "2"}]}, "'include[0].count'", "is '2'"),
        ({"include": [{"class": "cat", "count": True}]}, "'include[0].count'", "is True"),
        ({"include": [{"count": 1}]}, "'include[0].class'", "is None"),
        ({"include": ["cat"]}, "'include[0]'", "not a mapping"),
        ({"include": [CAT], "exclude": [{"class": "dog"}]}, "'exclude[0].count'", "is None"),
        ({"include": [CAT], "exclude": "dog"}, "'exclude'", "not a list"),
        ({"include": [CAT], "tag": 3}, "'tag'", "is 3"),
    ],
)  # fmt: skip
def test_bad_metadata_is_refused_naming_the_row_and_the_field(row, field, problem):
    """Each was scored 0 for every image, or failed at the first scoring with a bare TypeError."""
    from trl_jagg.rewards.geneval import GenEvalReward

    good = {"tag": "single_object", "include": [CAT], "exclude": None}
    rows = [good, {**good, **row}]
    dataset = Columns({"prompt": ["a", "b"], **{key: [r[key] for r in rows] for key in good}})
    reward = GenEvalReward(detector_id="unused", clip_id="unused")  # nothing loads before the first scoring
    with pytest.raises(ValueError) as caught:
        reward.check_dataset(dataset, name="train_dataset", edits_images=False)
    message = str(caught.value)
    assert f"train_dataset row 1: GenEval metadata {field}" in message and problem in message, message
    # Called directly, the same row is refused before any model loads (the models named do not exist).
    with pytest.raises(ValueError, match=f"sample 1: GenEval metadata {field.replace('[', '.').replace(']', '.')}"):
        reward(["a", "b"], [Image.new("RGB", (8, 8))] * 2, **{key: [r[key] for r in rows] for key in good})


def test_metadata_columns_are_required_and_valid_rows_pass(tmp_path):
    from datasets import Dataset, load_dataset

    from trl_jagg.rewards.geneval import GenEvalReward

    reward = GenEvalReward(detector_id="unused", clip_id="unused")
    with pytest.raises(ValueError, match="eval_dataset has no 'tag' or 'include' column"):
        reward.check_dataset(Dataset.from_dict({"prompt": ["a"]}), name="eval_dataset", edits_images=False)
    rows = [  # as GenEval's evaluation_metadata.jsonl writes them
        {"tag": "position", "prompt": "a dog right of a cat",
         "include": [CAT, {"class": "dog", "count": 1, "position": ["right of", 0]}]},
        {"tag": "colors", "prompt": "a red cat", "include": [{**CAT, "color": "red"}], "exclude": [{**CAT, "count": 2}]},
    ]  # fmt: skip
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = load_dataset("json", data_files=str(tmp_path / "metadata.jsonl"), split="train")
    reward.check_dataset(dataset, name="train_dataset", edits_images=False)
    # A column of clauses built from dicts gives the keys a clause lacks as None: absent, not a colour.
    dataset = Dataset.from_dict({"prompt": ["a"], "tag": ["colors"], "include": [[CAT, {**CAT, "color": "red"}]]})
    assert dataset["include"][0][0]["color"] is None
    reward.check_dataset(dataset, name="train_dataset", edits_images=False)
    assert geneval_score({"cat": [LEFT]}, {"include": [{"class": "cat", "count": 1, "color": None}]}, no_colors) == (
        1.0,
        True,
    )
