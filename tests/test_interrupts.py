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
CASES = Path(__file__).resolve().parent / "distributed_scripts" / "signal_cases.py"
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


def start(script: Path, *args: str, processes: int = 1) -> subprocess.Popen:
    """``script`` in one process, or under torchrun (gloo on CPU, on 127.0.0.1); stderr to a file (a pipe nobody
    reads while waiting could fill up and block the worker)."""
    if processes == 1:
        command = [sys.executable, str(script), *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script), *args]  # fmt: skip
    log = open(Path(args[1]) / "stderr.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command, env={**ENV, "ACCELERATE_USE_CPU": "1"}, text=True, stdout=log, stderr=log)


def finish(proc: subprocess.Popen, work: Path) -> str:
    """Wait for ``proc`` (killed if it outlives its timeout) and return the end of its log."""
    try:
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return (work / "stderr.log").read_text()[-4000:]


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


def test_a_signal_while_a_reward_hangs_abandons_it_saves_the_trained_steps_and_resumes_bit_exactly(
    tiny_flux_path, tmp_path, uninterrupted
):
    """Step 3's reward never returns (default reward_timeout): SIGTERM abandons it as its deadline would, the
    rollout it scored is dropped, checkpoint-2 holds steps 1 and 2, the process exits 128 + 15, and the resume
    trains steps 3 and 4 to the uninterrupted run's weights."""
    proc = start(CASES, tiny_flux_path, str(tmp_path), "hung-reward")
    wait_for(tmp_path / "in_reward0", proc)
    proc.send_signal(signal.SIGTERM)
    log = finish(proc, tmp_path)
    assert proc.returncode == 128 + signal.SIGTERM, log
    done = json.loads((tmp_path / "done0.json").read_text())
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert done["interrupted"] and done["global_step"] == 2 and done["checkpoint"] == str(checkpoint), done
    assert "SIGTERM" in done["message"] and "reward" in done["message"] and str(checkpoint) in done["message"]
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]

    resumed = run_trainer(tiny_flux_path, str(tmp_path / "out"), max_steps=4)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    weights = trained_weights(resumed)
    assert weights.keys() == uninterrupted.keys()
    assert all(torch.equal(weights[n], uninterrupted[n]) for n in weights)  # bit-exact: the same seeds and state


def test_a_second_signal_ends_the_process_at_once(tiny_flux_path, tmp_path):
    """A reward that cannot be abandoned (reward_timeout=None: it runs in the trainer's thread) never returns: the
    first SIGTERM is recorded, the second gets the default handler, which ends the process by the signal (no
    checkpoint, no return from train())."""
    proc = start(CASES, tiny_flux_path, str(tmp_path), "second-signal")
    wait_for(tmp_path / "in_reward0", proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(tmp_path / "first_signal0", proc)
    proc.send_signal(signal.SIGTERM)
    log = finish(proc, tmp_path)
    assert proc.returncode == -signal.SIGTERM, log  # killed by the signal itself
    assert not (tmp_path / "done0.json").exists() and checkpoints(tmp_path / "out") == []


@pytest.fixture(scope="module")
def uninterrupted_two_processes(tiny_flux_path, tmp_path_factory):
    """The run trained straight to step 4 by two torchrun processes: the weights their resume must reproduce."""
    work = tmp_path_factory.mktemp("straight2")
    proc = start(CASES, tiny_flux_path, str(work), "straight", processes=2)
    log = finish(proc, work)
    assert proc.returncode == 0, log
    return torch.load(work / "weights0.pt")


@pytest.mark.parametrize("signalled", ["1", "all"], ids=["one-process", "every-process"])
def test_a_signal_to_one_or_every_process_ends_with_one_checkpoint_and_a_bit_exact_resume(
    tiny_flux_path, tmp_path, uninterrupted_two_processes, signalled
):
    """Under torchrun (2 gloo processes) SIGTERM reaches rank 1 only, or every rank (as Slurm sends it): the ranks
    agree after step 3, save checkpoint-3 together, stop with the same error, and resume from it (each rank in its
    own process) to the weights of the uninterrupted two-process run."""
    proc = start(CASES, tiny_flux_path, str(tmp_path), "resumed", signalled, processes=2)
    try:
        ranks = [0, 1] if signalled == "all" else [int(signalled)]
        for rank in ranks:
            wait_for(tmp_path / f"ready{rank}", proc)
        for rank in ranks:
            os.kill(int((tmp_path / f"pid{rank}").read_text()), signal.SIGTERM)
    finally:
        log = finish(proc, tmp_path)
    assert proc.returncode == 0, log
    done = [json.loads((tmp_path / f"done{r}.json").read_text()) for r in range(2)]
    checkpoint = str(tmp_path / "out" / "checkpoint-3")
    assert all(d["interrupted"] and d["global_step"] == 3 and d["checkpoint"] == checkpoint for d in done), done
    assert [c for c in checkpoints(tmp_path / "out") if c != "checkpoint-4"] == ["checkpoint-3"]  # 4: the resume's
    assert sorted(p.name for p in Path(checkpoint).glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    for rank in range(2):  # DDP: every rank holds the same weights
        weights = torch.load(tmp_path / f"weights{rank}.pt")
        assert weights.keys() == uninterrupted_two_processes.keys()
        assert all(torch.equal(weights[n], uninterrupted_two_processes[n]) for n in weights)
