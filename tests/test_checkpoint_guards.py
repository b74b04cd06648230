"""The non-finite stop (`trl_jagg.trainer.guards.stop_if_non_finite`): it names the latest checkpoint that exists, or
says there is none (and then does not say to resume), and gives the likeliest cause of what it saw."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trl_jagg.trainer.guards import stop_if_non_finite
from trl_jagg.utils.errors import NonFiniteError

ONE_PROCESS = SimpleNamespace(num_processes=1)


def stop_message(run_dir, quantity: str, value) -> str:
    with pytest.raises(NonFiniteError) as info:
        stop_if_non_finite(ONE_PROCESS, quantity, value, step=5, run_dir=str(run_dir))
    return str(info.value)


def test_without_a_checkpoint_the_stop_says_so_and_proposes_a_fresh_start(tmp_path):
    message = stop_message(tmp_path, "loss", float("nan"))
    assert f"No checkpoint was saved before it in {tmp_path}" in message
    assert "Resume" not in message and "Start the run again" in message


def test_the_stop_names_the_latest_checkpoint_that_exists(tmp_path):
    for step in (2, 4, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-12.tmp").mkdir()  # an unfinished save is not a checkpoint
    message = stop_message(tmp_path, "loss", float("nan"))
    assert f"Latest checkpoint: {tmp_path / 'checkpoint-10'}. Resume from it" in message


@pytest.mark.parametrize(
    ("quantity", "cause", "fix"),
    [
        ("latents after the rollout", "the sampler diverged", "noise_level and guidance_scale"),
        ("decoded images (the VAE output) after the rollout", "the VAE overflowed", "dtype bfloat16 or float32"),
        ("loss", "the policy moved too far", "epsilon"),
        ("gradient norm", "the backward overflowed", "max_grad_norm > 0"),
    ],
)
def test_the_cause_and_fix_follow_what_was_non_finite(tmp_path, quantity, cause, fix):
    message = stop_message(tmp_path, quantity, torch.tensor([1.0, float("nan")]))
    assert f"Likeliest cause: {cause}" in message and fix in message
    assert "overflowed to infinity" not in message  # a NaN was seen, not only infinities


def test_only_infinities_read_as_an_overflow(tmp_path):
    assert "the values overflowed to infinity" in stop_message(tmp_path, "loss", torch.tensor([float("inf"), 1.0]))


def test_finite_values_pass(tmp_path):
    stop_if_non_finite(ONE_PROCESS, "loss", torch.ones(3), step=1, run_dir=str(tmp_path))
    stop_if_non_finite(ONE_PROCESS, "loss", None, step=1, run_dir=str(tmp_path))
