"""The checks a resume runs on a checkpoint folder (`trl_jagg.trainer.checkpoint_checks`), on small files written
here: each refusal names the file and the mismatch."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from trl_jagg.trainer.checkpoint_checks import (
    check_ema_step,
    check_finite_weights,
    check_optimizer_file,
    check_resume_files,
    check_run_settings,
    check_step_agreement,
    check_weights,
    read_grpo_state,
)
from trl_jagg.utils.errors import CheckpointError


def write_json(path, name, value) -> None:
    (path / name).write_text(json.dumps(value))


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({}, "has step None, not an integer >= 0"),
        ({"step": "3"}, "has step '3'"),
        ({"step": -1}, "has step -1"),
        ({"step": True}, "has step True"),
        ([3], "is a JSON list, not an object"),
        ({"step": 2, "stat_tracker": "x"}, "has a stat_tracker that is not None nor an object of reward lists"),
        ({"step": 2, "stat_tracker": {"a cat": ["0.5"]}}, "has a stat_tracker"),
    ],
    ids=["empty", "string-step", "negative", "bool", "list", "tracker-string", "tracker-strings"],
)
def test_malformed_grpo_state_is_refused_naming_the_file(tmp_path, state, problem):
    write_json(tmp_path, "grpo_state.json", state)
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}/grpo_state.json {problem}")):
        read_grpo_state(str(tmp_path))


def test_valid_grpo_state_is_returned(tmp_path):
    state = {"step": 4, "stat_tracker": {"a cat": [0.5, 1]}}
    write_json(tmp_path, "grpo_state.json", state)
    assert read_grpo_state(str(tmp_path)) == state
    (tmp_path / "grpo_state.json").write_text('{"step": 4')  # truncated
    with pytest.raises(CheckpointError, match="grpo_state.json is missing, truncated or corrupt"):
        read_grpo_state(str(tmp_path))


@pytest.mark.parametrize(
    ("global_step", "micro", "accumulation", "ok"),
    [(2, 2, 1, True), (2, 3, 1, False), (2, 4, 2, True), (2, 3, 2, True), (2, 5, 2, False), (3, 2, 4, False)],
)
def test_trainer_and_grpo_steps_must_agree(tmp_path, global_step, micro, accumulation, ok):
    write_json(tmp_path, "trainer_state.json", {"global_step": global_step})
    write_json(tmp_path, "grpo_state.json", {"step": micro, "stat_tracker": None})
    if ok:
        check_step_agreement(str(tmp_path), accumulation)
    else:
        with pytest.raises(CheckpointError, match=rf"\(global_step {global_step}\) and .*grpo_state.json \(step "
                           rf"{micro} micro-batches\) disagree"):  # fmt: skip
            check_step_agreement(str(tmp_path), accumulation)


def test_negative_trainer_step_is_refused(tmp_path):
    write_json(tmp_path, "trainer_state.json", {"global_step": -2})
    write_json(tmp_path, "grpo_state.json", {"step": 0})
    with pytest.raises(CheckpointError, match="trainer_state.json has global_step -2"):
        check_step_agreement(str(tmp_path), 1)


def save_optimizer(path, shapes) -> None:
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    optimizer = torch.optim.AdamW(params)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()  # creates exp_avg / exp_avg_sq of each parameter's shape
    torch.save(optimizer.state_dict(), path / "optimizer.pt")


def test_optimizer_state_of_another_lora_rank_is_refused(tmp_path):
    save_optimizer(tmp_path, [(8, 32), (16, 8)])  # rank 8
    check_optimizer_file(str(tmp_path), [(8, 32), (16, 8)])
    with pytest.raises(CheckpointError, match=r"optimizer.pt: the exp_avg of parameter 0 is \[8, 32\], the parameter "
                       r"is \[4, 32\] \(another LoRA rank\?\)"):  # fmt: skip
        check_optimizer_file(str(tmp_path), [(4, 32), (16, 4)])
    with pytest.raises(CheckpointError, match="holds the state of 2 parameters, the model trains 3"):
        check_optimizer_file(str(tmp_path), [(8, 32), (16, 8), (3,)])


def test_weights_holding_nan_are_refused_naming_file_and_tensor(tmp_path):
    good, bad = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    save_file({"w": torch.ones(3), "steps": torch.tensor([1, 2])}, good)
    save_file({"w": torch.ones(3), "lora.B": torch.tensor([0.0, float("nan")])}, bad)
    check_finite_weights([good])
    with pytest.raises(CheckpointError, match=re.escape(f"{bad}: lora.B holds NaN or infinite values")):
        check_finite_weights([good, bad])


def test_missing_optimizer_or_scheduler_is_refused_unless_save_only_model(tmp_path):
    (tmp_path / "scheduler.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"has no optimizer.pt \(it holds scheduler.pt\)"):
        check_resume_files(str(tmp_path), save_only_model=False)
    check_resume_files(str(tmp_path), save_only_model=True)
    (tmp_path / "optimizer.pt").write_bytes(b"")
    check_resume_files(str(tmp_path), save_only_model=False)


def test_ema_folder_of_another_rank_is_named(tmp_path):
    (tmp_path / "ema").mkdir()
    ema = str(tmp_path / "ema" / "pytorch_lora_weights.safetensors")
    save_file({"transformer.a.lora_A.weight": torch.zeros(8, 32)}, ema)
    with pytest.raises(
        CheckpointError, match=re.escape(f"{ema}: 1 tensors have other shapes") + r".*\[8, 32\].*\[4, 32\]"
    ):
        check_weights([ema], {"a.lora_A.weight": (4, 32)}, prefix="transformer.")


def test_optimizer_state_holding_nan_is_refused(tmp_path):
    save_optimizer(tmp_path, [(8, 32), (16, 8)])
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    state["state"][1]["exp_avg_sq"][3, 2] = float("nan")
    torch.save(state, tmp_path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"optimizer.pt: the exp_avg_sq of parameter 1 holds NaN or infinite"):
        check_optimizer_file(str(tmp_path), [(8, 32), (16, 8)])


@pytest.mark.parametrize(("ema_step", "ok"), [(3, True), (2, False), ("3", False)])
def test_ema_stamped_at_another_step_is_refused(tmp_path, ema_step, ok):
    write_json(tmp_path, "trainer_state.json", {"global_step": 3})
    (tmp_path / "ema").mkdir()
    write_json(tmp_path / "ema", "ema_state.json", {"step": ema_step})
    if ok:
        check_ema_step(str(tmp_path))
    else:
        with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}/ema/ema_state.json")):
            check_ema_step(str(tmp_path))


def test_unstamped_ema_is_accepted_with_a_warning(tmp_path):
    write_json(tmp_path, "trainer_state.json", {"global_step": 3})
    (tmp_path / "ema").mkdir()
    with pytest.warns(UserWarning, match="has no ema_state.json"):
        check_ema_step(str(tmp_path))


SAVED_RUN = {"learning_rate": 1e-4, "lr_scheduler_type": "linear", "warmup_steps": 0, "train_experts": "both"}


@pytest.mark.parametrize(
    ("current", "scheduler_saved", "named"),
    [
        (SAVED_RUN, True, None),
        ({**SAVED_RUN, "learning_rate": 5e-5}, True, "learning_rate=0.0001; this run has learning_rate=5e-05"),
        ({**SAVED_RUN, "learning_rate": 5e-5}, False, None),  # no scheduler.pt: the new rate applies
        ({**SAVED_RUN, "train_experts": "low_noise"}, False, "train_experts='both'; this run has train_experts="),
        ({**SAVED_RUN, "warmup_steps": 5, "lr_scheduler_type": "cosine"}, True, "lr_scheduler_type='linear', "
         "warmup_steps=0; this run has lr_scheduler_type='cosine', warmup_steps=5"),
    ],
    ids=["same", "learning-rate", "learning-rate-without-scheduler", "train-experts", "schedule"],
)  # fmt: skip
def test_resume_refuses_changed_run_settings(tmp_path, current, scheduler_saved, named):
    write_json(tmp_path, "grpo_state.json", {"step": 1, "stat_tracker": None, "run": SAVED_RUN})
    if scheduler_saved:
        (tmp_path / "scheduler.pt").write_bytes(b"")
    if named is None:
        check_run_settings(str(tmp_path), current)
    else:
        with pytest.raises(CheckpointError, match=re.escape(named)):
            check_run_settings(str(tmp_path), current)


def test_checkpoint_without_a_run_record_is_not_compared(tmp_path):
    write_json(tmp_path, "grpo_state.json", {"step": 1, "stat_tracker": None})
    (tmp_path / "scheduler.pt").write_bytes(b"")
    check_run_settings(str(tmp_path), {**SAVED_RUN, "learning_rate": 1.0})
    write_json(tmp_path, "grpo_state.json", {"step": 1, "stat_tracker": None, "run": [1]})
    with pytest.raises(CheckpointError, match="has a run record that is not an object"):
        check_run_settings(str(tmp_path), SAVED_RUN)
