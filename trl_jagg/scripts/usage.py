"""What ``trl-jagg`` commands say about their arguments before anything heavy is imported: the usage error, the names
TRL's ``trl grpo`` and diffusers' training scripts use for the fields (with the hint or the reason), the ``--config``
YAML file, and the check of field names against a parser's options. Nothing here imports trl, transformers,
diffusers or peft, so a typo is reported in the time Python takes to start."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

TRL_NAMES: Mapping[str, str] = {
    "max_prompt_length": "max_sequence_length",
    "generation_kwargs": "guidance_scale, true_cfg_scale, negative_prompt, num_inference_steps",
    "temperature": "noise_level",
    "model_init_kwargs": "dtype, model_revision",
}
"""Fields of TRL's ``GRPOConfig`` / ``trl grpo`` that trl_jagg spells differently, with the name to use instead.
The names TRL and trl_jagg share (``epsilon``, ``epsilon_high``, ``beta``, ``num_generations``, ``scale_rewards``,
``generation_batch_size``, ``steps_per_generation``, ``log_completions``, ``reward_weights``, ...) are fields."""


OTHER_NAMES: Mapping[str, str] = {
    # diffusers' training scripts (train_dreambooth_lora_flux.py and its siblings)
    "mixed_precision": "use --bf16 true or --fp16 true (autocast over float32 trained weights); `dtype` sets the "
    "frozen modules' dtype",
    "checkpointing_steps": "use save_steps",
    "checkpoints_total_limit": "use save_total_limit",
    "rank": "use lora_r (with use_peft true)",
    "lora_rank": "use lora_r (with use_peft true)",
    "lora_layers": "use lora_target_modules",
    "resolution": "use height and width",
    "use_dora": "DoRA is not supported: trl-jagg train trains plain LoRA (lora_r, lora_alpha, lora_target_modules)",
    "train_batch_size": "use per_device_train_batch_size (images per process per micro-batch; with "
    "num_generations images per prompt)",
    "max_train_steps": "use max_steps",
    "pretrained_model_name_or_path": "use model_name_or_path",
    "revision": "use model_revision",
    "lr_scheduler": "use lr_scheduler_type",
    "lr_warmup_steps": "use warmup_steps",
    "adam_weight_decay": "use weight_decay",
    "use_8bit_adam": "use --optim adamw_bnb_8bit",
    "allow_tf32": "use tf32",
    "use_ema": "use ema_decay (a decay > 0 keeps an EMA of the trained weights)",
    "validation_prompt": "use eval_prompts (rendered every image_log_steps)",
    "instance_prompt": "use prompts (a list of training prompts) or dataset_name",
    # TRL's and peft's
    "dataset": "use dataset_name (a Hub dataset id or a local file of prompts)",
    "peft_config": "use use_peft true with lora_r, lora_alpha, lora_target_modules",
    "lora_rank_pattern": "not supported on the command line: build a peft LoraConfig in Python",
}
"""Names of diffusers' training-script flags and other TRL / peft spellings that are no field here, with what to use;
the "did you mean" hint of an unknown name (difflib's nearest name is often wrong for them: ``mixed_precision`` is
not ``model_revision``)."""


TRL_ALIASES: Mapping[str, str] = {"torch_dtype": "dtype", "dataset_split": "dataset_train_split"}
"""Other names of a field: transformers' former ``torch_dtype`` (in ``trl grpo`` configs) and trl_jagg's former
``dataset_split``; renamed to the field before parsing, in the YAML and on the command line."""


def _attention(value: Any) -> str | None:
    if value in (None, "sdpa"):
        return None
    return (
        f"is {value!r}, a transformers attention implementation; diffusers backbones run PyTorch's "
        "scaled_dot_product_attention ('sdpa', accepted) and choose other kernels with "
        "`transformer.set_attention_backend(...)`, not from this config. Remove the key or set it to sdpa."
    )


def _token_level(name: str, meaning: str) -> Callable[[Any], str]:
    return lambda value: (
        f"is {value!r}: {meaning} has no meaning for images, whose step log-prob is a mean over latent dimensions "
        f"and whose loss is the mean of the per-step PPO losses (Flow-GRPO's). Remove {name} from the config."
    )


def _refused(meaning: str, fix: str, *no_op: Any) -> Callable[[Any], str | None]:
    """A check refusing any value but ``None`` and the ``no_op`` ones (TRL's "off" value: what trl_jagg does
    anyway). A flag's text is read as YAML reads it (``false``, ``1.0``), so the flag and the YAML key agree."""

    def check(value: Any) -> str | None:
        if isinstance(value, str):
            import yaml

            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                pass
        if value is None or any(value == v and type(value) is not bool or value is v for v in no_op):
            return None
        return f"is {value!r}: {meaning}. {fix}"

    return check


_REMOVE = "Remove it from the config."
_TEXT_SAMPLING = (
    "a text-generation setting; images are sampled by the diffusers pipeline's scheduler, whose randomness is "
    "noise_level, whose steps are num_inference_steps and whose guidance is guidance_scale"
)
_VLLM = _refused(
    "vLLM generates text completions; trl_jagg samples images with the diffusers pipeline inside the training "
    "processes, with no generation server to configure",
    "Remove it from the config; a reward model served by vLLM is a reward: a VLM judge (docs/rewards.md) or the "
    "http(s):// URL of a reward server in reward_funcs.",
    False,
)
_TOKEN_LOSS = (
    "a token-level variant of the policy loss; an image's step log-prob is one Gaussian density over its latent, "
    "and the loss is the mean of the per-step PPO losses (Flow-GRPO's), clipped by epsilon / epsilon_high"
)
_ENTROPY = (
    "a bonus on the entropy of a token distribution; a flow model's step is a Gaussian whose spread is set by "
    "noise_level, not learnt, so its entropy is no training signal"
)
_REFERENCE = (
    "TR-DPO's reference-model syncing; the reference of the KL term (beta) is the frozen base model, and "
    "ema_decay keeps an EMA of the trained weights for sampling"
)

VLLM_KEYS = (
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
    "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
)  # fmt: skip
"""TRL's vLLM generation keys: refused but for ``use_vllm: false``."""
# TRL keys by reason, each with its "off" value (what trl_jagg does anyway; None: no off value but unset).
_TEXT_SAMPLING_KEYS = {
    "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0, "cache_implementation": None,
    "chat_template_kwargs": None, "pad_to_multiple_of": None, "mask_truncated_completions": False,
    "max_tool_calling_iterations": None, "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None, "use_transformers_paged": False, "ds3_gather_for_generation": True,
}  # fmt: skip
_TOKEN_LOSS_KEYS = {
    "delta": None, "sapo_temperature_neg": None, "sapo_temperature_pos": None, "vespo_k_pos": None,
    "vespo_lambda_pos": None, "vespo_k_neg": None, "vespo_lambda_neg": None, "off_policy_mask_threshold": None,
    "use_bias_correction_kl": False,
}  # fmt: skip
_ENTROPY_KEYS = {
    "entropy_coef": 0.0, "top_entropy_quantile": 1.0, "use_adaptive_entropy": False, "entropy_coef_min": None,
    "entropy_coef_max": None, "entropy_coef_delta": None, "entropy_target": None,
}  # fmt: skip
_REFERENCE_KEYS = {"sync_ref_model": False, "ref_model_mixup_alpha": None, "ref_model_sync_steps": None}

TRL_ONLY: Mapping[str, Callable[[Any], str | None]] = {
    "attn_implementation": _attention,
    "loss_type": _token_level("loss_type", "a token-level loss aggregation (grpo, dr_grpo, dapo, bnpo, ...)"),
    "importance_sampling_level": _token_level(
        "importance_sampling_level", "choosing token- or sequence-level importance ratios"
    ),
    "max_completion_length": _refused(
        "the token limit of a generated text; a generated image's size is height and width (num_frames for a "
        "video), and max_sequence_length is the prompt encoder's token limit, not a completion length",
        "Remove it; set height and width for the image size.",
    ),
    **dict.fromkeys(VLLM_KEYS, _VLLM),
    **{name: _refused(_TEXT_SAMPLING, _REMOVE, off) for name, off in _TEXT_SAMPLING_KEYS.items()},
    **{name: _refused(_TOKEN_LOSS, _REMOVE, off) for name, off in _TOKEN_LOSS_KEYS.items()},
    **{name: _refused(_ENTROPY, _REMOVE, off) for name, off in _ENTROPY_KEYS.items()},
    **{name: _refused(_REFERENCE, _REMOVE, off) for name, off in _REFERENCE_KEYS.items()},
    "trust_remote_code": _refused(
        "diffusers pipelines are built from the classes their model_index.json names; no remote code is run",
        _REMOVE,
        False,
    ),
    "router_aux_loss_coef": _refused("the load-balancing loss of a mixture-of-experts language model", _REMOVE),
    "cast_lm_head_to_fp32": _refused("a language model's output head; a flow backbone has none", _REMOVE, False),
    "disable_dropout": _refused(
        "the backbone's dropout; diffusers flow backbones train without dropout, and lora_dropout sets the adapter's",
        _REMOVE,
        False,
    ),
    "num_generations_eval": _refused(
        "evaluation renders each held-out prompt once, with deterministic ODE sampling and a fixed seed",
        "Remove it; eval_num_inference_steps sets the evaluation's steps.",
    ),
    "log_multimodal": _refused(
        "log_completions logs the rollout's images", "Remove it; log_completions false logs none.", True
    ),
    "log_unique_prompts": _refused("log_completions logs one row per prompt group, each prompt once", _REMOVE, False),
    "log_completions_hub_repo": _refused(
        "the rollout's images go to output_dir/completions/ and to the trackers, not to a Hub dataset", _REMOVE
    ),
}
"""Keys of ``trl grpo`` configs (fields of TRL's ``GRPOConfig``) that are no field here: each maps a value to why
it is refused, or to ``None`` when the value is what trl_jagg does anyway (then the key is dropped): TRL's "off"
values, and ``None``. ``tests/test_cli_messages.py`` walks ``GRPOConfig``: every field is a field here, a name of
``TRL_NAMES`` / ``TRL_ALIASES``, or a key of this table."""

TRL_VALUES: Mapping[str, Callable[[Any], str | None]] = {
    "dtype": lambda value: (
        "is 'auto', which transformers resolves from the checkpoint; diffusers pipelines have no 'auto' dtype. "
        "Name it: bfloat16 (as the recipes), float16 or float32."
        if value == "auto"
        else None
    ),
}
"""Values ``trl grpo`` accepts that a field here refuses, with the reason (checked before parsing)."""


class UsageError(ValueError):
    """A problem with the command line or the YAML config: reported as ``trl-jagg <command>: error: ...``."""


def suggest(name: str, valid: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest valid name (difflib), TRL's or a diffusers script's equivalent, or an
    empty string."""
    name = name.replace("-", "_")
    if name in TRL_NAMES:
        return f" TRL's GRPOConfig calls it '{name}'; here use {TRL_NAMES[name]}."
    if name in OTHER_NAMES:
        return f" '{name}' is a diffusers-script / TRL name: {OTHER_NAMES[name]}."
    close = difflib.get_close_matches(name, sorted(set(valid)), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` on the command line (last one wins), ``None`` when absent."""
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (YAML and accelerate messages span several)."""
    return " ".join(str(error).split())


def read_yaml(path: str) -> dict[str, Any]:
    """The mapping of a ``--config`` file (empty for an empty file)."""
    import yaml

    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: no such file.")
    with open(path) as handle:
        try:
            config = yaml.safe_load(handle)
        except yaml.YAMLError as error:
            raise UsageError(f"--config {path} is not valid YAML: {one_line(error)}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UsageError(f"--config {path} must contain a YAML mapping of field names to values.")
    return config


def check_trl_value(name: str, value: Any, where: str) -> None:
    """A TRL-only key or a TRL value a field here refuses is a usage error with the reason."""
    check = TRL_ONLY.get(name) or TRL_VALUES.get(TRL_ALIASES.get(name, name))
    reason = check(value) if check is not None else None
    if reason is not None:
        raise UsageError(f"{name}{where} {reason}")


def check_names(options: Mapping[str, str], argv: Sequence[str], config: Mapping[str, Any], path: str | None) -> None:
    """Unknown field names in the YAML config or on the command line are errors that suggest the nearest one.

    ``options`` maps every accepted ``--flag`` spelling to its field name (``CommandParser.option_names()``).
    Checked before anything is parsed, so a typo is reported as such rather than as the missing or invalid value it
    causes.
    """
    valid = {dest for option, dest in options.items() if option != "--config" and dest != "help"}
    for key, value in config.items():
        check_trl_value(str(key), value, f" in {path}")
        if key != "env" and TRL_ALIASES.get(key, key) not in valid and key not in TRL_ONLY:
            raise UsageError(f"unknown field '{key}' in {path}.{suggest(str(key), valid)}")
    for i, token in enumerate(argv):
        flag = token.split("=", 1)[0]
        if not token.startswith("--") or flag == "--":
            continue
        name = flag[2:]
        value = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else None)
        check_trl_value(name, value, f" ({flag})")
        if f"--{TRL_ALIASES.get(name, name)}" not in options and name not in TRL_ONLY:
            raise UsageError(f"unknown field '{name}' ({flag}).{suggest(name, valid)}")


def read_config(argv: Sequence[str]) -> tuple[list[str], dict[str, Any], str | None]:
    """``(argv, yaml, path)``: ``argv`` with ``--config=x`` split in two tokens, the ``--config`` file's mapping
    (empty without one) and its path."""
    argv = list(argv)
    # TrlParser reads only the two-token form of --config.
    for i, token in enumerate(argv):
        if token.startswith("--config="):
            argv[i : i + 1] = ["--config", token.split("=", 1)[1]]
            break
    path = flag_value(argv, "--config")
    if "--config" in argv and path is None:
        raise UsageError("--config needs the path of a YAML file.")
    return argv, read_yaml(path) if path else {}, path
