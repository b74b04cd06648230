"""The checks a resume runs on a checkpoint folder (`trl_jagg.trainer.checkpoint_checks`), on small files written
here: each refusal names the file and the mismatch."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

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
from trl_jagg.trainer.ema import add_safetensors_metadata, ema_stamp
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


def test_an_ema_folder_with_neither_stamp_is_refused(tmp_path):
    write_json(tmp_path, "trainer_state.json", {"global_step": 3})
    (tmp_path / "ema").mkdir()
    file = tmp_path / "ema" / "pytorch_lora_weights.safetensors"
    save_file({"a": torch.zeros(2)}, str(file))
    with pytest.raises(CheckpointError, match=re.escape(f"{file} is not written by this trainer (no EMA stamp")):
        check_ema_step(str(tmp_path))


def test_unstamped_ema_files_of_an_older_version_are_checked_by_their_record_with_a_warning(tmp_path):
    write_json(tmp_path, "trainer_state.json", {"global_step": 3})
    (tmp_path / "ema").mkdir()
    write_json(tmp_path / "ema", "ema_state.json", {"step": 3})
    save_file({"a": torch.zeros(2)}, str(tmp_path / "ema" / "pytorch_lora_weights.safetensors"))
    with pytest.warns(UserWarning, match="carry no EMA stamp"):
        check_ema_step(str(tmp_path))


def ema_checkpoint(path, step: int, stamped_step: int, objective: str = "grpo"):
    """A checkpoint folder at ``step`` whose EMA file (LoRA metadata of its own) is stamped at ``stamped_step``."""
    write_json(path, "trainer_state.json", {"global_step": step})
    (path / "ema").mkdir()
    file = path / "ema" / "pytorch_lora_weights.safetensors"
    tensors = {"transformer.a.lora_A.weight": torch.arange(12.0).view(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(tensors, str(file), metadata={"format": "pt", "lora_adapter_metadata": '{"r": 4}'})
    args = SimpleNamespace(run_name=None, output_dir="runs/a", objective=objective)
    add_safetensors_metadata(str(file), ema_stamp(stamped_step, args))
    return file, tensors


def test_the_ema_stamp_lives_in_the_file_beside_its_own_metadata_and_tensors(tmp_path):
    file, tensors = ema_checkpoint(tmp_path, 3, 3)
    with safe_open(str(file), framework="pt") as reader:
        metadata = reader.metadata()
    assert metadata == {"format": "pt", "lora_adapter_metadata": '{"r": 4}', "ema_step": "3", "ema_run": "runs/a",
                        "ema_objective": "grpo"}  # fmt: skip
    loaded = load_file(str(file))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    check_ema_step(str(tmp_path), objective="grpo")


def test_an_ema_file_swapped_in_from_another_save_is_refused(tmp_path):
    file, _ = ema_checkpoint(tmp_path, 3, 2)
    write_json(tmp_path / "ema", "ema_state.json", {"step": 3})  # the record was left: only the file was swapped
    with pytest.raises(
        CheckpointError, match=re.escape(f"{file} holds the EMA of step 2 of the run 'runs/a'")
    ) as info:
        check_ema_step(str(tmp_path), objective="grpo")
    assert "start a new run" in str(info.value)


def test_an_ema_file_of_another_objective_is_refused(tmp_path):
    ema_checkpoint(tmp_path, 3, 3, objective="nft")
    with pytest.raises(CheckpointError, match="resumed with objective 'grpo': an EMA from another save or run"):
        check_ema_step(str(tmp_path), objective="grpo")


def test_a_truncated_ema_file_is_a_named_checkpoint_error(tmp_path):
    file, _ = ema_checkpoint(tmp_path, 3, 3)
    file.write_bytes(file.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=re.escape(f"{file} is truncated or corrupt")):
        check_ema_step(str(tmp_path), objective="grpo")


@pytest.mark.parametrize(
    ("name", "value"), [("lr", float("nan")), ("lr", float("inf")), ("betas", (0.9, float("nan"))), ("eps", -math.inf)]
)
def test_non_finite_optimizer_hyperparameters_are_refused(tmp_path, name, value):
    save_optimizer(tmp_path, [(8, 32)])
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    state["param_groups"][0][name] = value
    torch.save(state, tmp_path / "optimizer.pt")
    with pytest.raises(CheckpointError, match=re.escape(f"optimizer.pt: parameter group 0 has {name}={value!r}")):
        check_optimizer_file(str(tmp_path), [(8, 32)])


def test_a_tensor_learning_rate_that_is_nan_is_refused(tmp_path):
    save_optimizer(tmp_path, [(8, 32)])
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    state["param_groups"][0]["lr"] = torch.tensor(float("nan"))  # capturable / fused optimizers keep a tensor
    torch.save(state, tmp_path / "optimizer.pt")
    with pytest.raises(CheckpointError, match="parameter group 0 has lr=tensor"):
        check_optimizer_file(str(tmp_path), [(8, 32)])


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


def test_a_trained_runs_ema_file_swapped_in_from_its_earlier_save_is_refused_at_resume(tiny_flux_path, tmp_path):
    """End to end: the trainer stamps each EMA file it saves; checkpoint-1's EMA file copied over checkpoint-2's
    (its ema_state.json left in place) is refused before anything loads."""
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed_scripts"))
    from interrupted_run import run_trainer

    out = tmp_path / "out"
    run_trainer(tiny_flux_path, str(out), 2, ema_decay=0.9, save_steps=1).train()
    name = "ema/pytorch_lora_weights.safetensors"
    with safe_open(str(out / "checkpoint-2" / name), framework="pt") as reader:
        assert reader.metadata()["ema_step"] == "2"
    shutil.copy(out / "checkpoint-1" / name, out / "checkpoint-2" / name)
    resumed = run_trainer(tiny_flux_path, str(out), 3, ema_decay=0.9)
    with pytest.raises(CheckpointError, match=re.escape(f"{out / 'checkpoint-2' / name} holds the EMA of step 1")):
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 0
