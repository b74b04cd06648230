"""The reward-hacking watch: its statistics against hand values, a gamed brightness reward that warns, the demo's
colour reward that does not, and the statistics reaching TensorBoard, W&B and trackio from a tiny run."""

from __future__ import annotations

import glob
import math
import os
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from testing_utils import PROMPTS, redness

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.rewards import prompt_color
from trl_jagg.testing.tiny_models import build_tiny_pipeline
from trl_jagg.trainer.hacking_watch import PREFIX, RewardHackingWarning, RewardHackingWatch, rollout_statistics

STATISTICS = ("diversity", "dark_fraction", "bright_fraction", "colour_entropy", "reward_spread")


def solid(rgb: tuple[float, float, float], size: int = 16) -> torch.Tensor:
    return torch.tensor(rgb).view(3, 1, 1).expand(3, size, size).clone()


def test_statistics_of_known_images():
    black, white = solid((0.0, 0.0, 0.0)), solid((1.0, 1.0, 1.0))
    half = torch.cat([black[:, :8], white[:, 8:]], dim=1)  # top half black, bottom half white
    stats = rollout_statistics(torch.stack([black, white, half, half]), [0.0, 2.0, 1.0, 1.0], ["a", "a", "b", "b"])
    # Group a: black vs white, RMS distance 1; group b: two equal images, 0.
    assert stats["diversity"] == pytest.approx(0.5)
    assert stats["dark_fraction"] == pytest.approx(0.5) and stats["bright_fraction"] == pytest.approx(0.5)
    assert stats["colour_entropy"] == pytest.approx(1.0)  # two colours, half the pixels each: one bit
    assert stats["reward_spread"] == pytest.approx(math.sqrt(2) / 2)  # std of (0, 2) is sqrt(2); of (1, 1) is 0


def rollouts_of(images_per_step, rewards_per_step, prompts):
    watch = RewardHackingWatch(metrics={})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (images, rewards) in enumerate(zip(images_per_step, rewards_per_step)):
            watch.observe(prompts, images, rewards, step)
    return watch, [w for w in caught if issubclass(w.category, RewardHackingWarning)]


@pytest.fixture(scope="module")
def tiny_images() -> list:
    """A real rollout of the tiny Flux pipeline: two images for each of the four prompts."""
    pipe = build_tiny_pipeline("flux", seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [p for p in PROMPTS for _ in range(2)]
    return pipe(prompts, height=32, width=32, num_inference_steps=2, generator=generator).images


def brightness(images) -> list[float]:
    return [float(torch.as_tensor(list(image.getdata()), dtype=torch.float32).mean() / 255) for image in images]


def test_a_gamed_brightness_reward_warns_once_per_cause(tiny_images):
    # What a policy gaming brightness produces: the tiny model's images pushed towards white over ten rollouts.
    from PIL import Image

    prompts = [p for p in PROMPTS for _ in range(2)]
    white = Image.new("RGB", tiny_images[0].size, (255, 255, 255))
    steps = [[Image.blend(image, white, t / 9) for image in tiny_images] for t in range(10)]
    watch, caught = rollouts_of(steps, [brightness(images) for images in steps], prompts)
    causes = {str(w.message).split(": ")[1] for w in caught}
    assert len(caught) == len(causes)  # once per cause
    assert any("saturation" in cause for cause in causes) and any("diversity" in cause for cause in causes)
    assert watch.metrics[PREFIX + "bright_fraction"][-1] == 1.0


def test_the_demo_colour_reward_does_not_warn(tiny_images):
    # Ten rollouts of the same model with fresh noise: the colour reward scored, nothing gamed.
    pipe = build_tiny_pipeline("flux", seed=0)
    prompts = [p for p in PROMPTS for _ in range(2)]
    steps = [
        pipe(prompts, height=32, width=32, num_inference_steps=2, generator=torch.Generator().manual_seed(s)).images
        for s in range(10)
    ]
    _, caught = rollouts_of(steps, [prompt_color()(prompts, images) for images in steps], prompts)
    assert caught == []


def test_a_growing_train_eval_gap_warns():
    watch = RewardHackingWatch(metrics={})
    watch.last_train_reward = 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert watch.observe_evaluation(0.4, step=1) == pytest.approx(0.1)
        watch.last_train_reward = 0.9  # the training reward rises, the held-out one does not
        watch.observe_evaluation(0.4, step=2)
    assert [issubclass(w.category, RewardHackingWarning) for w in caught] == [True]
    assert watch.metrics[PREFIX + "train_eval_gap"] == pytest.approx([0.1, 0.5])


def test_the_statistics_reach_tensorboard_wandb_and_trackio_from_a_tiny_run(
    tiny_flux_path, tmp_path, monkeypatch, offline_wandb
):
    pytest.importorskip("trackio")
    from test_trackers import wandb_history

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    project = f"trl-jagg-hacking-{os.getpid()}"
    args = GRPOJaggConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=3,
        height=32, width=32, max_steps=2, jagg_group_size=2, max_sequence_length=16, seed=0, save_strategy="no",
        disable_tqdm=True, logging_steps=1, report_to=["tensorboard", "wandb", "trackio"], project=project,
        run_name="hacking",  # log_completions off (the default): the watch runs on every run
    )  # fmt: skip
    trainer = DDPOJaggTrainer(
        model=tiny_flux_path, reward_funcs=redness, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]),
    )  # fmt: skip
    trainer.train()
    assert not (tmp_path / "out" / "completions").exists()  # the completions themselves are logged only on request
    offline_wandb.finish()  # flush the offline run's last records before reading its file
    keys = [f"train/{PREFIX}{name}" for name in STATISTICS]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {os.path.dirname(p) for p in glob.glob(str(tmp_path / "out" / "**" / "events.out.tfevents*"),
                                                         recursive=True)}  # fmt: skip
    board = EventAccumulator(events)
    board.Reload()
    for key in keys:
        assert [event.step for event in board.Scalars(key)] == [1, 2], key

    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = wandb_history(run_file)
    for key in keys:
        assert sorted(int(row["train/global_step"]) for row in rows if key in row) == [1, 2], key

    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(project, "hacking")
    for key in keys:
        assert sorted(int(entry["train/global_step"]) for entry in logs if key in entry) == [1, 2], key


def demo_run_warnings(reward: str, steps: int, tmp_path, **overrides) -> list:
    from trl_jagg.demo.run import DEMO_ASSET_DIR, demo_trainer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = demo_trainer(DEMO_ASSET_DIR, str(tmp_path), steps=steps, seed=0, reward=reward, **overrides)
        trainer.train()
    return [w for w in caught if issubclass(w.category, RewardHackingWarning)]


@pytest.mark.slow
def test_the_demo_model_gaming_brightness_without_a_kl_anchor_warns(tmp_path):
    # The demo's pretrained model and settings, trained on brightness with beta = 0: every image of a group turns
    # into the same bright field (diversity 0.24 -> 0.06 by step 8).
    caught = demo_run_warnings("brightness", 12, tmp_path, beta=0.0)
    assert any("diversity" in str(w.message) for w in caught)


@pytest.mark.slow
def test_the_demo_model_learning_its_colour_reward_does_not_warn(tmp_path):
    assert demo_run_warnings("prompt_color", 12, tmp_path) == []


def whole_rollout_watch(script) -> tuple[dict, list[str], RewardHackingWatch]:
    """One process watching what ``distributed_scripts/hacking_watch.py`` shows its two ranks, whole."""
    watch = RewardHackingWatch(metrics={})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            images, rewards = script.rollout(step)
            watch.observe(script.KEYS, images, rewards, step)
        watch.observe_evaluation(0.25, step=2)
    return watch.metrics, [str(w.message) for w in caught if issubclass(w.category, RewardHackingWarning)], watch


def test_every_process_logs_and_warns_on_the_whole_rollout(tmp_path):
    # Two gloo processes, each shown its shard; a group spans both, and only rank 1's shard turns white.
    import json

    from test_distributed import _load_script, _torchrun

    _torchrun("hacking_watch", str(tmp_path), timeout=120)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    script = _load_script("hacking_watch")
    metrics, messages, _ = whole_rollout_watch(script)
    for rank in ranks:
        assert rank["metrics"].keys() == metrics.keys()
        for name, values in metrics.items():
            assert rank["metrics"][name] == pytest.approx(values, rel=1e-6, nan_ok=True), name
        assert rank["warnings"] == messages
    assert any("saturation" in message for message in messages)
    # What each rank would have warned on its shard alone: rank 0's images did not change, so it would not.
    alone = []
    for rank in range(2):
        watch = RewardHackingWatch(metrics={})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                watch.observe(*script.shard(rank, step), step=step)
        alone.append([w for w in caught if issubclass(w.category, RewardHackingWarning)])
    assert alone[0] == [] and alone[1] != []
