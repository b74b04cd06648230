"""Distributed setup of the trainer: refusing launches that silently degrade, and FSDP2 sharding of the backbone.

Several launch paths give a run that looks distributed but is not, without any error (measured with accelerate 1.15
on CPU): ``accelerate launch --cpu --num_processes 2`` starts one process; ``--multi_gpu`` on a machine without GPUs
gives each process a non-distributed state (ranks train independently); an FSDP plugin on CPU is replaced by DDP.
:func:`check_world_size` and :func:`check_backend` compare what the launcher asked for (its environment variables)
with what the accelerator state is, and stop with the cause.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

# Where launchers put the number of processes they started: torchrun / accelerate's multi-process launchers, then
# the MPI implementations accelerate reads for multi-CPU runs. Like accelerate (`get_cpu_distributed_information`), the
# first one set counts: Slurm's PMI-2 plugin (`srun --mpi=pmi2`, many clusters' default) sets PMI_SIZE to its task
# count, one launcher per node, in every process those launchers start, beside torchrun's WORLD_SIZE.
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


# accelerate's DeepSpeed state finds no accelerator on CPU and counts 1 process per rank unless the backend is named.
DEEPSPEED_CPU_FIX = (
    ' Under DeepSpeed without GPUs (DS_ACCELERATOR=cpu), name the backend: GRPOJaggConfig(ddp_backend="gloo") '
    "(`--ddp_backend gloo`)."
)


def _true(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").strip().lower() in ("1", "true", "yes", "on")


def check_world_size(num_processes: int, env: Mapping[str, str] | None = None) -> None:
    """Raise if the launcher asked for a different number of processes than the distributed state has.

    The launcher's count is the first of ``WORLD_SIZE``, ``PMI_SIZE``, ``OMPI_COMM_WORLD_SIZE``,
    ``MV2_COMM_WORLD_SIZE`` that is set, the order accelerate reads them in: under Slurm, ``srun`` may set
    ``PMI_SIZE`` to its own task count (one per node) beside the launcher's ``WORLD_SIZE``.

    Args:
        num_processes: the processes the accelerator (``PartialState``) sees.
        env: the environment the launcher set (defaults to ``os.environ``).
    """
    env = os.environ if env is None else env
    name = next((name for name in _WORLD_SIZE_VARIABLES if env.get(name, "").isdigit()), None)
    if name is not None:
        value = env[name]
        if int(value) != num_processes:
            raise RuntimeError(
                f"The launcher started {value} processes ({name}={value}) but the accelerator sees {num_processes}: "
                "each process would train alone on its own batch, without any error. On a machine without GPUs, "
                "launch with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N ...` or "
                "`torchrun --nproc_per_node N ... --use_cpu true`; with GPUs, check that each process sees one "
                "(CUDA_VISIBLE_DEVICES, `nvidia-smi`)."
                + (DEEPSPEED_CPU_FIX if _true(env, "ACCELERATE_USE_DEEPSPEED") else "")
            )
    # accelerate's single-process launcher sets MASTER_ADDR only when asked for several processes, then starts one.
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in env
    if launched_by_accelerate and "MASTER_ADDR" in env and num_processes == 1:
        if not any(name in env for name in _WORLD_SIZE_VARIABLES):
            raise RuntimeError(
                "`accelerate launch` was asked for several processes (it set MASTER_ADDR) but started one: its "
                "single-process launcher runs e.g. `--cpu --num_processes N` as ONE process, without any error. On "
                "a machine without GPUs use `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N "
                "...` or `torchrun --nproc_per_node N ... --use_cpu true`; on GPUs drop `--cpu`. (If MASTER_ADDR "
                "comes from your environment and one process is meant, unset it.)"
            )


def check_backend(
    distributed_type: str,
    num_processes: int,
    *,
    fsdp_requested: bool,
    fully_shard_backbone: bool = False,
    deepspeed_plugin: Any = None,
    fsdp_plugin: Any = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Raise if FSDP or DeepSpeed was asked for but the accelerator state runs something else, or if the trainer's
    own sharding (``fully_shard_backbone``) cannot apply.

    Args:
        distributed_type: ``accelerator.distributed_type`` (e.g. ``"FSDP"``, ``"MULTI_CPU"``).
        num_processes: ``accelerator.num_processes``.
        fsdp_requested: whether the training arguments ask for FSDP (``TrainingArguments.fsdp``).
        fully_shard_backbone: ``GRPOJaggConfig.fully_shard_backbone``.
        deepspeed_plugin: accelerate's ``DeepSpeedPlugin`` of the run, if any: ZeRO-3 must gather the weights at
            each save (``zero3_save_16bit_model``), or checkpoints would hold no diffusers weights to resume from.
        fsdp_plugin: accelerate's ``FullyShardedDataParallelPlugin`` of the run, if any: its state dict must be the
            full one (``fsdp_state_dict_type: FULL_STATE_DICT``) for the same reason.
        env: the environment the launcher set (defaults to ``os.environ``).
    """
    env = os.environ if env is None else env
    distributed_type = str(getattr(distributed_type, "value", distributed_type))
    if (_true(env, "ACCELERATE_USE_FSDP") or fsdp_requested) and distributed_type != "FSDP":
        cause = "ACCELERATE_USE_FSDP=true" if _true(env, "ACCELERATE_USE_FSDP") else "TrainingArguments.fsdp"
        raise RuntimeError(
            f"FSDP was requested ({cause}: `accelerate launch --use_fsdp` or an FSDP config file) but the "
            f"accelerator runs {distributed_type}: accelerate never applies FSDP without GPUs and falls back to "
            "plain data parallelism without a warning. On CPU, shard the backbone in the trainer instead "
            "(`fully_shard_backbone=True` under `torchrun --nproc_per_node N ... --use_cpu true`); on GPUs check "
            "that every process sees a GPU."
        )
    if _true(env, "ACCELERATE_USE_DEEPSPEED") and distributed_type != "DEEPSPEED":
        raise RuntimeError(
            f"DeepSpeed was requested (ACCELERATE_USE_DEEPSPEED=true) but the accelerator runs {distributed_type}. "
            "Install deepspeed (`pip install deepspeed`) and launch on GPUs."
        )
    if deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3:
        zero = deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        if not zero.get("stage3_gather_16bit_weights_on_model_save", False):
            raise ValueError(
                "DeepSpeed ZeRO-3 without gathered weights at save: checkpoints would hold no LoRA / diffusers "
                "weights. Set `zero3_save_16bit_model: true` in the accelerate config (`--zero3_save_16bit_model "
                "true`; `stage3_gather_16bit_weights_on_model_save` in a DeepSpeed JSON), as deepspeed_zero3.yaml does."
            )
    state_dict_type = getattr(fsdp_plugin, "state_dict_type", None)
    state_dict_type = getattr(state_dict_type, "name", state_dict_type)  # a StateDictType, or its name
    if state_dict_type not in (None, "FULL_STATE_DICT"):
        # transformers' Trainer hands `_save` the gathered weights only with the full state dict; otherwise it
        # writes accelerate's own sharded folder of the whole backbone instead.
        raise ValueError(
            f"accelerate's FSDP plugin saves with fsdp_state_dict_type {state_dict_type} (FSDP version 2's default "
            "when the config does not set it): checkpoints would hold no LoRA / diffusers weights. Set "
            "`fsdp_state_dict_type: FULL_STATE_DICT` in the accelerate config (`--fsdp_state_dict_type "
            "FULL_STATE_DICT`), as fsdp2.yaml does."
        )
    if fully_shard_backbone:
        if distributed_type in ("FSDP", "DEEPSPEED"):
            raise ValueError(
                "GRPOJaggConfig.fully_shard_backbone=True shards the backbone in the trainer, but the accelerator "
                f"already shards it ({distributed_type}). Use one of the two (on GPUs, accelerate's FSDP2 plugin)."
            )
        if num_processes < 2:
            raise ValueError(
                "GRPOJaggConfig.fully_shard_backbone=True needs several processes, got 1. Launch with "
                "`torchrun --nproc_per_node N ...` (add `--use_cpu true` on CPU), or set it to False."
            )


def train_experts_data_parallel(args: Any, env: Mapping[str, str] | None = None) -> None:
    """Set ``args`` up for Wan2.2 A14B's two experts trained on several processes: DDP with
    ``ddp_find_unused_parameters=True``; FSDP and DeepSpeed are refused (the error names the fix).

    Each backward call runs through one expert (a JAGG group never straddles the switch), so the one that syncs the
    gradients (the last unit of an accumulation window; the others run under ``no_sync``) reaches one expert only.
    DDP's default reducer then waits for the other expert's gradients: nothing of it is reduced and the next
    forward fails. With ``find_unused_parameters`` the reducer marks the parameters the synced backward missed as
    ready and all-reduces what they accumulated since the last sync, ``no_sync`` backward calls included (torch
    counts a parameter as used once any backward since the last sync reached it): the gradient of one process on
    the global batch (``tests/test_distributed.py::test_trainer_gradients_on_two_processes``), for one graph
    traversal per synced forward. ``False`` cannot work here, so it is overridden. An expert that the synced
    backward skips is untested under FSDP's reduce-scatter and DeepSpeed's per-backward reduction: refused."""
    env = os.environ if env is None else env
    backend = None
    if args.fully_shard_backbone:
        backend = "fully_shard_backbone=True"
    elif args.fsdp or _true(env, "ACCELERATE_USE_FSDP"):
        backend = "FSDP (TrainingArguments.fsdp or accelerate's FSDP plugin)"
    elif args.deepspeed_plugin is not None or _true(env, "ACCELERATE_USE_DEEPSPEED"):
        backend = "DeepSpeed"
    if backend is not None:
        raise ValueError(
            f'GRPOJaggConfig.train_experts="both" on {args.world_size} processes trains under DDP only, but this run '
            f"uses {backend}: two trained experts are not supported with FSDP or DeepSpeed yet. Launch plain DDP "
            "(`accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml ...` or `torchrun`), or "
            'train one expert per run (train_experts="high_noise" or "low_noise").'
        )
    args.ddp_find_unused_parameters = True


@contextlib.contextmanager
def zero3_init_disabled(args: Any) -> Iterator[None]:
    """The pipeline loads with DeepSpeed's ZeRO-3 ``zero.Init`` off: transformers would partition the frozen text
    encoders at construction, and nothing gathers them (they run outside the engine); the trained backbone is
    partitioned when the engine is built. diffusers' training scripts load their frozen models outside it too
    (``deepspeed_zero_init_disabled_context_manager``); accelerate's ``zero3_init_context_manager(enable=False)``
    leaves transformers' ZeRO-3 config set (accelerate 1.15), so the config is unset here while loading (and while
    the EMA averages this process's partitions, which diffusers' EMAModel would otherwise try to gather)."""
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    config = plugin.dschf  # what transformers' weak reference points to
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(config)


def fully_shard_blocks(backbone: torch.nn.Module) -> None:
    """Shard ``backbone`` in place with FSDP2 over the default process group: each transformer block (the classes
    of diffusers' ``_no_split_modules``, the wrap unit of accelerate's ``TRANSFORMER_BASED_WRAP``), then the root.

    LoRA layers must be added before (they are sharded with their block). Parameters become ``DTensor`` shards; a
    forward or backward of the backbone is then a collective: every process must make the same calls.
    """
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(backbone, "_no_split_modules", None) or ())
    blocks = [module for module in backbone.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(backbone).__name__} declares no transformer block classes (`_no_split_modules` is "
            f"{sorted(names)}): fully_shard_backbone needs them as the wrap unit."
        )
    for block in blocks:
        fully_shard(block)
    fully_shard(backbone)


def is_fully_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` was sharded with FSDP2's ``fully_shard`` (by the trainer or by accelerate's plugin)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_backbones(
    transformer: torch.nn.Module,
    ref_transformer: torch.nn.Module | None,
    fully_shard_backbone: bool,
    plugin_fsdp2: bool,
    deepspeed_plugin: Any = None,
) -> torch.nn.Module | None:
    """Shard the trained backbone and the frozen KL reference as the run asks, and return the reference to call:
    both with :func:`fully_shard_blocks` under ``fully_shard_backbone``; under accelerate's FSDP2 plugin
    (``plugin_fsdp2``), which shards the trained backbone when it prepares it, only the reference, and under
    DeepSpeed ZeRO-3 (``deepspeed_plugin``) the reference becomes :func:`zero3_reference`'s engine."""
    if fully_shard_backbone:
        fully_shard_blocks(transformer)
    if ref_transformer is not None and (fully_shard_backbone or plugin_fsdp2):
        fully_shard_blocks(ref_transformer)
    if ref_transformer is not None and deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3:
        return zero3_reference(ref_transformer, deepspeed_plugin.deepspeed_config)
    return ref_transformer


def zero3_reference(model: torch.nn.Module, deepspeed_config: Mapping[str, Any]) -> torch.nn.Module:
    """``model`` (the frozen KL reference) as an inference-only DeepSpeed ZeRO-3 engine: each process keeps its
    partition of every weight, gathered block by block for a forward, as TRL's ``prepare_deepspeed`` prepares
    GRPOTrainer's ``ref_model``. A forward is then a collective: every process must make the same calls.

    The run's ``deepspeed_config`` without what only training uses (optimizer, scheduler, optimizer offload, which
    DeepSpeed would build with no optimizer to attach to), and TRL's bucket sizes from the backbone's width; TRL
    writes them as dotted top-level keys, which DeepSpeed does not read, so here they go inside ``zero_optimization``.
    Under ZeRO-2 the reference stays whole on every process (TRL: a stage-0 engine, the same thing)."""
    import deepspeed

    config = copy.deepcopy(dict(deepspeed_config))
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    zero = config["zero_optimization"]
    zero.pop("offload_optimizer", None)
    width = _backbone_width(model.config)
    if width is not None:
        # Weights under 10 widths (biases, norms) stay whole on every process, as TRL sets for a hidden size.
        zero.update(
            reduce_bucket_size=width * width,
            stage3_prefetch_bucket_size=int(0.9 * width * width),
            stage3_param_persistence_threshold=10 * width,
        )
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # DeepSpeedEngine.eval returns None
    return engine


def _backbone_width(config: Mapping[str, Any]) -> int | None:
    """A diffusers backbone's block width, the ``hidden_size`` TRL reads from a transformers config (``None`` when
    the config names neither heads x head width nor ``dim``: DeepSpeed's defaults are kept)."""
    if "num_attention_heads" in config and "attention_head_dim" in config:
        return config["num_attention_heads"] * config["attention_head_dim"]
    return config.get("dim")  # Z-Image


@contextlib.contextmanager
def gradient_sync_deferred(model: torch.nn.Module) -> Iterator[None]:
    """An FSDP2 module's gradients stay unreduced for the block: the accumulation micro-batches before the last."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
