"""A run that goes wrong stops with an error naming the step, the quantity or the file, and loses no good state:
non-finite values, 0-step saves, broken checkpoints, secrets, failing rewards (tiny Flux pipeline, offline)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.rewards.calling import RewardTimeout
from trl_jagg.utils.errors import CheckpointError, NonFiniteError, TrainingError

PROMPTS = ["a red circle", "a green square", "a blue circle", "a red square"]
LORA_FILE = "pytorch_lora_weights.safetensors"


def reward(prompts, images, **kwargs):
    return [float(i % 3) for i in range(len(images))]


def make_trainer(
    path, output_dir, *, lora=True, reward_func=reward, lora_rank=4, eval_dataset=None, **overrides
) -> DDPOJaggTrainer:
    values = dict(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2, num_inference_steps=3,
        height=32, width=32, max_steps=2, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=2,
        max_sequence_length=16, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    values.update(overrides)
    torch.manual_seed(0)
    lora_config = LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=["to_q", "to_k", "to_v"],
                             init_lora_weights="gaussian")  # fmt: skip
    return DDPOJaggTrainer(
        model=path, reward_funcs=reward_func, args=GRPOJaggConfig(**values),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=eval_dataset,
        peft_config=lora_config if lora else None,
    )  # fmt: skip


def digest(folder) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (a checkpoint also holds ``scheduler/``), by relative path."""
    return {
        os.path.relpath(os.path.join(root, name), folder): hashlib.sha256(
            open(os.path.join(root, name), "rb").read()
        ).hexdigest()
        for root, _, files in sorted(os.walk(folder))
        for name in sorted(files)
    }


def trainable(trainer) -> list[torch.Tensor]:
    return [p.detach() for p in trainer.model.parameters() if p.requires_grad]


def nan_velocity_hook(trainer, *, at_step: int, in_update: bool):
    """Makes one velocity value NaN in the update (grad enabled) or the rollout of optimizer step ``at_step``."""

    def hook(module, inputs, output):
        if trainer.state.global_step == at_step - 1 and torch.is_grad_enabled() == in_update:
            velocity = output[0].clone()
            velocity.view(-1)[0] = math.nan
            return (velocity, *output[1:])
        return output

    return trainer.model.register_forward_hook(hook)


# ---------------------------------------------------------------- non-finite values
def test_nan_velocity_in_the_update_stops_the_run_with_the_last_good_checkpoint_intact(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    nan_velocity_hook(trainer, at_step=3, in_update=True)
    checkpoint = tmp_path / "checkpoint-2"
    saved = {}

    class Record(TrainerCallback):  # what checkpoint-2 holds right after it is written
        def on_save(self, args, state, control, **kwargs):
            saved.update(digest(checkpoint))
            saved["weights"] = [p.clone() for p in trainable(trainer)]

    trainer.add_callback(Record())
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    message = str(info.value)
    assert "Non-finite loss at step 3" in message
    assert f"Latest checkpoint: {checkpoint}" in message
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]  # no checkpoint-3, no weights saved at the top
    weights = saved.pop("weights")
    assert digest(checkpoint) == saved  # untouched
    stored = load_file(checkpoint / LORA_FILE)
    assert all(torch.isfinite(t).all() for t in stored.values())
    # The NaN gradient was never applied: the weights in memory are still those of step 2.
    for before, after in zip(weights, trainable(trainer)):
        assert torch.equal(before, after)


def test_nan_latents_after_the_rollout_stop_before_the_rewards(tiny_flux_path, tmp_path):
    calls = []

    def counting(prompts, images, **kwargs):
        calls.append(len(images))
        return reward(prompts, images)

    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=counting)
    nan_velocity_hook(trainer, at_step=2, in_update=False)
    with pytest.raises(
        NonFiniteError, match="Non-finite latents after the rollout at step 2.*No checkpoint was saved"
    ):
        trainer.train()
    assert len(calls) == 1  # step 1 only: the black images of step 2 were never scored


def test_a_vae_that_outputs_nan_from_finite_latents_stops_before_the_rewards(tiny_flux_path, tmp_path):
    calls = []

    def counting(prompts, images, **kwargs):
        calls.append(len(images))
        return reward(prompts, images)

    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=counting)
    vae = trainer.adapter.pipeline.vae
    decode = vae.decode

    def nan_on_the_second_rollout(*args, **kwargs):
        pixels = decode(*args, **kwargs)
        return (pixels[0] * float("nan"),) if calls else pixels

    vae.decode = nan_on_the_second_rollout
    with pytest.raises(
        NonFiniteError, match=r"Non-finite decoded images \(the VAE output\) after the rollout at step 2"
    ):
        trainer.train()
    assert len(calls) == 1  # the black images of step 2 were never scored


def test_nan_gradient_with_a_finite_loss_stops_before_the_optimizer_step(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=1)
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    param.register_hook(lambda grad: grad * math.nan)
    before = [p.clone() for p in trainable(trainer)]
    with pytest.raises(NonFiniteError, match="Non-finite gradient norm at step 1"):
        trainer.train()
    for a, b in zip(before, trainable(trainer)):
        assert torch.equal(a, b)


def test_non_finite_weights_are_never_saved(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path / "run", max_steps=1)
    trainer.train()
    with torch.no_grad():
        trainable(trainer)[0].view(-1)[0] = math.inf
    target = tmp_path / "final"
    with pytest.raises(
        NonFiniteError, match=f"The weights hold NaN or infinite values at step 1: not saved to {target}"
    ):
        trainer.save_model(str(target))
    assert not target.exists()


# ---------------------------------------------------------------- 0-step runs
def test_untrained_model_never_replaces_existing_weights(tiny_flux_path, tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / LORA_FILE).write_bytes(b"trained weights")
    trainer = make_trainer(tiny_flux_path, tmp_path)
    with pytest.raises(TrainingError, match=f"Refusing to replace the weights in {tmp_path} with a model that has "
                       "trained 0 steps"):  # fmt: skip
        trainer.save_model()
    assert (tmp_path / LORA_FILE).read_bytes() == b"trained weights"
    fresh = tmp_path / "fresh"
    trainer.save_model(str(fresh))  # an untrained model may still go where it replaces nothing
    assert (fresh / LORA_FILE).is_file()


def test_untrained_model_is_not_saved_beside_a_finished_runs_checkpoints(tiny_flux_path, tmp_path, checkpoints):
    run = tmp_path / "run"
    shutil.copytree(checkpoints["lora"], run / "checkpoint-1")  # a finished run: checkpoints, no top-level weights
    trainer = make_trainer(tiny_flux_path, run)
    with pytest.raises(TrainingError, match=f"trained 0 steps into {run}, which holds a run's checkpoints"):
        trainer.save_model()
    assert sorted(os.listdir(run)) == ["checkpoint-1"]


# ---------------------------------------------------------------- secrets
def test_training_args_bin_holds_no_hub_token(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, hub_token="hf_SECRET_do_not_store")
    trainer.save_model(str(tmp_path / "saved"))
    raw = (tmp_path / "saved" / "training_args.bin").read_bytes()
    assert b"hf_SECRET_do_not_store" not in raw
    stored = torch.load(tmp_path / "saved" / "training_args.bin", weights_only=False)
    assert stored.hub_token is None and stored.learning_rate == trainer.args.learning_rate
    assert trainer.args.hub_token == "hf_SECRET_do_not_store"  # the running config keeps it


# ---------------------------------------------------------------- resume errors
@pytest.fixture(scope="module")
def checkpoints(tiny_flux_path, tmp_path_factory):
    """checkpoint-1 of a LoRA run, of a full fine-tuning run and of a LoRA run with EMA."""
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    for kind in ("lora", "full", "ema"):
        trainer = make_trainer(tiny_flux_path, root / kind, lora=kind != "full", max_steps=1, save_strategy="steps",
                               save_steps=1, ema_decay=0.9 if kind == "ema" else 0.0)  # fmt: skip
        trainer.train()
        paths[kind] = str(root / kind / "checkpoint-1")
    return paths


def broken_copy(source: str, tmp_path, name: str, damage) -> str:
    target = str(tmp_path / "bad" / "checkpoint-1")
    shutil.copytree(source, target)
    damage(os.path.join(target, name))
    return target


def truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


def drop_keys(path: str) -> None:
    state = load_file(path)
    keep = {k: v for k, v in state.items() if ".to_k." not in k}
    assert len(keep) < len(state)
    save_file(keep, path)


@pytest.mark.parametrize(
    ("kind", "name", "damage", "match"),
    [
        ("lora", LORA_FILE, truncate, f"{LORA_FILE} is truncated or corrupt"),
        ("full", "diffusion_pytorch_model.safetensors", truncate, "diffusion_pytorch_model.safetensors is truncated"),
        ("lora", "optimizer.pt", truncate, "optimizer.pt is truncated or corrupt"),
        ("lora", "trainer_state.json", truncate, "trainer_state.json is truncated or corrupt"),
        ("lora", "grpo_state.json", os.remove, "has no grpo_state.json .*not a checkpoint of this trainer"),
        ("lora", LORA_FILE, drop_keys, rf"{LORA_FILE} lacks \d+ of the model's \d+ tensors \(e\.g\. \['.*to_k"),
        ("lora", LORA_FILE, os.remove, f"has no {LORA_FILE} .*not a LoRA checkpoint"),
    ],
    ids=[
        "lora-weights-truncated",
        "full-weights-truncated",
        "optimizer-truncated",
        "state-truncated",
        "grpo-state-missing",
        "lora-keys-missing",
        "no-lora-file",
    ],  # fmt: skip
)
def test_broken_checkpoints_name_the_file(tiny_flux_path, tmp_path, checkpoints, kind, name, damage, match):
    path = broken_copy(checkpoints[kind], tmp_path, name, damage)
    trainer = make_trainer(tiny_flux_path, tmp_path / "run", lora=kind == "lora")
    with pytest.raises(CheckpointError, match=match) as info:
        trainer.train(resume_from_checkpoint=path)
    assert path in str(info.value)
    assert trainer.state.global_step == 0  # refused before training


def test_checkpoint_of_another_lora_rank_is_refused(tiny_flux_path, tmp_path, checkpoints):
    trainer = make_trainer(tiny_flux_path, tmp_path, lora_rank=2)
    with pytest.raises(CheckpointError, match=r"tensors have other shapes than the model's, e\.g\. .* is \[4, "):
        trainer.train(resume_from_checkpoint=checkpoints["lora"])


@pytest.mark.parametrize("latest", [True, "latest"])  # "latest": diffusers' training scripts' word
def test_resume_true_without_checkpoints_says_so(tiny_flux_path, tmp_path, latest):
    trainer = make_trainer(tiny_flux_path, tmp_path)
    with pytest.raises(CheckpointError, match=f"resume_from_checkpoint=True, but {tmp_path} holds no checkpoint-N"):
        trainer.train(resume_from_checkpoint=latest)


def test_missing_resume_directory(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint-9'?: no such directory"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-9"))


def write_json(value):
    def damage(path: str) -> None:
        with open(path, "w") as handle:
            json.dump(value, handle)

    return damage


def nan_in_first_tensor(path: str) -> None:
    state = load_file(path)
    first = sorted(state)[0]
    state[first] = torch.full_like(state[first], float("nan"))
    save_file(state, path)


def optimizer_of_rank_8(path: str) -> None:
    state = torch.load(path, weights_only=True)
    for values in state["state"].values():
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.ndim == 2 and value.shape[0] == 4:  # a LoRA A of rank 4
                values[name] = torch.zeros(8, value.shape[1])
    torch.save(state, path)


def nan_in_optimizer(path: str) -> None:
    state = torch.load(path, weights_only=True)
    next(iter(state["state"][0].values()))  # the first parameter has its moments
    for value in state["state"][0].values():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            value.view(-1)[0] = float("nan")
    torch.save(state, path)


def ema_of_rank_8(path: str) -> None:
    state = load_file(path)
    save_file({k: torch.zeros(8, v.shape[1]) if v.shape[0] == 4 else v for k, v in state.items()}, path)


@pytest.mark.parametrize(
    ("kind", "name", "damage", "match"),
    [
        ("lora", "optimizer.pt", os.remove, r"has no optimizer.pt \(it holds .*\): resuming would restart"),
        ("lora", "scheduler.pt", os.remove, "has no scheduler.pt"),
        ("lora", "grpo_state.json", write_json({}), "grpo_state.json has step None, not an integer >= 0"),
        ("lora", "grpo_state.json", write_json({"step": "1"}), "grpo_state.json has step '1'"),
        ("lora", "grpo_state.json", write_json([1]), "grpo_state.json is a JSON list"),
        (
            "lora",
            "grpo_state.json",
            write_json({"step": 5, "stat_tracker": None}),
            r"\(global_step 1\) and .* disagree",
        ),
        ("lora", "trainer_state.json", write_json({"global_step": -1}), "global_step -1, not an integer >= 0"),
        ("lora", LORA_FILE, nan_in_first_tensor, f"{LORA_FILE}: .* holds NaN or infinite values"),
        ("lora", "optimizer.pt", optimizer_of_rank_8, r"optimizer.pt: the exp_avg(_sq)? of parameter \d+ is \[8, "),
        ("ema", f"ema/{LORA_FILE}", nan_in_first_tensor, f"ema/{LORA_FILE}: .* holds NaN"),
        ("ema", f"ema/{LORA_FILE}", ema_of_rank_8, rf"ema/{LORA_FILE}: \d+ tensors have other shapes"),
        ("lora", "optimizer.pt", nan_in_optimizer, r"optimizer.pt: the exp_avg(_sq)? of parameter 0 holds NaN"),
        ("ema", "ema/ema_state.json", write_json({"step": 0}), r"was saved at step 0, the checkpoint at step 1"),
    ],
    ids=[
        "no-optimizer",
        "no-scheduler",
        "grpo-empty",
        "grpo-string-step",
        "grpo-list",
        "steps-disagree",
        "negative-step",
        "nan-weights",
        "optimizer-rank-8",
        "nan-ema",
        "ema-rank-8",
        "nan-optimizer",
        "stale-ema",
    ],  # fmt: skip
)
def test_resume_checks_what_it_loads(tiny_flux_path, tmp_path, checkpoints, kind, name, damage, match):
    path = broken_copy(checkpoints[kind], tmp_path, name, damage)
    trainer = make_trainer(tiny_flux_path, tmp_path / "run", ema_decay=0.9 if kind == "ema" else 0.0)
    with pytest.raises(CheckpointError, match=match) as info:
        trainer.train(resume_from_checkpoint=path)
    assert path in str(info.value)
    assert trainer.state.global_step <= 1 and not os.path.exists(tmp_path / "run" / "checkpoint-2")


def test_a_stale_ema_copied_from_an_earlier_save_is_refused(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, ema_decay=0.9, save_strategy="steps", save_steps=1)
    trainer.train()
    with open(tmp_path / "checkpoint-2" / "ema" / "ema_state.json") as handle:
        assert json.load(handle) == {"step": 2}
    shutil.rmtree(tmp_path / "checkpoint-2" / "ema")
    shutil.copytree(tmp_path / "checkpoint-1" / "ema", tmp_path / "checkpoint-2" / "ema")
    resumed = make_trainer(tiny_flux_path, tmp_path, ema_decay=0.9, max_steps=3)
    with pytest.raises(CheckpointError, match=r"checkpoint-2/ema was saved at step 1, the checkpoint at step 2"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 0


@pytest.mark.parametrize(
    ("changed", "match"),
    [
        ({"learning_rate": 5e-3}, r"with learning_rate=0\.01; this run has learning_rate=0\.005: .*silently ignored"),
        ({"lr_scheduler_type": "constant", "warmup_steps": 1}, r"lr_scheduler_type='linear', warmup_steps=0; this run "
         r"has lr_scheduler_type='constant', warmup_steps=1"),
    ],
    ids=["learning-rate", "schedule"],
)  # fmt: skip
def test_a_changed_learning_rate_or_schedule_is_refused_at_resume(tiny_flux_path, tmp_path, checkpoints, changed,
                                                                  match):  # fmt: skip
    trainer = make_trainer(tiny_flux_path, tmp_path, **changed)  # the checkpoint's run: 1e-2, linear, no warm-up
    with pytest.raises(CheckpointError, match=match) as info:
        trainer.train(resume_from_checkpoint=checkpoints["lora"])
    assert "start a fresh run" in str(info.value) and trainer.state.global_step == 0


def test_a_changed_learning_rate_applies_without_the_checkpoints_optimizer(tiny_flux_path, tmp_path, checkpoints):
    # save_only_model: no scheduler.pt to keep the old rate, so the new one takes effect and is not refused.
    path = broken_copy(checkpoints["lora"], tmp_path, "optimizer.pt", os.remove)
    os.remove(os.path.join(path, "scheduler.pt"))
    trainer = make_trainer(tiny_flux_path, tmp_path / "run", save_only_model=True, learning_rate=5e-3,
                           lr_scheduler_type="constant")  # fmt: skip
    trainer.train(resume_from_checkpoint=path)
    assert trainer.state.global_step == 2 and trainer.lr_scheduler.get_last_lr()[0] == 5e-3


def test_missing_optimizer_is_accepted_with_save_only_model(tiny_flux_path, tmp_path, checkpoints):
    path = broken_copy(checkpoints["lora"], tmp_path, "optimizer.pt", os.remove)
    os.remove(os.path.join(path, "scheduler.pt"))
    trainer = make_trainer(tiny_flux_path, tmp_path / "run", save_only_model=True)
    trainer.train(resume_from_checkpoint=path)
    assert trainer.state.global_step == 2


class NanInEma(TrainerCallback):
    """Puts a NaN in the EMA shadow after optimizer step 1 (as a diverged average would hold)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.trainer.ema.shadow_params[0].view(-1)[0] = float("nan")


def test_non_finite_ema_is_never_saved(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, ema_decay=0.9, save_strategy="steps", save_steps=1)
    trainer.add_callback(NanInEma(trainer))
    with pytest.raises(NonFiniteError, match=r"The EMA weights hold NaN or infinite values at step 1: not saved"):
        trainer.train()
    assert not os.path.exists(tmp_path / "checkpoint-1") and not os.path.exists(tmp_path / "ema")


def test_rotation_deletes_whole_checkpoints_and_a_killed_one_is_not_resumed(tiny_flux_path, tmp_path, monkeypatch):
    import trl_jagg.trainer.checkpointing as checkpointing

    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=2, save_strategy="steps", save_steps=1,
                           save_total_limit=1)  # fmt: skip
    real_rmtree = shutil.rmtree

    def killed_at_rotation(path, *args, **kwargs):  # the process dies inside the first deletion
        if path.endswith("checkpoint-1.deleting"):
            os.remove(os.path.join(path, LORA_FILE))
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpointing.shutil, "rmtree", killed_at_rotation)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    # The half-deleted folder is out of the checkpoint names: a resume takes the whole checkpoint-2.
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "tmp-checkpoint-1.deleting"]
    monkeypatch.setattr(checkpointing.shutil, "rmtree", real_rmtree)
    resumed = make_trainer(tiny_flux_path, tmp_path, max_steps=3, save_strategy="steps", save_steps=1,
                           save_total_limit=1)  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]  # the next rotation removed the leftovers


def test_write_failure_during_a_save_names_the_path(tiny_flux_path, tmp_path, monkeypatch):
    import transformers.trainer

    def disk_full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file")

    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    monkeypatch.setattr(transformers.trainer.torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=rf"Writing {tmp_path}/tmp-checkpoint-1/training_args.bin failed .*disk "
                       "is likely full"):  # fmt: skip
        trainer.train()
    assert not os.path.exists(tmp_path / "checkpoint-1")


def test_a_failed_optimizer_write_names_the_file(tiny_flux_path, tmp_path, monkeypatch):
    import torch.serialization

    real_save = torch.serialization._save

    def full_at_optimizer(obj, zip_file, *args, **kwargs):  # inside torch.save, its archive opened: a full disk
        if isinstance(obj, dict) and "param_groups" in obj:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4160 vs 4054")
        return real_save(obj, zip_file, *args, **kwargs)

    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    monkeypatch.setattr(torch.serialization, "_save", full_at_optimizer)
    with pytest.raises(CheckpointError, match=rf"Writing {tmp_path}/tmp-checkpoint-1/optimizer.pt failed") as info:
        trainer.train()
    assert "unexpected pos" in str(info.value.__cause__)  # the original error is chained
    assert not os.path.exists(tmp_path / "checkpoint-1")


def test_a_torch_save_failure_in_a_checkpoint_names_the_folder_and_a_bug_passes_unchanged(tmp_path, monkeypatch):
    import torch.serialization

    from trl_jagg.trainer.checkpointing import atomic_checkpoint

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch.serialization, "_save", full_disk)  # fails inside torch.save, as a full disk does
    with pytest.raises(CheckpointError, match=rf"Writing {tmp_path}/tmp-checkpoint-1 failed .*unexpected pos"):
        with atomic_checkpoint(str(tmp_path), "checkpoint-1", should_save=True, wait_for_everyone=lambda: None) as d:
            os.makedirs(d)
            torch.save({"rng": 1}, os.path.join(d, "rng_state.pth"))
    with pytest.raises(RuntimeError, match="a bug") as info:  # not a write: no file to blame
        with atomic_checkpoint(str(tmp_path), "checkpoint-1", should_save=True, wait_for_everyone=lambda: None):
            raise RuntimeError("a bug")
    assert not isinstance(info.value, CheckpointError)
    assert not os.path.exists(tmp_path / "checkpoint-1")


def test_a_failed_final_save_names_the_file(tiny_flux_path, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def disk_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    trainer = make_trainer(tiny_flux_path, tmp_path, max_steps=1)
    trainer.train()
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(CheckpointError, match=rf"Writing {tmp_path}/{LORA_FILE} failed .*disk is likely full") as info:
        trainer.save_model()
    assert isinstance(info.value.__cause__, SafetensorError)


# ---------------------------------------------------------------- reward failures
class FailingReward:
    """Raises on the calls listed in ``fail_on`` (1-based), scores otherwise."""

    __name__ = "failing"

    def __init__(self, fail_on):
        self.fail_on, self.calls = set(fail_on), 0

    def __call__(self, prompts, images, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise ConnectionError(f"reward server went away (call {self.calls})")
        return reward(prompts, images)


def test_reward_exception_saves_a_resumable_checkpoint_first(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=FailingReward({3}), max_steps=4, save_steps=100,
                           save_strategy="steps")  # fmt: skip
    with pytest.raises(ConnectionError, match=r"went away \(call 3\)") as info:
        trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert any(f"{checkpoint} holds the 2 trained steps" in note for note in getattr(info.value, "__notes__", []))
    assert {LORA_FILE, "optimizer.pt", "trainer_state.json"} <= set(os.listdir(checkpoint))
    resumed = make_trainer(tiny_flux_path, tmp_path, max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4


@pytest.mark.parametrize(
    ("failing_call", "layout"),
    [(2, {}),  # one chunk and one micro-batch per step: the failure surfaces at the update's first loss
     # 2 chunks and 2 micro-batches of one group each per step: step 2's last chunk (call 4) fails while its first
     # micro-batch trains (its group is in the first chunk), and surfaces at the second micro-batch's loss
     (4, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "sample_batch_size": 2})],
)  # fmt: skip
def test_a_reward_failing_while_the_update_awaits_it_saves_a_checkpoint_first(
    tiny_flux_path, tmp_path, failing_call, layout
):
    class PerSample(FailingReward):  # scored chunk by chunk: step 2's failure surfaces in its update
        per_sample = True

    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=PerSample({failing_call}), max_steps=2,
                           save_steps=100, save_strategy="steps", **layout)  # fmt: skip
    with pytest.raises(ConnectionError, match=rf"went away \(call {failing_call}\)") as info:
        trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    assert any(f"{checkpoint} holds the 1 trained steps" in note for note in getattr(info.value, "__notes__", []))
    assert {LORA_FILE, "optimizer.pt", "trainer_state.json"} <= set(os.listdir(checkpoint))


def test_a_nan_in_a_later_rollout_chunk_is_named_by_its_rollout_position(tiny_flux_path, tmp_path):
    class NanInSecondChunk:  # scored chunk by chunk (2 chunks of 2): its second chunk's second image is NaN
        __name__, per_sample, calls = "nan_later", True, 0

        def __call__(self, prompts, images, **kwargs):
            self.calls += 1
            return [1.0, math.nan if self.calls == 2 else 0.0]

    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=NanInSecondChunk(), max_steps=1,
                           per_device_train_batch_size=2, gradient_accumulation_steps=2, sample_batch_size=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"'nan_later' returned non-finite values at positions \[3\]"):
        trainer.train()


def test_reward_retries(tiny_flux_path, tmp_path, caplog):
    flaky = FailingReward({1, 2})
    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=flaky, max_steps=1, reward_retries=2)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.state.global_step == 1 and flaky.calls == 3
    assert "Retry 2 of 2" in caplog.text
    exhausted = make_trainer(tiny_flux_path, tmp_path / "b", reward_func=FailingReward({1, 2}), max_steps=1,
                             reward_retries=1)  # fmt: skip
    with pytest.raises(ConnectionError, match=r"call 2"):
        exhausted.train()


class HangingReward:
    """Blocks on the calls listed in ``hang_on`` (1-based; chunks of a rollout may run at once) until ``release`` is
    set, at most ``HANG_S`` s (so that a missing deadline fails a test, never hangs it), and scores otherwise."""

    __name__ = "hanging"

    def __init__(self, hang_on, release):
        self.hang_on, self.release, self.calls = set(hang_on), release, 0
        self._lock = threading.Lock()

    def __call__(self, prompts, images, **kwargs):
        with self._lock:
            self.calls += 1
            call = self.calls
        if call in self.hang_on:
            self.release.wait(HANG_S)
        return reward(prompts, images)


class AsyncHangingReward(HangingReward):
    async def __call__(self, prompts, images, **kwargs):  # cancelled at the deadline
        with self._lock:
            self.calls += 1
            call = self.calls
        if call in self.hang_on:
            await asyncio.sleep(HANG_S)
        return reward(prompts, images)


HANG_S = 60.0


@pytest.fixture
def release():
    """Set when the test ends: an abandoned synchronous call returns then, instead of outliving the test."""
    event = threading.Event()
    yield event
    event.set()


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("per_sample", "hang_on", "layout"),
    [(False, {2}, {}),  # scored after step 2's rollout
     # scored during the rollout, 2 chunks a step: step 2's second chunk (call 4) hangs while the update awaits it
     (True, {4}, {"sample_batch_size": 2})],
    ids=["whole-batch", "per-sample-chunk"],
)  # fmt: skip
def test_a_hung_reward_saves_the_trained_steps_and_stops_naming_reward_step_and_setting(
    tiny_flux_path, tmp_path, release, is_async, per_sample, hang_on, layout
):
    func = (AsyncHangingReward if is_async else HangingReward)(hang_on, release)
    func.per_sample = per_sample
    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=func, max_steps=3, save_steps=100,
                           save_strategy="steps", reward_timeout=2, **layout)  # fmt: skip
    with pytest.raises(RewardTimeout, match=r"Reward 'hanging' did not return within reward_timeout=2 s") as info:
        trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"The run stopped at step 2. {checkpoint} holds the 1 trained steps" in notes
    assert {LORA_FILE, "optimizer.pt", "trainer_state.json"} <= set(os.listdir(checkpoint))
    assert trainer.state.global_step == 1


REWARD_FAILS_ON_RANK_1 = """
import json, os, sys, threading, torch
torch.set_num_threads(1)
from datasets import Dataset
from peft import LoraConfig
from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

calls, never = [], threading.Event()

def reward(prompts, images, **kwargs):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        if mode == "raises":
            raise ConnectionError("rank 1 lost its reward server")
        never.wait(120)  # hangs (bounded, so that a missing deadline fails the test)
    return [float(i % 3) for i in range(len(images))]

model_path, root = sys.argv[1], sys.argv[2]
for mode in ("raises", "hangs"):  # one launch, two runs: torch's start-up is the expensive part
    calls.clear()
    out = f"{root}/{mode}"
    args = GRPOJaggConfig(
        output_dir=out, per_device_train_batch_size=2, num_generations=2, num_inference_steps=3, height=32, width=32,
        max_steps=3, learning_rate=1e-2, epsilon=0.1, jagg_group_size=2, max_sequence_length=16,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        reward_timeout=3 if mode == "hangs" else None,
    )
    trainer = DDPOJaggTrainer(
        model=model_path, reward_funcs=reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square", "a blue circle", "a red square"]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k"], init_lora_weights="gaussian"),
    )
    try:
        trainer.train()
    except Exception as error:
        with open(f"{out}/rank{os.environ['RANK']}.json", "w") as f:
            json.dump({"type": type(error).__name__, "message": str(error)}, f)
    else:
        sys.exit(f"the {mode} run did not stop")
"""


@pytest.fixture(scope="module")
def rank_1_failures(tiny_flux_path, tmp_path_factory):
    """The output folder of one torchrun launch of REWARD_FAILS_ON_RANK_1 (2 CPU processes, gloo, 127.0.0.1)."""
    root = tmp_path_factory.mktemp("rank_1_reward")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = root / "train.py"
    script.write_text(REWARD_FAILS_ON_RANK_1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(script), tiny_flux_path, str(root)]  # fmt: skip
    # Bounded: without a deadline, the hang would last until its 120 s wait ends (or the process group's 30 min).
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("mode", ["raises", "hangs"])
def test_reward_failure_on_one_rank_saves_on_every_rank_and_stops_all(rank_1_failures, mode):
    """The reward raises, or hangs past reward_timeout, on rank 1 only. Both ranks reach the checkpoint save (no rank
    is left waiting in a collective until the process group's timeout), then both stop; the checkpoint, written once,
    holds the step trained before."""
    out = rank_1_failures / mode
    errors = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    if mode == "raises":
        assert errors[1]["type"] == "ConnectionError"
    else:
        assert errors[1]["type"] == "RewardTimeout"
        assert "Reward 'reward' did not return within reward_timeout=3 s" in errors[1]["message"]
    assert errors[0]["type"] == "TrainingError" and "failed on another process at step 2" in errors[0]["message"]
    assert f"process 1: {errors[1]['type']}: " in errors[0]["message"]  # what failed there, named here
    assert sorted(name for name in os.listdir(out) if "checkpoint" in name) == ["checkpoint-1"]
    checkpoint = out / "checkpoint-1"
    assert {LORA_FILE, "optimizer.pt", "trainer_state.json"} <= set(os.listdir(checkpoint))
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 1


# ---------------------------------------------------------------- evaluation
def nan_on(call: int):
    calls = []

    def nan_reward(prompts, images, **kwargs):
        calls.append(1)
        return [float("nan") if len(calls) == call else 0.5] * len(images)

    return nan_reward


@pytest.mark.parametrize("failure", ["raises", "nan", "hangs"])
def test_a_failing_evaluation_reward_saves_the_trained_steps_first(tiny_flux_path, tmp_path, release, failure):
    # Rewards are called once per step (one rollout a step); call 3 is the evaluation at step 2.
    func = {
        "raises": lambda: FailingReward({3}),
        "nan": lambda: nan_on(3),
        "hangs": lambda: HangingReward({3}, release),
    }
    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=func[failure](), max_steps=3, save_strategy="steps",
                           save_steps=100, eval_strategy="steps", eval_steps=2, eval_dataset=PROMPTS[:2],
                           reward_timeout=2 if failure == "hangs" else None)  # fmt: skip
    error = {"raises": ConnectionError, "nan": ValueError, "hangs": RewardTimeout}[failure]
    with pytest.raises(error) as info:
        trainer.train()
    checkpoint = tmp_path / "checkpoint-2"
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"The run stopped in the evaluation at step 2. {checkpoint} holds the 2 trained steps" in notes
    assert {LORA_FILE, "optimizer.pt", "trainer_state.json"} <= set(os.listdir(checkpoint))


def test_evaluation_rewards_are_retried(tiny_flux_path, tmp_path):
    flaky = FailingReward({3})
    trainer = make_trainer(tiny_flux_path, tmp_path, reward_func=flaky, max_steps=2, reward_retries=1,
                           eval_strategy="steps", eval_steps=2, eval_dataset=PROMPTS[:2])  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2 and flaky.calls == 4


@pytest.mark.parametrize(
    ("dataset", "match"),
    [
        ([{"text": "a cat"}], "eval_dataset has no 'prompt' column"),
        (["a cat", None], r"eval_dataset\[1\] is NoneType"),
    ],
)
def test_evaluate_checks_its_dataset_as_the_train_set(tiny_flux_path, tmp_path, dataset, match):
    trainer = make_trainer(tiny_flux_path, tmp_path)
    with pytest.raises(ValueError, match=match):
        trainer.evaluate(eval_dataset=dataset)
    assert trainer.evaluate(eval_dataset=["a red circle"])["eval_samples"] == 1
