"""A 2-node job as users launch it, on one host: one CPU process per "node" (gloo), rendezvous on 127.0.0.1.

- A node's process killed (SIGKILL) in the update of optimizer step 3: the other stops with ``PeerLost`` naming the
  lost rank and its node and the last complete checkpoint, ``checkpoint-2``, which a 2-node resume continues to step
  4 with the weights of an uninterrupted run, bit for bit. DDP under ``accelerate launch --num_machines 2
  --machine_rank R`` (the non-main node killed) and the trainer's FSDP2 under ``torchrun --nnodes 2 --node_rank R``
  (the main node killed: the one that saves, and hosts the rendezvous store).
- The Slurm recipe of ``docs/distributed.md`` run as written, ``scontrol`` and ``srun`` standing in for Slurm's with
  the variables Slurm sets given by hand.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from trl_jagg.trainer import peer_watch
from trl_jagg.trainer.peer_watch import FAILED, FINISHED, SILENCE_WINDOW, PeerWatch, lost_message, peers_watched
from trl_jagg.utils.distributed import check_world_size
from trl_jagg.utils.errors import PeerLost

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "distributed_scripts" / "multinode_run.py"
LORA_FILE = "pytorch_lora_weights.safetensors"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
STARTUP_TIMEOUT = 240  # two launches starting and training 2 + 2 steps on a shared 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_command(launcher: str, node: int, port: int) -> list[str]:
    """The launch of one node of a 2-node job, one process per node, its rendezvous on 127.0.0.1:``port``."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]  # fmt: skip
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2", "--machine_rank",
            str(node), "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
            "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip


def _start_nodes(launcher: str, *args: str) -> list[subprocess.Popen]:
    port = _free_port()
    env = {**ENV, "ACCELERATE_USE_CPU": "1"}  # accelerate's --multi_gpu on CPU processes (docs/distributed.md)
    commands = [[*_node_command(launcher, node, port), str(WORKER), *args] for node in (0, 1)]
    return [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in commands]


def _finish(nodes: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each node's stderr, once its launcher has ended (both are killed past ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    errors = []
    for node in nodes:
        try:
            errors.append(node.communicate(timeout=max(1.0, deadline - time.monotonic()))[1])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
    return errors


def _wait_for(path: Path, nodes: list[subprocess.Popen], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        ended = [node for node in nodes if node.poll() is not None]
        if ended or time.monotonic() > deadline:
            for node in nodes:
                node.kill()
            raise AssertionError(f"{path.name} never appeared: {[n.communicate()[1][-3000:] for n in nodes]}")
        time.sleep(0.05)
    return path.read_text()


# ---------------------------------------------------------------- the heartbeat, in one process
@pytest.fixture
def store_server():
    """A rendezvous store as torchrun's agent hosts it, and a factory of its clients."""
    port = _free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def client():
        return torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))

    return server, client


def test_the_silent_and_the_failed_are_told_from_the_live_and_the_finished(store_server):
    """4 processes on 2 nodes: rank 1 beats on, rank 2 died after a few beats (its counter stops, no sign-off),
    rank 3 signed off after an error of its own before rank 0's error, rank 0 watches."""
    _, client = store_server
    watches = [PeerWatch(client(), rank, 4, 2, "job") for rank in (0, 1)]
    dead = client()
    for _ in range(3):
        dead.add("job/beat/2", 1)
    dead.add("job/done/3", FAILED)
    try:
        assert watches[0].peers_down(window=1.0) == ([2], [3])
        assert [watches[0].node(r) for r in (1, 2, 3)] == [0, 1, 1]
        watches[1].stop(FINISHED)  # it finished first: it stopped beating, but is not lost
        assert watches[0].peers_down(window=1.0) == ([2], [3])
    finally:
        for watch in watches:
            watch.stop(FINISHED)


def test_a_neighbour_silent_for_the_timeout_is_reported_from_the_heartbeat_thread(store_server):
    """Each process watches the next rank's counter. Ranks 0, 1 and 3 beat; rank 2 beat twice and froze: rank 1
    reports it once its silence passes the timeout, the others report nothing (a report ends its process, so rank 1
    beats no more: rank 0 would report it a timeout later). A process that signed off (it finished) is not reported,
    however long it stays still."""
    _, client = store_server
    reports = {rank: [] for rank in range(4)}
    frozen = client()
    frozen.add("job/beat/2", 2)
    watches = [PeerWatch(client(), rank, 4, 2, "job", 1.0, reports[rank].append) for rank in (0, 1, 3)]
    deadline = time.monotonic() + 30
    while not reports[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reports == {0: [], 1: [[2]], 2: [], 3: []}
    for watch in watches:
        watch.stop(FINISHED)
    frozen.add("done/beat/2", 2)
    frozen.add("done/done/2", FINISHED)
    watch = PeerWatch(client(), 1, 4, 2, "done", 1.0, reports[1].append)
    time.sleep(2.0)
    watch.stop(FINISHED)
    assert reports[1] == [[2]]


def test_a_lost_store_names_the_node_that_hosted_it(monkeypatch):
    port = _free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
    watch = PeerWatch(client, 3, 4, 2, "job")
    try:
        del server  # the store's host (node 0: torchrun's agent there) is gone
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        assert watch.peers_down(window=0.5) == ([0, 1], [])
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # without torchrun, rank 0 hosts it
        assert watch.peers_down(window=0.5) == ([0], [])
    finally:
        watch.stop(FINISHED)


def test_an_error_in_train_becomes_peer_lost_only_when_a_peer_is_lost(store_server, tmp_path, monkeypatch):
    """Rank 0 of 2 raises inside ``peers_watched``: unchanged while rank 1 beats, ``PeerLost`` naming rank 1 (from
    the original error) once it stopped beating."""
    _, client = store_server
    monkeypatch.setattr(peer_watch, "SILENCE_WINDOW", 0.5)
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True, ddp_timeout=1800)
    for prefix in ("alive", "dead"):
        peer = PeerWatch(client(), 1, 2, 1, prefix)
        if prefix == "dead":
            peer._stopped.set()  # killed: no more beats, no sign-off
            peer._thread.join()
        monkeypatch.setattr(PeerWatch, "start", classmethod(lambda cls, *a, p=prefix: cls(client(), 0, 2, 1, p, *a)))
        expected = ValueError if prefix == "alive" else PeerLost
        with pytest.raises(expected) as raised, peers_watched(args, lambda: 2):
            raise ValueError("Connection closed by peer")
        peer.stop(FINISHED)
    assert raised.value.ranks == [1] and raised.value.nodes == [1]
    assert isinstance(raised.value.__cause__, ValueError)
    assert "lost rank 1 (node 1)" in str(raised.value) and "during optimizer step 3" in str(raised.value)


def test_the_message_names_the_last_complete_checkpoint(store_server, tmp_path):
    _, client = store_server
    watch = PeerWatch(client(), 0, 4, 2, "job")
    watch.stop(FINISHED)
    for name in ("checkpoint-2", "checkpoint-10", "tmp-checkpoint-12"):  # the staging folder of a save cut short
        (tmp_path / name).mkdir()
    cause = "this process got RuntimeError: Connection closed\nby peer"
    message = lost_message(watch, [2], [3], 11, str(tmp_path), True, cause)
    assert "\n" not in message
    assert "lost rank 2 (node 1)" in message and "rank 3 (node 1) stopped with an error" in message
    assert "during optimizer step 12" in message
    assert f"last complete checkpoint: {tmp_path / 'checkpoint-10'};" in message
    assert f"--resume_from_checkpoint {tmp_path / 'checkpoint-10'}" in message
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no checkpoint was saved" in lost_message(watch, [2], [], 0, str(empty), True, cause)
    assert "on node 0" in lost_message(watch, [2], [], 0, str(empty), False, cause)  # node 0 saves, maybe elsewhere


# ---------------------------------------------------------------- two nodes
@pytest.mark.slow  # two 2-node launches: ~40 s on 2 shared cores
@pytest.mark.parametrize(
    ("backend", "launcher", "victim"), [("ddp", "accelerate", 1), ("fsdp2", "torchrun", 0)], ids=["ddp", "fsdp2"]
)
def test_a_killed_node_stops_the_other_and_its_checkpoint_resumes_bit_exactly(
    tiny_flux_path, tmp_path, backend, launcher, victim
):
    nodes = _start_nodes(launcher, tiny_flux_path, str(tmp_path), backend, "kill", str(victim))
    pid = int(_wait_for(tmp_path / "victim", nodes, STARTUP_TIMEOUT))
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    # The survivor names the lost process within the silence window (gloo raises at once when the dead process's
    # connections close); a generous margin for a loaded machine, still far below ddp_timeout (120 s here).
    errors = _finish(nodes, timeout=SILENCE_WINDOW + 60)
    exited = time.time()
    survivor = 1 - victim
    assert nodes[victim].returncode != 0 and nodes[survivor].returncode != 0, errors
    record = json.loads((tmp_path / f"survivor{survivor}.json").read_text())
    assert record["ranks"] == [victim] and record["nodes"] == [victim]
    message = record["message"]
    assert "\n" not in message and f"lost rank {victim} (node {victim})" in message
    assert "during optimizer step 3" in message
    assert message in errors[survivor]  # what the process said on its way out
    checkpoint = re.search(r"last complete checkpoint: (\S+);", message).group(1)
    assert checkpoint == str(tmp_path / "run" / "checkpoint-2")
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]
    print(
        f"{backend}: SIGKILL -> PeerLost {record['caught'] - killed:.2f} s, -> launcher exit {exited - killed:.2f} s"
    )

    # Both nodes resume from the named checkpoint and train steps 3 and 4.
    nodes = _start_nodes(launcher, tiny_flux_path, str(tmp_path), backend, "resume", checkpoint)
    errors = _finish(nodes, timeout=STARTUP_TIMEOUT)
    assert [node.returncode for node in nodes] == [0, 0], [e[-3000:] for e in errors]
    resumed, straight = (load_file(str(tmp_path / run / LORA_FILE)) for run in ("run", "straight"))
    at_checkpoint = load_file(str(Path(checkpoint) / LORA_FILE))
    assert resumed.keys() == straight.keys() == at_checkpoint.keys() and resumed
    assert all(torch.equal(resumed[k], straight[k]) for k in straight), "the resumed run is not the straight run"
    assert any(not torch.equal(resumed[k], at_checkpoint[k]) for k in straight)  # steps 3 and 4 trained


def test_launchers_world_size_is_read_before_slurms_pmi_task_count():
    """``srun --mpi=pmi2`` sets PMI_SIZE to its task count (one launcher per node) in every process a launcher
    starts, beside the launcher's WORLD_SIZE: the launcher's count is the one to check, as accelerate reads it."""
    slurm = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1", "PMI_SIZE": "2", "PMI_RANK": "1"}
    check_world_size(16, {**slurm, "WORLD_SIZE": "16", "RANK": "9", "LOCAL_WORLD_SIZE": "8"})
    with pytest.raises(RuntimeError, match="WORLD_SIZE=16"):
        check_world_size(1, {**slurm, "WORLD_SIZE": "16"})  # each process alone: still refused
    with pytest.raises(RuntimeError, match="PMI_SIZE=2"):
        check_world_size(1, slurm)  # an MPI launch the state did not pick up


FAKE_SLURM = {
    # `scontrol show hostnames LIST`: one host per line (the list here is comma-separated host names).
    "scontrol": '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] || exit 2\ntr , "\\n" <<< "$3"\n',
    # `srun CMD` in a 2-node allocation with --ntasks-per-node=1: one task per node, each with its node's variables.
    "srun": (
        "#!/bin/bash\npids=()\nfor ((node = 0; node < SLURM_NNODES; node++)); do\n"
        '  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 PMI_RANK=$node PMI_SIZE=$SLURM_NNODES "$@" &\n'
        '  pids+=($!)\ndone\nstatus=0\nfor pid in "${pids[@]}"; do wait $pid || status=1; done\nexit $status\n'
    ),
}


def _slurm_recipe() -> str:
    """The sbatch script of docs/distributed.md (its one bash block with #SBATCH lines)."""
    text = (ROOT / "docs" / "distributed.md").read_text()
    (script,) = [block for block in re.findall(r"```bash\n(.*?)```", text, re.S) if "#SBATCH" in block]
    return script


@pytest.mark.slow  # two launchers, each relaunching under accelerate: ~40 s on 2 shared cores
def test_the_docs_slurm_recipe_runs_as_written(tiny_flux_path, tmp_path):
    """The recipe with the variables Slurm would set for a 2-node allocation of one GPU per node (given by hand; the
    GPUs are CPU processes): both nodes join one job of 2 processes, which trains and saves one checkpoint."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKE_SLURM.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sh").write_text(_slurm_recipe())
    (tmp_path / "recipe.yaml").write_text(
        f"model_name_or_path: {tiny_flux_path}\nreward_funcs: [prompt_color]\nprompts: [a red circle, a blue square]\n"
        "use_peft: true\nlora_r: 4\nlora_alpha: 8\nper_device_train_batch_size: 2\nnum_generations: 2\n"
        "num_inference_steps: 2\nheight: 32\nwidth: 32\nmax_sequence_length: 16\nmax_steps: 1\nsave_steps: 1\n"
        "use_cpu: true\nreport_to: none\ndisable_tqdm: true\noutput_dir: out\n"
    )
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "127.0.0.1,localhost", "SLURM_NNODES": "2",
             "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "1"}  # fmt: skip
    env = {**ENV, **slurm, "MAIN_PORT": str(_free_port()), "ACCELERATE_USE_CPU": "1",
           "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    env.pop("TRL_JAGG_ACCELERATE_LAUNCHED", None)
    proc = subprocess.run(["bash", "job.sh"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    checkpoint = tmp_path / "out" / "checkpoint-1"
    # One RNG state per process of the job: the two nodes formed one world of 2 (a node that read the variables
    # wrong would wait for the other at the rendezvous, or train alone and be refused).
    assert sorted(p.name for p in checkpoint.glob("rng_state*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert (tmp_path / "out" / LORA_FILE).is_file()
