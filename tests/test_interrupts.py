"""Ctrl-C and preemption: a real process sent SIGINT or SIGTERM mid-run saves a checkpoint of every trained step,
says where, exits with the signal's status, and the run resumes from it to the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_distributed import _free_port

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed_scripts"))
from interrupted_run import run_trainer  # noqa: E402

WORKER = Path(__file__).resolve().parent / "distributed_scripts" / "interrupted_run.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def trained_weights(trainer) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, f"{path.name} not written within {timeout:.0f} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def uninterrupted(tiny_flux_path, tmp_path_factory):
    """The same run trained straight to step 4, in this process: the weights a resume must reproduce."""
    trainer = run_trainer(tiny_flux_path, str(tmp_path_factory.mktemp("straight") / "out"), max_steps=4)
    trainer.train()
    return trained_weights(trainer)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_every_trained_step_and_the_run_resumes_bit_exactly(
    tiny_flux_path, tmp_path, uninterrupted, signum
):
    """The worker waits after optimizer step 2 until the signal arrives, so the step in progress is step 3: the
    trainer finishes it, saves checkpoint-3 although save_steps is 100, and stops with status 128 + the signal."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), tiny_flux_path, str(tmp_path), "0"], env=ENV, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    wait_for(tmp_path / "ready0", proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signum, stderr[-4000:]
    done = json.loads((tmp_path / "done0.json").read_text())
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert done["interrupted"] and done["global_step"] == 3 and done["checkpoint"] == str(checkpoint)
    assert signal.Signals(signum).name in done["message"] and "resume_from_checkpoint" in done["message"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3"]

    resumed = run_trainer(tiny_flux_path, str(tmp_path / "out"), max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    # Bit-exact: the resume replays the seeds of steps 3 and 4 on the checkpoint's weights and optimizer state.
    weights = trained_weights(resumed)
    assert weights.keys() == uninterrupted.keys()
    assert all(torch.equal(weights[n], uninterrupted[n]) for n in weights)


def test_a_signal_to_one_of_two_processes_stops_both_with_one_checkpoint(tiny_flux_path, tmp_path):
    """Under torchrun (2 gloo processes) only rank 1 is signalled: the ranks agree after the step, both save
    checkpoint-3 together and stop with the same error."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(_free_port()), str(WORKER), tiny_flux_path, str(tmp_path), "1"],
        env={**ENV, "ACCELERATE_USE_CPU": "1"}, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_for(tmp_path / "ready1", proc)
        pid = int((tmp_path / "pid1").read_text())
        os.kill(pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = [json.loads((tmp_path / f"done{r}.json").read_text()) for r in range(2)]
    assert all(d["interrupted"] and d["global_step"] == 3 for d in done), (done, stderr[-4000:])
    assert (tmp_path / "out" / "checkpoint-3" / "trainer_state.json").is_file()
