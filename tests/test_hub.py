"""What reaches the Hub, recorded offline: every checkpoint push carries the weights and the card (never the
checkpoint or staging folders), the card is written at every save with Hub-valid content, and a recipe's scheduler
travels with the weights."""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from datasets import Dataset
from diffusers import FluxPipeline
from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils._paths import DEFAULT_IGNORE_PATTERNS
from peft import LoraConfig

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

PROMPTS = ["a red circle", "a green square", "a blue circle", "a red square"]


def redness(prompts, images, **kwargs):
    return [float(np.asarray(im, dtype=np.float32)[..., 0].mean() / 255) for im in images]


class RecordingApi:
    """Stands in for ``HfApi``: records, for each ``upload_folder``, the repository paths it would upload (the
    folder's files filtered with huggingface_hub's own ``filter_repo_objects`` and default ignore patterns)."""

    def __init__(self):
        self.uploads: list[dict] = []

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, path_in_repo=None, ignore_patterns=None, run_as_future=False, **kw):
        root = Path(folder_path)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        patterns = list(ignore_patterns or []) + DEFAULT_IGNORE_PATTERNS
        kept = sorted(filter_repo_objects(files, ignore_patterns=patterns))
        prefix = f"{path_in_repo}/" if path_in_repo else ""
        card = root / "README.md"
        self.uploads.append(
            {
                "repo_id": repo_id,
                "files": [prefix + f for f in kept],
                "card": card.read_text() if card.is_file() else None,
                "message": kw.get("commit_message"),
            }
        )
        if run_as_future:
            future = concurrent.futures.Future()
            future.set_result(None)
            return future
        return None


@pytest.fixture
def hub(monkeypatch) -> RecordingApi:
    import transformers.trainer

    api = RecordingApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: api)
    return api


def make_trainer(path, tmp_path, *, lora=True, **overrides) -> DDPOJaggTrainer:
    kwargs = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=2, learning_rate=1e-2, epsilon=1e-1, jagg_group_size=3, jagg_frac=1.0,
        max_sequence_length=16, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    kwargs.update(overrides)
    torch.manual_seed(0)
    return DDPOJaggTrainer(
        model=path,
        reward_funcs=redness,
        args=GRPOJaggConfig(**kwargs),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]) if lora else None,
    )


def card_metadata(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_every_checkpoint_push_carries_the_weights_and_the_card(tiny_flux_path, tmp_path, hub, lora):
    trainer = make_trainer(
        tiny_flux_path, tmp_path, lora=lora, push_to_hub=True, hub_model_id="me/flux-grpo", save_strategy="steps",
        save_steps=1, eval_prompts=["a red circle"], image_log_steps=1,
    )  # fmt: skip
    stale = tmp_path / "out" / "tmp-checkpoint-99"  # a staging folder left by an interrupted save
    stale.mkdir(parents=True)
    (stale / "pytorch_lora_weights.safetensors").write_bytes(b"partial")
    trainer.train()
    pushes = [u for u in hub.uploads if u["message"].startswith("Training in progress")]
    assert [u["message"] for u in pushes] == ["Training in progress, step 1", "Training in progress, step 2"]
    weights = ["pytorch_lora_weights.safetensors"] if lora else ["config.json", "diffusion_pytorch_model.safetensors"]
    for push in pushes:
        files = push["files"]
        assert push["repo_id"] == "me/flux-grpo"
        assert {*weights, "README.md", "scheduler/scheduler_config.json", "training_args.bin"} <= set(files)
        assert "samples/latest/0.png" in files  # the widget's image
        assert not [f for f in files if f.startswith(("checkpoint-", "tmp-checkpoint-"))], files
        assert "- trl-jagg" in push["card"] and "samples/latest/0.png" in push["card"]
    # The card is written at every save: in each checkpoint and in output_dir.
    for folder in ("checkpoint-1", "checkpoint-2", ""):
        assert (tmp_path / "out" / folder / "README.md").is_file()
    # The pushed weights are the checkpoint's, not an earlier save's.
    name = weights[-1]
    assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "out" / "checkpoint-2" / name).read_bytes()

    hub.uploads.clear()
    trainer.push_to_hub(dataset_name="me/prompts")
    (final,) = hub.uploads
    assert {*weights, "README.md", "scheduler/scheduler_config.json"} <= set(final["files"])
    assert not [f for f in final["files"] if f.startswith(("checkpoint-", "tmp-checkpoint-"))]
    assert card_metadata(final["card"])["datasets"] == ["me/prompts"]


def test_hub_strategy_checkpoint_also_pushes_the_checkpoint_folder(tiny_flux_path, tmp_path, hub):
    trainer = make_trainer(
        tiny_flux_path, tmp_path, max_steps=1, push_to_hub=True, hub_model_id="me/x", save_strategy="steps",
        save_steps=1, hub_strategy="checkpoint",
    )  # fmt: skip
    trainer.train()
    checkpoint = next(u for u in hub.uploads if u["message"].endswith(", checkpoint"))
    assert "last-checkpoint/pytorch_lora_weights.safetensors" in checkpoint["files"]
    assert "last-checkpoint/optimizer.pt" in checkpoint["files"]  # resumable from the Hub


def test_model_card_content(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=1, eval_prompts=["a red circle"], image_log_steps=1)
    trainer.train()
    trainer.save_model()
    card = (tmp_path / "out" / "README.md").read_text()
    data = card_metadata(card)
    # A local base pipeline is no Hub id: no base_model (it would render as a broken Hub link), no license guess; the
    # snippet loads the directory the run loaded (issue 41), on the device it trained on (the CPU: no `.to(...)`).
    assert "base_model" not in data and "license" not in data and f'.from_pretrained("{tiny_flux_path}"' in card
    assert ".to(" not in card
    assert {"flux", "lora", "trl", "grpo", "diffusers", "text-to-image"} <= set(data["tags"])
    assert {"diffusers-training", "template:sd-lora"} <= set(data["tags"])  # diffusers' LoRA training cards' tags
    # As TRL's cards: the framework versions that trained it and the citations (GRPO's paper, TRL).
    for name, distribution in [("Diffusers", "diffusers"), ("TRL", "trl"), ("PyTorch", "torch"), ("PEFT", "peft")]:
        assert f"- {name}: {importlib.metadata.version(distribution)}\n" in card
    assert "arXiv:2402.03300" in card and "@software{vonwerra2020trl" in card and "arXiv:2607.17572" in card
    # The card's link to trl_jagg is pyproject's repository URL.
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    (repository,) = re.findall(r'^Repository = "(.+)"$', pyproject, flags=re.M)  # tomllib needs Python 3.11
    assert f"[trl_jagg]({repository})" in card
    assert data["library_name"] == "diffusers" and data["pipeline_tag"] == "text-to-image"
    assert data["widget"] == [{"text": "a red circle", "output": {"url": "samples/latest/0.png"}}]
    assert "torch_dtype" not in card and "dtype=torch.float32" in card
    call = (
        "    num_inference_steps=4,\n    height=32,\n    width=32,\n    guidance_scale=3.5,\n    true_cfg_scale=1.0,\n"
    )
    assert call in card
    # With a Hub id as base: base_model, the relation and the base model's license.
    trainer.base_model_id = "black-forest-labs/FLUX.1-dev"
    trainer.create_model_card()
    data = card_metadata((tmp_path / "out" / "README.md").read_text())
    assert (data["base_model"], data["base_model_relation"]) == ("black-forest-labs/FLUX.1-dev", "adapter")
    assert (data["license"], data["license_name"]) == ("other", "flux-1-dev-non-commercial-license")


def test_usage_snippet_runs_and_reproduces_the_trained_model(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    (snippet,) = re.findall(r"```python\n(.*?)```", (out / "README.md").read_text(), flags=re.S)
    # The one documented substitution: the placeholders for the base pipeline and the repository, and the CPU.
    assert "# The base was a local FluxPipeline (no Hub id)" in snippet  # said, instead of a bare placeholder
    code = snippet.replace("path/to/the/local/base/pipeline", tiny_flux_path).replace('"out"', f'"{out}"')
    code = code.replace('.to("cuda")', "")
    code = code.replace('"a photo of a red fox in the snow",', '"a red circle", generator=g,')
    namespace = {"g": torch.Generator().manual_seed(3)}
    exec(compile(code, "README.md", "exec"), namespace)
    expected = trainer.sample_images(["a red circle"], seed=3)[0]
    diff = np.abs(np.asarray(namespace["image"], dtype=np.int16) - np.asarray(expected, dtype=np.int16))
    assert diff.max() <= 1  # uint8 rounding only


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_with_ema_the_snippet_loads_the_weights_that_rendered_the_widget(tiny_flux_path, tmp_path, monkeypatch, lora):
    """The widget's image (rendered with the EMA weights at the last logging step) against the image of the card's
    snippet, run on the pushed folder served from a Hugging Face cache (the Hub's own `subfolder` path); and the
    weights the card points to at the repository root against the trained model's."""
    import shutil

    import huggingface_hub.constants
    from PIL import Image

    trainer = make_trainer(
        tiny_flux_path, tmp_path, lora=lora, max_steps=2, learning_rate=0.1 if lora else 1e-2, ema_decay=0.9,
        ema_warmup=False, eval_prompts=["a red circle"], image_log_steps=1, eval_seed=5,
    )  # fmt: skip
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    card = (out / "README.md").read_text()
    [widget] = card_metadata(card)["widget"]
    shown = np.asarray(Image.open(out / widget["output"]["url"]).convert("RGB"), dtype=np.int16)
    assert "drop `ema` from `subfolder`" in card  # the card says where the other weights are
    repo = tmp_path / "hub" / "models--you--ema-run"
    shutil.copytree(out, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    code = snippet.replace("path/to/the/local/base/pipeline", tiny_flux_path).replace('.to("cuda")', "")
    code = code.replace('"out"', '"you/ema-run"')  # the repository the folder was pushed to
    code = code.replace('"a photo of a red fox in the snow",', f"{widget['text']!r}, generator=g,")

    def render(code: str) -> np.ndarray:
        namespace = {"g": torch.Generator().manual_seed(5)}
        exec(compile(code, "README.md", "exec"), namespace)
        return np.asarray(namespace["image"], dtype=np.int16)

    assert np.abs(render(code) - shown).max() <= 1  # uint8 rounding only
    # The root holds the last step's weights: what the trainer renders without its EMA; they differ from the widget.
    raw = render(code.replace(', subfolder="ema"', ""))
    model = trainer.accelerator.unwrap_model(trainer.model)
    expected = np.asarray(trainer.evaluator.sample_images(model, None, ["a red circle"], 5)[0], dtype=np.int16)
    assert np.abs(raw - expected).max() <= 1
    assert np.abs(raw - shown).max() > 8  # the test tells the two sets of weights apart


@pytest.mark.parametrize(
    ("pipeline_class", "task", "family"),
    [
        ("FluxPipeline", "text-to-image", "flux"),
        ("WanPipeline", "text-to-video", "wan"),
        ("FluxKontextPipeline", "image-to-image", "flux-kontext"),
        ("QwenImageEditPlusPipeline", "image-to-image", "qwen-image-edit"),
    ],
)
def test_card_tags_follow_the_task_and_the_family(tmp_path, pipeline_class, task, family):
    from trl_jagg.trainer.model_card import write_model_card

    args = GRPOJaggConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, report_to="none")
    write_model_card(
        str(tmp_path), base_model=None, pipeline_class=pipeline_class, transformer_class="Transformer", is_lora=True,
        args=args, reward_names=["redness"], tags=DDPOJaggTrainer._tag_names, guidance_is_cfg=False,
        embedded_guidance=False, task=task,
    )  # fmt: skip
    data = card_metadata((tmp_path / "README.md").read_text())
    tags = set(data["tags"])
    assert data["pipeline_tag"] == task and {task, family, "lora"} <= tags
    assert not tags & ({"text-to-image", "image-to-image", "text-to-video"} - {task})
    # The Hub's LoRA page template shows text-to-image widgets: only those cards take it.
    assert ("template:sd-lora" in tags) == (task == "text-to-image")


def test_qwenimage_card_keeps_true_cfg_and_the_negative_prompt(tiny_qwenimage_path, tmp_path):
    trainer = make_trainer(tiny_qwenimage_path, tmp_path, true_cfg_scale=4.0, negative_prompt=" ", guidance_scale=1.0)
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    # Without a negative prompt QwenImagePipeline silently samples without CFG: the snippet passes both.
    assert "    true_cfg_scale=4.0,\n    negative_prompt=' ',\n" in card
    assert "QwenImagePipeline" in card and "- qwen-image" in card


def test_recipe_scheduler_is_saved_and_reproduces_training_sampling(tiny_flux_path, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from trl_jagg.scripts.train import build_trainer, parse_train_args

    out = tmp_path / "out"
    flags = ["--recipe", "dancegrpo-flux", "--model_name_or_path", tiny_flux_path, "--prompts", "a red circle"]
    flags += ["--reward_funcs", "prompt_color", "--output_dir", str(out), "--use_peft", "--lora_r", "4"]
    flags += ["--per_device_train_batch_size", "2", "--num_generations", "2", "--gradient_accumulation_steps", "1"]
    flags += ["--steps_per_generation", "1"]
    flags += ["--height", "32", "--width", "32", "--num_inference_steps", "4", "--max_sequence_length", "16"]
    flags += ["--max_steps", "1", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    trainer = build_trainer(*parse_train_args(flags))
    trainer.train()
    trainer.save_model()
    saved = FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    assert saved.config.shift == 3.0 and not saved.config.use_dynamic_shifting
    assert (
        'FlowMatchEulerDiscreteScheduler.from_pretrained("out", subfolder="scheduler")'
        in (out / "README.md").read_text()
    )

    def render(pipe):
        return pipe(
            "a red circle", height=32, width=32, num_inference_steps=4, max_sequence_length=16,
            generator=torch.Generator().manual_seed(3),
        ).images[0]  # fmt: skip

    pipe = FluxPipeline.from_pretrained(tiny_flux_path)
    pipe.load_lora_weights(out)
    without = np.asarray(render(pipe), dtype=np.int16)
    pipe.scheduler = saved
    with_scheduler = np.asarray(render(pipe), dtype=np.int16)
    expected = np.asarray(trainer.sample_images(["a red circle"], seed=3)[0], dtype=np.int16)
    assert np.abs(with_scheduler - expected).max() <= 1  # the training-time schedule, up to uint8 rounding
    assert np.abs(without - expected).max() > 1  # the base schedule samples something else


def test_scheduler_line_only_when_the_recipe_changed_it(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path)
    assert not trainer.scheduler_overridden
    trainer.create_model_card()
    assert 'subfolder="scheduler"' not in (tmp_path / "out" / "README.md").read_text()
