"""The JAGG engine under 2-process DDP (gloo, CPU) gives the gradient of one process on the whole batch.

This pins the distributed contract of the engine: several backward units per micro-batch (exact steps and joint
JAGG groups) with ``no_sync`` on all but the last, as the trainer runs them through ``accelerator.no_sync``.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from trl_jagg.grpo import ppo_step_loss
from trl_jagg.jagg import JaggEngine, plan_groups
from trl_jagg.sampling import sampler_step

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
    engine = JaggEngine(
        lambda i: model(latents[:, trained[i]], sigmas[trained[i]].view(1, 1)), loss_fn, sync_context=sync,
        loss_weight=1 / len(trained),
    )  # fmt: skip
    engine.run(groups)
    return [p.grad.detach().clone() for p in model.parameters()]


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DistributedDataParallel(Velocity())
    half = BATCH // 2
    grads = _gradients(
        model,
        slice(rank * half, (rank + 1) * half),
        lambda last: contextlib.nullcontext() if last else model.no_sync(),
    )
    if rank == 0:
        queue.put([g.numpy() for g in grads])
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_engine_matches_single_process():
    torch.manual_seed(0)
    reference = _gradients(Velocity(), slice(0, BATCH), None)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_worker, args=(_free_port(), queue), nprocs=2, join=True, start_method="spawn")
    ddp = [torch.from_numpy(g) for g in queue.get(timeout=60)]
    for a, b in zip(reference, ddp):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
