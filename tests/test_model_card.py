"""Model cards of local runs load what they show: the EMA snippet's local line loads the EMA weights (the widget's
pixels) from the folder the run saved to, rewards and weight-0 diagnostics are listed apart, and sample-grid
captions are wrapped to their tile instead of cut."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from PIL import Image, ImageDraw

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.trainer.image_logging import CAPTION_LINE_HEIGHT, image_grid, wrap_caption
from trl_jagg.trainer.model_card import rewards_text


def redness(prompts, images, **kwargs):
    return [float(np.asarray(im, dtype=np.float32)[..., 0].mean() / 255) for im in images]


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_the_ema_snippet_loads_the_widget_weights_from_the_local_folder(tiny_flux_path, tmp_path, monkeypatch, lora):
    import yaml

    out = tmp_path / "out"
    torch.manual_seed(0)
    trainer = DDPOJaggTrainer(
        model=tiny_flux_path,
        reward_funcs=redness,
        args=GRPOJaggConfig(
            output_dir=str(out),
            per_device_train_batch_size=4,
            num_generations=2,
            num_inference_steps=4,
            height=32,
            width=32,
            max_steps=2,
            learning_rate=0.1 if lora else 1e-2,
            epsilon=1e-1,
            jagg_group_size=3,
            jagg_frac=1.0,
            max_sequence_length=16,
            report_to="none",
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
            ema_decay=0.9,
            ema_warmup=False,
            eval_prompts=["a red circle"],
            image_log_steps=1,
            eval_seed=5,
        ),  # fmt: skip
        train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square"]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]) if lora else None,
    )
    trainer.train()
    trainer.save_model()
    card = (out / "README.md").read_text()
    [widget] = yaml.safe_load(card.split("---\n")[1])["widget"]
    shown = np.asarray(Image.open(out / widget["output"]["url"]).convert("RGB"), dtype=np.int16)
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    # The card's own local line in place of the Hub one (the only edit besides the prompt and its seed).
    lines = snippet.splitlines()
    (i,) = [i for i, line in enumerate(lines) if line.startswith("# from the local folder: ")]
    assert 'subfolder="ema"' in lines[i + 1]  # the Hub line it stands for
    lines[i : i + 2] = [lines[i].removeprefix("# from the local folder: ")]
    code = "\n".join(lines).replace('"a photo of a red fox in the snow",', f"{widget['text']!r}, generator=g,")
    assert f'"{out}/ema"' in code and ".to(" not in code  # the folder written to; the CPU it trained on
    namespace = {"g": torch.Generator().manual_seed(5)}
    exec(compile(code, "README.md", "exec"), namespace)
    assert np.abs(np.asarray(namespace["image"], dtype=np.int16) - shown).max() <= 1  # uint8 rounding only
    # The root weights (what the old line loaded from a local folder) render another image: the test can fail.
    raw = code.replace(f'"{out}/ema"', f'"{out}"')
    namespace = {"g": torch.Generator().manual_seed(5)}
    exec(compile(raw, "README.md", "exec"), namespace)
    assert np.abs(np.asarray(namespace["image"], dtype=np.int16) - shown).max() > 8


def test_weight_zero_rewards_are_listed_as_diagnostics():
    text = rewards_text(["prompt_color", "color_accuracy", "shape"], [1.0, 0.0, 0.0])
    trained, logged = text.split(". ")
    assert trained == "prompt_color" and logged.endswith(": color_accuracy, shape")
    assert rewards_text(["a", "b"], [0.4, 0.6]) == "a (weight 0.4), b (weight 0.6)"
    assert rewards_text(["a", "b"], None) == "a, b"


def test_captions_wrap_to_their_tile_and_keep_every_character():
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    caption = "a red circle on a supercalifragilistic field"
    lines = wrap_caption(caption, 30, draw)
    assert all(draw.textlength(line) <= 30 for line in lines)
    assert "".join(lines).replace(" ", "") == caption.replace(" ", "")  # broken at spaces, nothing dropped
    images = [Image.new("RGB", (32, 32), "red")] * 3
    grid = image_grid(images, ["a red circle", "ok", caption], columns=3)
    tallest = len(wrap_caption(caption, 32 - 2, draw))
    assert grid.size == (3 * 32, 32 + tallest * CAPTION_LINE_HEIGHT + 1)
