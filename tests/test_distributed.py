"""The JAGG engine under 2-process DDP and FSDP2 (gloo, CPU) gives the gradient of one process on the whole batch.

This pins the distributed contract of the engine: several backward units per micro-batch (exact steps and joint
JAGG groups) with ``no_sync`` on all but the last, as the trainer runs them through ``accelerator.no_sync``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from trl_jagg.core.grpo import ppo_step_loss
from trl_jagg.core.jagg import JaggEngine, StepFunctions, plan_groups
from trl_jagg.core.sampling import sampler_step

BATCH, DIM, STEPS = 8, 6, 7


class Velocity(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM + 1, 16), torch.nn.Tanh(), torch.nn.Linear(16, DIM))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, t.expand(z.shape[0], 1)], dim=1))


def _data():
    g = torch.Generator().manual_seed(1)
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    latents = torch.randn(BATCH, STEPS + 1, DIM, generator=g)
    old = torch.randn(BATCH, STEPS, generator=g) * 0.01 - 1.0
    adv = torch.randn(BATCH, generator=g)
    return sigmas, latents, old, adv


def _gradients(model: torch.nn.Module, rows: slice, sync) -> list[torch.Tensor]:
    sigmas, latents, old, adv = _data()
    latents, old, adv = latents[rows], old[rows], adv[rows]
    trained = list(range(STEPS - 1))

    def loss_fn(i: int, v: torch.Tensor) -> torch.Tensor:
        k = trained[i]
        step = sampler_step(v, latents[:, k], sigmas[k], sigmas[k + 1], noise_level=0.7, sigma_max=sigmas[1],
                            prev_sample=latents[:, k + 1])  # fmt: skip
        return ppo_step_loss(step.log_prob, old[:, k], adv, 0.2).loss

    groups = plan_groups([float(sigmas[k]) for k in trained], 4, 0.5)  # one JAGG group, then exact steps
    assert [g.method for g in groups] == ["jagg", "exact"]
    functions = StepFunctions(lambda i: model(latents[:, trained[i]], sigmas[trained[i]].view(1, 1)), loss_fn)
    JaggEngine().run(groups, functions, sync_context=sync, loss_weight=1 / len(trained))
    return [p.grad.detach().clone() for p in model.parameters()]


def _worker(rank: int, port: int, wrap: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    half = BATCH // 2
    rows = slice(rank * half, (rank + 1) * half)
    if wrap == "ddp":
        model = DistributedDataParallel(Velocity())
        grads = _gradients(model, rows, lambda last: contextlib.nullcontext() if last else model.no_sync())
    else:  # FSDP2: shard each layer, then the root; gradients come back as sharded DTensors
        from torch.distributed.fsdp import fully_shard

        model = Velocity()
        for layer in model.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        grads = [g.full_tensor() for g in _gradients(model, rows, None)]
    if rank == 0:
        queue.put([g.numpy() for g in grads])
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_engine_under_two_processes_matches_single_process(wrap):
    torch.manual_seed(0)
    reference = _gradients(Velocity(), slice(0, BATCH), None)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_worker, args=(_free_port(), wrap, queue), nprocs=2, join=True, start_method="spawn")
    ddp = [torch.from_numpy(g) for g in queue.get(timeout=60)]
    for a, b in zip(reference, ddp):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


TRAIN_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from datasets import Dataset
from peft import LoraConfig
from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

model_path, out = sys.argv[1], sys.argv[2]
args = GRPOJaggConfig(
    output_dir=out, per_device_train_batch_size=2, num_generations=2, num_inference_steps=4, height=32, width=32,
    max_steps=2, learning_rate=1e-2, epsilon=0.1, jagg_group_size=3, jagg_frac=1.0, max_sequence_length=16,
    report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
)
trainer = DDPOJaggTrainer(
    model=model_path, reward_funcs="prompt_color", args=args,
    train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square", "a blue circle", "a red square"]}),
    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k"], init_lora_weights="gaussian"),
)
trainer.train()
model = trainer.accelerator.unwrap_model(trainer.model)
params = {n: p.detach().double().sum().item() for n, p in model.named_parameters() if p.requires_grad}
logs = [e for e in trainer.state.log_history if "reward" in e]
rank = trainer.accelerator.process_index
json.dump({"world": trainer.accelerator.num_processes, "params": params, "logs": logs}, open(f"{out}/rank{rank}.json", "w"))
"""


def test_trainer_under_two_process_ddp(tiny_flux_path, tmp_path):
    """torchrun with 2 CPU processes (gloo): the world really has 2 ranks, rewards are gathered across them
    (one global group normalisation), and the DDP-reduced update keeps both ranks' weights identical."""
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(script), tiny_flux_path, str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["logs"][0]["reward"] == ranks[1]["logs"][0]["reward"]  # gathered over both ranks
    assert len(ranks[0]["logs"]) == 2


# ---------------------------------------------------------------- degraded launches are refused
@pytest.mark.parametrize(
    ("env", "num_processes", "cause"),
    [
        # `--multi_gpu` without the CPU switch on a CPU machine: torchrun started 2, each process is alone.
        ({"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "no"}, 1, "WORLD_SIZE=2"),
        # mpirun multi-CPU launch whose state did not pick up the MPI world.
        ({"PMI_SIZE": "4"}, 2, "PMI_SIZE=4"),
        # `accelerate launch --cpu --num_processes 2`: MASTER_ADDR set, one process started.
        ({"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 1, "MASTER_ADDR"),
    ],
)
def test_world_size_mismatch_is_refused(env, num_processes, cause):
    from trl_jagg.utils.distributed import check_world_size

    with pytest.raises(RuntimeError, match=cause):
        check_world_size(num_processes, env)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "ACCELERATE_MIXED_PRECISION": "no"},  # a real 2-process run
        {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},  # torchrun --nproc_per_node 1
        {"ACCELERATE_MIXED_PRECISION": "no"},  # accelerate launch of one process
    ],
)
def test_consistent_world_size_is_accepted(env):
    from trl_jagg.utils.distributed import check_world_size

    check_world_size(int(env.get("WORLD_SIZE", 1)) if env.get("MASTER_ADDR") else 1, env)


def test_fsdp_or_deepspeed_fallback_is_refused():
    from trl_jagg.utils.distributed import check_backend

    with pytest.raises(RuntimeError, match="ACCELERATE_USE_FSDP=true.*runs MULTI_CPU"):
        check_backend("MULTI_CPU", 2, fsdp_requested=False, env={"ACCELERATE_USE_FSDP": "true"})
    with pytest.raises(RuntimeError, match=r"TrainingArguments\.fsdp.*runs MULTI_GPU"):
        check_backend("MULTI_GPU", 2, fsdp_requested=True, env={})
    with pytest.raises(RuntimeError, match="ACCELERATE_USE_DEEPSPEED=true.*runs NO"):
        check_backend("NO", 1, fsdp_requested=False, env={"ACCELERATE_USE_DEEPSPEED": "true"})
    check_backend("FSDP", 2, fsdp_requested=True, env={"ACCELERATE_USE_FSDP": "true"})
    check_backend("DEEPSPEED", 2, fsdp_requested=False, env={"ACCELERATE_USE_DEEPSPEED": "true"})
    check_backend("MULTI_CPU", 2, fsdp_requested=False, env={"ACCELERATE_USE_FSDP": "false"})
    # The trainer's own sharding: not on top of accelerate's, not in one process.
    with pytest.raises(ValueError, match="fully_shard_backbone.*already shards it \\(FSDP\\)"):
        check_backend("FSDP", 2, fsdp_requested=True, fully_shard_backbone=True, env={"ACCELERATE_USE_FSDP": "true"})
    with pytest.raises(ValueError, match="fully_shard_backbone=True needs several processes, got 1"):
        check_backend("NO", 1, fsdp_requested=False, fully_shard_backbone=True, env={})
    check_backend("MULTI_CPU", 2, fsdp_requested=False, fully_shard_backbone=True, env={})


def test_fsdp_plugin_sharded_state_dict_is_refused():
    """Under accelerate's FSDP plugin with SHARDED_STATE_DICT (FSDP2's default) transformers' Trainer never hands the
    trainer gathered weights to save: refused at start, naming the setting and its fix."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from trl_jagg.utils.distributed import check_backend

    def plugin(state_dict_type: str | None) -> FullyShardedDataParallelPlugin:
        return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)

    refused = "fsdp_state_dict_type SHARDED_STATE_DICT.*`fsdp_state_dict_type: FULL_STATE_DICT`"
    for state_dict_type in ("SHARDED_STATE_DICT", None):  # None: the plugin's own default for FSDP2
        with pytest.raises(ValueError, match=refused):
            check_backend("FSDP", 2, fsdp_requested=False, fsdp_plugin=plugin(state_dict_type), env={})
    check_backend("FSDP", 2, fsdp_requested=False, fsdp_plugin=plugin("FULL_STATE_DICT"), env={})


def test_ema_under_fsdp_version_1_is_refused(tmp_path):
    """FSDP version 1's flat parameters are neither whole weights nor DTensor shards: the EMA would average garbage."""
    from types import SimpleNamespace

    from trl_jagg import GRPOJaggConfig
    from trl_jagg.trainer.ema import EMAWeights

    args = GRPOJaggConfig(output_dir=str(tmp_path), ema_decay=0.9, report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="ema_decay > 0 is not supported with FSDP version 1"):
        fsdp1 = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=object()), is_fsdp2=False)
        EMAWeights(args, lambda: [torch.nn.Parameter(torch.zeros(2))], accelerator=fsdp1)


def test_nft_under_fsdp_version_1_is_refused():
    """The same for DiffusionNFT's old policy, a per-process copy of the trained weights."""
    from types import SimpleNamespace

    from trl_jagg.core.nft import old_policy_decay
    from trl_jagg.trainer.old_policy import OldPolicy

    decay = functools.partial(old_policy_decay, decay_type=1)
    fsdp1 = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=object()), is_fsdp2=False)
    with pytest.raises(ValueError, match="objective='nft' is not supported with FSDP version 1"):
        OldPolicy(lambda: [torch.nn.Parameter(torch.zeros(2))], decay, accelerator=fsdp1)
    fsdp2 = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=object()), is_fsdp2=True)
    assert OldPolicy(lambda: [torch.nn.Parameter(torch.zeros(2))], decay, accelerator=fsdp2).weights


REFUSED_SCRIPT = """
import os
import sys

import torch
with open(sys.argv[1], "a") as started:  # one line per process the launcher started
    started.write(f"{os.getpid()}\\n")
from datasets import Dataset
from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

args = GRPOJaggConfig(output_dir="unused", per_device_train_batch_size=2, num_generations=2, use_cpu=True,
                      report_to="none")
DDPOJaggTrainer(model="never-loaded", reward_funcs="prompt_color", args=args,
                train_dataset=Dataset.from_dict({"prompt": ["a red circle"]}))
"""


def test_accelerate_launch_cpu_two_processes_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` really starts one process; the trainer says so and stops.

    Asserted on the project's own behaviour (exit status, its own message, the processes that ran), never on how
    often accelerate relays a child's error: 1.16 prints it twice where 1.15 printed it once."""
    import subprocess
    import sys

    script, started = tmp_path / "train.py", tmp_path / "started.txt"
    script.write_text(REFUSED_SCRIPT)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(script),
           str(started)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    assert len(started.read_text().splitlines()) == 1  # the launcher started one process ...
    assert "but started one" in proc.stderr, proc.stderr[-3000:]  # ... which refused with the trainer's message


def test_accelerate_configs_load():
    """The shipped accelerate configs parse with accelerate's own loader, with the setup their name promises."""
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file

    folder = Path(__file__).resolve().parents[1] / "examples" / "accelerate_configs"
    assert sorted(p.name for p in folder.glob("*.yaml")) == [
        "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "fsdp2.yaml", "multi_gpu.yaml", "single_gpu.yaml"
    ]  # fmt: skip
    configs = {p.stem: load_config_from_file(str(p)) for p in folder.glob("*.yaml")}
    assert {name: str(c.distributed_type.value) for name, c in configs.items()} == {
        "single_gpu": "NO", "multi_gpu": "MULTI_GPU", "fsdp2": "FSDP", "deepspeed_zero2": "DEEPSPEED",
        "deepspeed_zero3": "DEEPSPEED",
    }  # fmt: skip
    fsdp = configs["fsdp2"].fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert configs["deepspeed_zero2"].deepspeed_config["zero_stage"] == 2
    zero3 = configs["deepspeed_zero3"].deepspeed_config
    assert zero3["zero_stage"] == 3 and zero3["zero3_save_16bit_model"] is True  # the diffusers weights at each save
    # The documented wrap classes are the backbones' blocks in the installed diffusers.
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel

    assert fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",") == FluxTransformer2DModel._no_split_modules
    text = (folder.parents[1] / "docs" / "distributed.md").read_text()
    for backbone in (FluxTransformer2DModel, SD3Transformer2DModel, QwenImageTransformer2DModel):
        assert f"`{','.join(backbone._no_split_modules)}`" in text, backbone.__name__
    for name in configs:
        assert f"--config_file examples/accelerate_configs/{name}.yaml" in text, name


# ---------------------------------------------------------------- FSDP2 through the trainer
def _load_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / "distributed_scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _accelerate_launch_fsdp2(script: str, *args: str, timeout: int = 300):
    """``accelerate launch --config_file examples/accelerate_configs/fsdp2.yaml`` of a worker on 2 CPU processes."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent
    config = root.parent / "examples" / "accelerate_configs" / "fsdp2.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
           "--main_process_port", str(_free_port()), str(root / "distributed_scripts" / f"{script}.py"), *args]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _torchrun(script: str, *args: str, timeout: int = 300):
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent / "distributed_scripts" / f"{script}.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(path), *args]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_checked_velocity_cache_agrees_across_sharded_processes(tiny_flux_path, tmp_path):
    """`jagg_cache_mode="checked"` on 2 gloo processes with the backbone sharded (FSDP2 gathers its weights in every
    backbone call): one rollout, two optimizer steps. The worker makes the ranks disagree (rank 1's sensitivity is
    above the tolerance, rank 0's below); every rank decides on the largest, so both recompute and make the same
    backbone calls. Rank 1 recomputing alone would leave rank 0 waiting until the launch timed out."""
    import json

    _torchrun("checked_cache", str(tmp_path), tiny_flux_path)
    reports = [json.loads((tmp_path / f"checked{r}.json").read_text()) for r in range(2)]
    assert all(r["sharded"] for r in reports)
    checks = [r["checks"] for r in reports]
    # One JAGG group with an intermediate, checked in the second update only (the first is on the rollout's policy).
    assert [len(c) for c in checks] == [1, 1]
    local = [c[0]["local"] for c in checks]
    assert 0 < local[0] < 0.5 < local[1]  # alone, rank 0 would keep the correction and rank 1 recompute
    assert [c[0]["agreed"] for c in checks] == [local[1]] * 2
    # The same decision on both ranks: the second update recomputes its intermediate (one row, no graph).
    assert reports[0]["updates"] == reports[1]["updates"]
    assert [u["rejected"] for u in reports[0]["updates"]] == [0, 1]


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp2-plugin"])
def test_nft_with_the_backbone_sharded_on_two_processes(tiny_flux_path, tmp_path, backend):
    """DiffusionNFT with the LoRA backbone sharded by FSDP2 on 2 gloo processes, by the trainer at init or by
    accelerate's plugin from the shipped `fsdp2.yaml` in `train()`, after the old policy was copied whole (see
    :func:`testing_utils.check_sharded_nft_run`; DeepSpeed ZeRO-3: tests/test_deepspeed.py)."""
    from testing_utils import check_sharded_nft_run

    if backend == "fsdp2":
        _torchrun("nft_sharded", str(tmp_path), tiny_flux_path, backend)
    else:
        _accelerate_launch_fsdp2("nft_sharded", str(tmp_path), tiny_flux_path, backend)
    check_sharded_nft_run(tmp_path)


def test_trainer_gradients_on_two_processes(tiny_flux_path, tiny_wan22_path, tmp_path):
    """The trainer on 2 gloo processes against one process on the same global batch (1e-5), JAGG and exact:
    - `fully_shard_backbone=True` (blocks then root sharded with FSDP2, KL reference sharded too), LoRA and full
      fine-tuning; after two real training steps the gathered weights load into a fresh single-process pipeline
      that renders the image the sharded model renders, and a sharded run resumed from the checkpoint of step 1
      (gathered weights and optimizer state loaded back into the shards) ends with the same weights;
    - DDP with `jagg_endpoint_backward="sequential"` (LoRA);
    - DDP with Wan2.2 A14B's two experts trained (LoRA): the synced backward reaches the low-noise expert only, the
      high-noise one's gradient comes from the backward calls under `no_sync` (DDP's `find_unused_parameters`)."""
    import json

    import numpy as np
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import load_file

    from trl_jagg.models import load_adapter
    from trl_jagg.models.rollout import generate_images

    worker = _load_script("fsdp_trainer")
    paths = dict(zip(worker.MODELS, (tiny_flux_path, tiny_wan22_path)))
    reference = {}
    for kind in worker.KINDS:
        path = paths[worker.KINDS[kind].get("model", "flux")]
        trainer = worker.build_trainer(path, str(tmp_path / f"ref-{kind}"), kind, world_size=1)
        batch = trainer._generate_and_score([{"prompt": p} for p in worker.PROMPTS])
        torch.save(batch, tmp_path / f"{kind}_batch.pt")
        reference[kind] = {m: worker.gradients(trainer, batch, use_jagg=m == "jagg") for m in ("jagg", "exact")}
        del trainer

    _torchrun("fsdp_trainer", str(tmp_path), *paths.values())

    reports = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(2)]
    for kind in worker.KINDS:
        assert [r[kind]["world"] for r in reports] == [2, 2]
        assert all(r[kind]["sharded"] and r[kind]["reference_sharded"] for r in reports), reports
        two_process = torch.load(tmp_path / f"{kind}_grads_2proc.pt")
        for mode in ("jagg", "exact"):
            ref = reference[kind][mode]
            assert two_process[mode].keys() == ref.keys() and len(ref) == reports[0][kind]["num_trainable"]
            assert sum(g.abs().sum() for g in ref.values()) > 0
            for name, grad in ref.items():
                torch.testing.assert_close(
                    two_process[mode][name], grad, atol=1e-5, rtol=1e-5, msg=f"{kind} {mode} {name}"
                )
        # JAGG differs from exact here (W = 3 interpolates an inner step), so the two checks are distinct.
        assert any(not torch.allclose(reference[kind]["jagg"][n], reference[kind]["exact"][n]) for n in ref)
    # Both experts were trained, each with a gradient; DDP found the unused ones (set by the trainer, not the kind).
    for expert in ("transformer.", "transformer_2."):
        assert sum(g.abs().sum() for n, g in reference["wan22-both"]["exact"].items() if n.startswith(expert)) > 0
    assert [r["wan22-both"]["find_unused_parameters"] for r in reports] == [True, True]

    for kind in ("lora", "full"):
        pipe = FluxPipeline.from_pretrained(tiny_flux_path)
        if kind == "lora":
            pipe.load_lora_weights(str(tmp_path / "lora_saved"))
        else:
            pipe.transformer = FluxTransformer2DModel.from_pretrained(str(tmp_path / "full_saved"))
        # The settings of the trainer's sample_images (build_trainer's, seed 0), in a fresh single process.
        settings = dict(num_steps=5, height=32, width=32, guidance_scale=3.5, max_sequence_length=16, seed=0)
        image = generate_images(load_adapter(pipe), [worker.RENDER_PROMPT], **settings)[0]
        rendered = np.load(tmp_path / f"{kind}_image.npy")
        assert np.abs(np.asarray(image).astype(int) - rendered.astype(int)).max() <= 1, kind
        base = generate_images(load_adapter(FluxPipeline.from_pretrained(tiny_flux_path)), [worker.RENDER_PROMPT],
                               **settings)[0]  # fmt: skip
        assert np.abs(np.asarray(base).astype(int) - rendered.astype(int)).max() > 1, "the saved weights are the base"
        name = "pytorch_lora_weights.safetensors" if kind == "lora" else "diffusion_pytorch_model.safetensors"
        straight, resumed = (load_file(str(tmp_path / f"{kind}_{end}" / name)) for end in ("saved", "resumed"))
        assert straight.keys() == resumed.keys()
        # Bit-identical on purpose: the resumed run repeats the same calls on the same shapes with the restored RNG.
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), kind
        assert (tmp_path / kind / "checkpoint-1" / "optimizer.pt").is_file()


def test_fsdp2_plugin_path_on_two_processes(tiny_flux_path, tmp_path):
    """accelerate's FSDP2 plugin from the shipped `fsdp2.yaml` on 2 gloo processes (`accelerate launch`; the worker
    relabels the CPU state so that accelerate's own FSDP2 code runs, see its docstring), EMA on:
    - the plugin wraps each transformer block, then the root, in `train()` (the trainer's KL reference at init);
    - LoRA: the saved weights and `ema/` are the full tensors of the sharded model; resuming from the checkpoint of
      step 2 (weights, EMA and full optimizer state loaded into the shards) ends with the weights and EMA of 4
      straight steps; the checkpoints hold the gathered optimizer state, not the plugin's files;
    - full fine-tuning: 2 optimizer steps with the EMA on the same global batch as one process give its weights and
      its EMA, saved in the single-process layout, and the EMA is the formula's."""
    import json

    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    worker = _load_script("fsdp_trainer")
    plugin = _load_script("fsdp2_plugin")
    trainer = worker.build_trainer(tiny_flux_path, str(tmp_path / "ref"), "full", world_size=1, **plugin.FULL)
    batch = trainer._generate_and_score([{"prompt": p} for p in worker.PROMPTS])
    torch.save(batch, tmp_path / "full_batch.pt")
    trainer.create_optimizer()
    history = [{n: p.detach().clone() for n, p in trainer.model.named_parameters()}]
    for step in range(2):
        trainer.update_stage.run(trainer.model, batch, micro_step=step, global_step=step, accumulation_steps=1)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        history.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    del trainer

    _accelerate_launch_fsdp2("fsdp2_plugin", tiny_flux_path, str(tmp_path))
    reports = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(2)]
    blocks = FluxTransformer2DModel.load_config(tiny_flux_path, subfolder="transformer")
    for report in reports:
        assert report["cpu_type"] == "DistributedType.MULTI_CPU" and report["world"] == 2 and report["plugin"]
        assert not report["sharded_before_train"] and report["sharded"] and report["full_sharded"]
        expected = {
            "FluxTransformerBlock": blocks["num_layers"],
            "FluxSingleTransformerBlock": blocks["num_single_layers"],
        }
        assert report["wrapped_blocks"] == expected

    # LoRA: what was written is the sharded model's full tensors (the file drops the adapter name).
    full = torch.load(tmp_path / "lora_full.pt")
    for folder, tensors in (("lora_saved", full["weights"]), ("lora_saved/ema", full["ema"])):
        saved = load_file(str(tmp_path / folder / "pytorch_lora_weights.safetensors"))
        expected = {"transformer." + n.replace(".default.", "."): t for n, t in tensors.items()}
        assert saved.keys() == expected.keys() and len(saved) > 0, folder
        assert all(torch.equal(saved[k], expected[k]) for k in saved), folder  # a copy, so exact
    assert any(not torch.equal(full["weights"][n], full["ema"][n]) for n in full["weights"])
    for folder in ("", "/ema"):
        straight, resumed = (load_file(str(tmp_path / f"lora_{end}{folder}" / "pytorch_lora_weights.safetensors"))
                             for end in ("saved", "resumed"))  # fmt: skip
        # Bit-identical on purpose: the resumed run repeats the same calls on the same shapes with the restored RNG.
        assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    checkpoint = tmp_path / "lora" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "ema").is_dir()
    assert not (checkpoint / "pytorch_model_fsdp.bin").exists() and not (checkpoint / "optimizer.bin").exists()

    # Full fine-tuning with EMA: 2 processes against the single process above, and the EMA against its formula.
    decay = plugin.EMA["ema_decay"]
    ema = {n: (decay * history[0][n] + (1 - decay) * history[1][n]) * decay + (1 - decay) * history[2][n]
           for n in history[0]}  # fmt: skip
    for folder, expected in (("full_saved", history[2]), ("full_saved/ema", ema)):
        saved = load_file(str(tmp_path / folder / "diffusion_pytorch_model.safetensors"))
        assert saved.keys() == expected.keys(), folder
        for name, value in expected.items():
            torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=1e-5, msg=f"{folder} {name}")
    assert (tmp_path / "full_saved" / "ema" / "config.json").is_file()
    assert any(not torch.allclose(history[0][n], history[2][n]) for n in ema)  # the steps moved the weights


# ---------------------------------------------------------------- resume and split groups on 2 processes
def test_two_process_resume_and_split_groups(tiny_flux_path, tmp_path):
    """2-process DDP (gloo). Split groups: with 3 images per rank and G = 2, a prompt's pair straddles the ranks,
    and every image's advantage is the one a single process computes on the whole gathered batch (per-prompt mean
    and std, written here). Exact resume: 2 steps, a checkpoint, a fresh trainer, 2 more steps == 4 straight steps,
    bit for bit, on both ranks (weights, losses, rewards, advantages)."""
    import json

    _torchrun("ddp_resume", tiny_flux_path, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]

    # Split groups, first rollout (the stat tracker's history is still empty): the global batch is rank 0 then 1.
    first = [r["straight"]["records"][0] for r in ranks]
    prompts = first[0]["prompts"] + first[1]["prompts"]
    rewards = torch.tensor(first[0]["rewards"] + first[1]["rewards"], dtype=torch.float64)
    advantages = torch.tensor(first[0]["advantages"] + first[1]["advantages"], dtype=torch.float64)
    assert len(prompts) == 6 and len(set(prompts)) == 3
    assert set(first[0]["prompts"]) & set(first[1]["prompts"]), "no group is split across the ranks"
    expected = torch.empty(6, dtype=torch.float64)
    for i, prompt in enumerate(prompts):
        group = rewards[[j for j, p in enumerate(prompts) if p == prompt]]
        expected[i] = (rewards[i] - group.mean()) / (group.std() + 1e-4)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(advantages, expected.clamp(-5, 5), atol=1e-5, rtol=1e-5)

    # Exact resume: the checkpoint has every process's RNG state and the trainer's own state.
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    for name in ("rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "scheduler.pt", "grpo_state.json"):
        assert (checkpoint / name).is_file(), name
    state = json.loads((checkpoint / "grpo_state.json").read_text())
    assert state["step"] == 2 and all(len(v) == 4 for v in state["stat_tracker"].values())
    for r in ranks:
        assert r["resumed"]["weights"] == r["straight"]["weights"]
        assert r["resumed"]["records"] == r["straight"]["records"][2:]
        straight_losses, resumed_losses = r["losses"]  # the resumed history starts with the checkpoint's
        assert len(straight_losses) == 4 and resumed_losses == straight_losses
    assert ranks[0]["straight"]["weights"] == ranks[1]["straight"]["weights"]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # logged losses are means over both ranks


SAME_NOISE_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
from datasets import Dataset
from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.rewards import prompt_color

model_path, out = sys.argv[1], sys.argv[2]
# 3 images per process, groups of 2: the middle group has one image on each process.
args = GRPOJaggConfig(
    output_dir=out, per_device_train_batch_size=3, num_generations=2, gradient_accumulation_steps=1,
    num_inference_steps=2, height=32, width=32, max_sequence_length=16, same_group_noise=True, report_to="none",
    save_strategy="no", use_cpu=True, disable_tqdm=True,
)
trainer = DDPOJaggTrainer(
    model=model_path, reward_funcs="prompt_color", args=args,
    train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square", "a blue circle", "a red square"]}),
)
inputs = next(iter(trainer.get_train_dataloader()))
rollout = trainer._generate_and_score(inputs)
rank = trainer.accelerator.process_index

# Rewards overlapping the update with that split group: 3 micro-batches of 1 image per process, one chunk each, so
# micro-batch 0 of rank 1 (the split group's second image) needs chunk 2 of rank 0. One step each way.
score = prompt_color()
per_sample = lambda **kwargs: score(**kwargs)  # scored chunk by chunk
per_sample.per_sample, per_sample.__name__ = True, "prompt_color"
def one_step(overlap):
    args = GRPOJaggConfig(
        output_dir=f"{out}/overlap{overlap}", per_device_train_batch_size=1, gradient_accumulation_steps=3,
        sample_batch_size=1, num_generations=2, num_inference_steps=2, height=32, width=32, max_sequence_length=16,
        max_steps=1, learning_rate=1e-2, overlap_rewards=overlap, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, logging_steps=1,
    )
    torch.manual_seed(0)
    trained = DDPOJaggTrainer(model=model_path, reward_funcs=[per_sample], args=args, train_dataset=trainer.train_dataset)
    trained.train()
    logs = [{k: v for k, v in e.items() if k in ("loss", "reward", "engine/advantages/abs_mean")} for e in trained.state.log_history[:1]]
    return [p.detach().clone() for p in trained.model.parameters()], logs
(weights, logs), (expected_weights, expected_logs) = one_step(True), one_step(False)
json.dump({"world": trainer.accelerator.num_processes, "prompts": [x["prompt"] for x in inputs],
           "noise": rollout.latents[:, 0].tolist(), "overlap_logs": [logs, expected_logs],
           "overlap_weights_equal": all(torch.equal(a, b) for a, b in zip(weights, expected_weights))},
          open(f"{out}/noise{rank}.json", "w"))
"""


def test_a_group_split_across_two_processes_shares_its_noise_and_its_rewards_overlap_the_update(
    tiny_flux_path, tmp_path
):
    import json
    import subprocess
    import sys

    script = tmp_path / "noise.py"
    script.write_text(SAME_NOISE_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(script), tiny_flux_path, str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"noise{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    prompts = ranks[0]["prompts"] + ranks[1]["prompts"]
    noise = torch.tensor(ranks[0]["noise"] + ranks[1]["noise"])
    for group in range(3):  # rows 2g and 2g + 1 of the gathered batch; group 1 spans both processes
        assert prompts[2 * group] == prompts[2 * group + 1]
        assert torch.equal(noise[2 * group], noise[2 * group + 1])
    assert not torch.allclose(noise[0], noise[2]) and not torch.allclose(noise[2], noise[4])
    # The rewards overlapping the update, resolved chunk by chunk in the same order on both ranks (no collective
    # left waiting), train the sequential step bit for bit: the same computations in another order.
    for r in ranks:
        overlapped, sequential = r["overlap_logs"]
        assert overlapped == sequential and "reward" in overlapped[0] and r["overlap_weights_equal"]


# ---------------------------------------------------------------- several machines
@pytest.mark.slow  # two launchers, each importing torch twice: ~50 s alone on 2 cores, ~2 min when shared
def test_two_machine_launch_on_one_host_trains_identical_weights(tiny_flux_path, tmp_path):
    """Machine ranks 0 and 1 of a 2-machine job (`trl-jagg train --accelerate_config multi_gpu --num_machines 2
    --machine_rank R --main_process_ip 127.0.0.1`, one CPU process each) train one step together: different local
    rollouts (each rank's own noise), one all-reduced update, so each machine saves the same weights bit for bit."""
    import ast
    import subprocess
    import sys

    from safetensors.torch import load_file

    port = str(_free_port())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    env.pop("TRL_JAGG_ACCELERATE_LAUNCHED", None)
    launches = []
    for rank in (0, 1):
        command = [
            sys.executable, "-m", "trl_jagg.scripts.cli", "train", "--accelerate_config", "multi_gpu", "--num_processes", "2",
            "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", port, "--model_name_or_path", tiny_flux_path, "--reward_funcs", "prompt_color",
            "--prompts", "a red circle", "a blue square", "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
            "--per_device_train_batch_size", "2", "--num_generations", "2", "--num_inference_steps", "3",
            "--jagg_group_size", "2", "--height", "32", "--width", "32", "--max_sequence_length", "16",
            "--max_steps", "1", "--use_cpu", "true", "--report_to", "none", "--save_strategy", "no",
            "--save_on_each_node", "true", "--disable_tqdm", "true", "--output_dir", str(tmp_path / f"machine{rank}"),
        ]  # fmt: skip
        launches.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outputs = [launch.communicate(timeout=300) for launch in launches]
    for launch, (_, err) in zip(launches, outputs):
        assert launch.returncode == 0, err[-3000:]
    logs = [[ast.literal_eval(line) for line in out.splitlines() if line.startswith("{'loss'")] for out, _ in outputs]
    assert [len(log) for log in logs] == [1, 1]
    (first,), (second,) = logs
    assert first["reward"] == second["reward"]  # gathered over both machines
    # Two ranks, not two copies of one process.
    assert first["engine/latents/final_std"] != second["engine/latents/final_std"]
    weights = [load_file(str(tmp_path / f"machine{r}" / "pytorch_lora_weights.safetensors")) for r in (0, 1)]
    assert weights[0].keys() == weights[1].keys()
    # Bit-identical on purpose: both machines apply the same all-reduced gradient to the same initial weights.
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
