"""The reward-function contract, the name registry, and the checks applied to every reward's output.

A reward function is any callable ``(prompts, images, **kwargs) -> list[float | None]``, called with keywords as
TRL's ``GRPOTrainer`` calls its reward functions: ``prompts=``, ``images=`` and ``completions=`` (both the images),
``trainer_state=`` (the ``transformers.TrainerState``) and every extra dataset column; a reward uses the keywords it
knows and must accept the others (``**kwargs``). It returns one score per (prompt, image) pair, or ``None`` for a
pair it does not apply to. Rewards that ship with trl_jagg are built by small factories registered here under a
name, so a config can say ``reward_funcs=["pickscore", "hpsv2.1"]``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from PIL import Image

from trl_jagg.rewards.calling import (
    DEFAULT_REWARD_TIMEOUT,
    call_with_retries,
    coroutine_function,
    is_async_reward,
    reward_deadline,
)
from trl_jagg.rewards.video import frame_kwargs, is_video_batch, takes_videos, video_means
from trl_jagg.utils.redaction import redacted

RewardFunc = Callable[..., Sequence[float | None]]
"""``(*, prompts: list[str], images: list[PIL.Image.Image], completions, trainer_state, **columns) -> list[float |
None]``, called with keywords."""

RewardSpec = str | RewardFunc | Sequence[str | RewardFunc]
"""What :func:`load_reward_funcs` accepts: a registry name, a callable, or a list mixing both."""

REWARD_KEYWORDS = ("prompts", "images", "completions", "trainer_state")
"""The keywords every reward is called with, besides the dataset columns."""

_Factory = TypeVar("_Factory", bound=Callable[..., RewardFunc])

REWARD_REGISTRY: dict[str, Callable[..., RewardFunc]] = {}
"""Registry name -> factory building the reward. Filled by the ``@register_reward`` decorators."""

# Other spellings users are likely to type; they resolve to the canonical registry names.
_ALIASES = {
    "hpsv2": "hpsv2.1",
    "hps": "hpsv2.1",
    "clip_score": "clipscore",
    "image_reward": "imagereward",
    "vlm_judge": "vlm-judge",
}

_URL_PREFIXES = ("http://", "https://")
_KWARGS_EXAMPLE = '{"vlm-judge": {"url": "http://localhost:8080/v1", "model": "UnifiedReward"}}'


def register_reward(name: str) -> Callable[[_Factory], _Factory]:
    """Decorator registering a reward factory under ``name`` (lower case) for :func:`load_reward_funcs`."""

    def decorator(factory: _Factory) -> _Factory:
        key = name.lower()
        if key in REWARD_REGISTRY and REWARD_REGISTRY[key] is not factory:
            raise ValueError(f"A reward is already registered as {key!r}.")
        REWARD_REGISTRY[key] = factory
        return factory

    return decorator


def available_rewards() -> list[str]:
    """Sorted registry names accepted by :func:`load_reward_funcs` (a URL selects the remote reward)."""
    return sorted(REWARD_REGISTRY)


def reward_name(func: RewardFunc) -> str:
    """The metric name of a reward function: its ``__name__``, else its class name (e.g. for a partial)."""
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and name:
        return name
    inner = getattr(func, "func", None)  # functools.partial
    if inner is not None:
        return reward_name(inner)
    return type(func).__name__


def _accepted_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``factory`` accepts, so ``device=...`` can be passed to a list that mixes
    model rewards with weight-free ones (which take no device)."""
    parameters = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {key: value for key, value in kwargs.items() if key in parameters}


def _import_reward(path: str) -> RewardFunc:
    """The callable at dotted import path ``module.attribute`` (as ``trl grpo`` accepts), importable from the working
    directory."""
    module_name, _, attribute = path.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module next to the config, as with `python -m`
    try:
        func = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        close = difflib.get_close_matches(path.lower(), available_rewards(), n=1)
        hint = f" (or did you mean the built-in {close[0]!r}?)" if close else ""
        raise ValueError(
            f"Reward {path!r} is neither a registered name nor an importable `module.function` path: {error}{hint}. "
            f"Registered names: {', '.join(available_rewards())}."
        ) from None
    if not callable(func):
        raise ValueError(f"Reward {path!r} imports a {type(func).__name__}, not a callable.")
    return func


def _build_from_name(name: str, factory_kwargs: Mapping[str, Any], own_kwargs: Mapping[str, Any]) -> RewardFunc:
    """The reward ``name`` builds: its factory called with the ``factory_kwargs`` it accepts, then ``own_kwargs``
    (its ``reward_kwargs`` entry, already checked)."""
    if name.startswith(_URL_PREFIXES):
        remote = _remote_factory()
        _check_own_kwargs(remote, name, own_kwargs)
        return remote(name, **{**_accepted_kwargs(remote, factory_kwargs), **own_kwargs})
    key = _spec_key(name)
    if key not in REWARD_REGISTRY and "." in name.strip("."):
        if own_kwargs:
            raise ValueError(
                f"reward_kwargs[{name!r}]: {name!r} is an import path, used as is (not called as a factory), so it "
                "takes no reward_kwargs. Import and configure it yourself, then pass the callable."
            )
        return _import_reward(name.strip())
    if key not in REWARD_REGISTRY:
        valid = available_rewards()
        close = difflib.get_close_matches(key, valid + list(_ALIASES), n=1)
        hint = f" Did you mean {_ALIASES.get(close[0], close[0])!r}?" if close else ""
        raise ValueError(
            f"Unknown reward {name!r}.{hint} Valid names: {', '.join(valid)}; "
            "or an http(s):// URL of a reward server, a dotted import path (my_module.my_reward), or a callable."
        )
    factory = REWARD_REGISTRY[key]
    _check_own_kwargs(factory, name, own_kwargs)
    return factory(**{**_accepted_kwargs(factory, factory_kwargs), **own_kwargs})


def load_reward_funcs(
    spec: RewardSpec, reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None, **factory_kwargs: Any
) -> list[RewardFunc]:
    """Build reward functions from names, callables, or a list mixing both.

    Args:
        spec: A registry name (see :func:`available_rewards`), an ``http(s)://`` URL of a reward server
            (see :func:`trl_jagg.rewards.remote`), a dotted import path ``module.function`` of a reward function
            (used as is, not called as a factory), a callable, or a list of these.
        reward_kwargs: Keyword arguments of one reward's factory, by its name in ``spec`` (a registry name or
            alias, or the URL), e.g. ``{"vlm-judge": {"url": "http://localhost:8080/v1", "model": "UnifiedReward"}}``
            (``GRPOJaggConfig.reward_kwargs``); they apply to every entry of that name and override
            ``factory_kwargs``. A key that names no entry of ``spec``, or a keyword the factory does not take, is an
            error.
        **factory_kwargs: Passed to every factory that accepts them (e.g. ``device``, ``dtype``,
            ``batch_size``); factories that do not take an argument simply do not receive it.

    Returns:
        One callable per entry of ``spec``, in order. Model weights are not loaded yet: each model reward
        loads on its first call.

    Raises:
        ValueError: for an unknown name (listing the valid ones), an entry that is neither a string nor
            a callable, a callable without ``**kwargs`` (named), or a ``reward_kwargs`` entry that cannot apply.
    """
    items = [spec] if isinstance(spec, str) or callable(spec) else list(spec)
    if not items:
        raise ValueError("No reward function given: pass at least one name or callable.")
    own_kwargs = _keyed_reward_kwargs(reward_kwargs or {}, items)
    funcs: list[RewardFunc] = []
    for item in items:
        if isinstance(item, str):
            func = _build_from_name(item, factory_kwargs, own_kwargs.get(_spec_key(item), {}))
        elif callable(item):
            func = item
        else:
            raise ValueError(f"A reward must be a name or a callable, got {type(item).__name__}: {item!r}.")
        _check_signature(func)
        funcs.append(func)
    return funcs


def _spec_key(name: str) -> str:
    """How a ``spec`` entry and a ``reward_kwargs`` key are matched: a URL as written, a name by its registry name
    (case and aliases folded)."""
    name = name.strip()
    if name.startswith(_URL_PREFIXES):
        return name
    return _ALIASES.get(name.lower(), name.lower())


def _keyed_reward_kwargs(reward_kwargs: Any, items: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """``reward_kwargs`` by :func:`_spec_key`, once it is a mapping of mappings whose every key names a string entry
    of ``items`` (a key naming nothing would be dropped silently)."""
    if not isinstance(reward_kwargs, Mapping) or not all(isinstance(v, Mapping) for v in reward_kwargs.values()):
        raise ValueError(
            f"reward_kwargs is {redacted(reward_kwargs)!r}: give a mapping from reward names to their keyword arguments, e.g. "
            f"{_KWARGS_EXAMPLE}."
        )
    names = {_spec_key(item) for item in items if isinstance(item, str)}
    for key in reward_kwargs:
        if _spec_key(str(key)) not in names:
            given = [item if isinstance(item, str) else reward_name(item) for item in items]
            raise ValueError(
                f"reward_kwargs has the key {redacted(key)!r}, which is not one of reward_funcs {given}. Key each entry by a "
                f"registered name or URL of reward_funcs, e.g. {_KWARGS_EXAMPLE}; configure a callable yourself."
            )
    return {_spec_key(str(key)): dict(kwargs) for key, kwargs in reward_kwargs.items()}


def _check_own_kwargs(factory: Callable[..., Any], name: str, own_kwargs: Mapping[str, Any]) -> None:
    """Every ``reward_kwargs`` keyword of reward ``name`` is one its factory takes: a typo would otherwise be
    dropped, or fail only at the first call."""
    parameters = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(str(k) for k in own_kwargs if k not in parameters)
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(parameters), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"reward_kwargs[{name!r}] has {unknown}, which the {name!r} reward does not take.{hint} It takes: "
            f"{', '.join(parameters)}."
        )


def _remote_factory() -> Callable[..., RewardFunc]:
    from trl_jagg.rewards.remote import remote  # remote imports this module

    return remote


def _check_signature(func: RewardFunc) -> None:
    """A reward must take ``**kwargs``: it is called with every keyword of :data:`REWARD_KEYWORDS` and every dataset
    column, so without it the first call fails, after a whole rollout."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension callable without a signature: nothing to check
        return
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise ValueError(
            f"Reward {reward_name(func)!r} has no **kwargs (its parameters: {', '.join(p.name for p in parameters)}): "
            f"every reward is called with the keywords {', '.join(REWARD_KEYWORDS)} and every dataset column. Add "
            "**kwargs to its parameters."
        )


def check_rewards(name: str, values: Any, expected: int, first_sample: int = 0) -> torch.Tensor:
    """Validate one reward function's output and return it as a float32 tensor of shape ``(expected,)``, with NaN
    where the reward returned ``None`` (not applicable to that sample). ``first_sample``: the position of the first
    value in the rollout (a chunk's values are named by their rollout positions).

    A wrong count or a NaN/inf score stops training with an error that names the reward: a silently
    replaced value would bias the group advantages without anyone noticing.

    Raises:
        ValueError: if ``values`` is not a flat sequence of ``expected`` finite numbers or ``None``.
    """
    try:
        if isinstance(values, torch.Tensor):
            scores = values.detach().to(torch.float32)
            missing = torch.zeros(scores.shape, dtype=torch.bool)
        else:
            values = list(values)
            missing = torch.tensor([value is None for value in values], dtype=torch.bool)
            scores = torch.as_tensor([0.0 if value is None else value for value in values], dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"Reward {name!r} returned values that are not numbers: {error}") from error
    if scores.ndim != 1 or scores.numel() != expected:
        raise ValueError(
            f"Reward {name!r} returned {tuple(scores.shape)} values; expected a flat list of {expected} "
            "(one per prompt/image pair)."
        )
    bad = ~torch.isfinite(scores)
    if bad.any():
        positions = [first_sample + position for position in bad.nonzero().flatten().tolist()]
        raise ValueError(
            f"Reward {name!r} returned non-finite values at positions {positions[:10]}: {scores[bad][:10].tolist()}."
        )
    return scores.masked_fill(missing, float("nan"))


def compute_rewards(
    reward_funcs: Sequence[RewardFunc],
    prompts: Sequence[str],
    images: Sequence[Image.Image],
    reward_weights: Sequence[float] | None = None,
    trainer_state: Any = None,
    retries: int = 0,
    timeout: float | None = DEFAULT_REWARD_TIMEOUT,
    first_sample: int = 0,
    **columns: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run every reward, check its output, and return the weighted sum and the per-reward scores.

    Each reward is called with keywords, as in TRL: ``func(prompts=..., images=..., completions=...,
    trainer_state=..., **columns)``, ``completions`` being the images too. A ``None`` score means "not applicable":
    it is left out of the sample's weighted sum (TRL's ``nansum``). ``async def`` rewards (see
    :func:`is_async_reward`) run concurrently with each other on one event loop and with the synchronous rewards,
    which run one after the other; the results do not depend on which finishes first. Videos (a list of frames per
    sample, from video models) reach a reward declaring ``takes_videos`` whole; every other reward scores each frame
    and a sample gets its frames' mean (:mod:`~trl_jagg.rewards.video`).

    Args:
        reward_funcs: The reward callables (e.g. from :func:`load_reward_funcs`).
        prompts, images: One prompt per image.
        reward_weights: One weight per reward; ``None`` means all 1.0.
        trainer_state: The ``transformers.TrainerState`` of the run (``None`` outside training).
        retries: Extra calls of a reward that raises (each logged); its output checks are not retried.
        timeout: Seconds each reward may take to score the batch, retries included (``reward_timeout``, default
            :data:`~trl_jagg.rewards.calling.DEFAULT_REWARD_TIMEOUT`); ``None``: no deadline. See
            :mod:`~trl_jagg.rewards.calling`.
        first_sample: The rollout position of the first sample (a rollout chunk's), which errors count from.
        **columns: Extra dataset columns passed to every reward.

    Returns:
        ``(total, per_reward)``: ``total`` has shape ``(len(images),)``; ``per_reward`` maps each reward's
        metric name (made unique with a ``_2``, ``_3`` suffix if repeated) to its checked scores, NaN where the
        reward returned ``None``.

    Raises:
        ValueError: for a reward's bad output (named), mismatched weights, or a sample that no reward applies to
            (every reward returned ``None`` for it).
        RewardTimeout: for a reward still running at its deadline (named; not retried).
    """
    weights = [1.0] * len(reward_funcs) if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != len(reward_funcs):
        raise ValueError(f"Got {len(weights)} reward weights for {len(reward_funcs)} reward functions.")
    if len(prompts) != len(images):
        raise ValueError(f"Got {len(prompts)} prompts for {len(images)} images.")
    reserved = sorted(set(columns) & set(REWARD_KEYWORDS))
    if reserved:
        raise ValueError(
            f"Dataset column(s) {reserved} clash with the reward keywords {REWARD_KEYWORDS}: rename them "
            "(e.g. `dataset.rename_column('images', 'reference_images')`)."
        )
    names: list[str] = []
    for func in reward_funcs:
        name = unique = reward_name(func)
        suffix = 2
        while unique in names:
            unique, suffix = f"{name}_{suffix}", suffix + 1
        names.append(unique)
    deadlines = [reward_deadline(func, timeout) for func in reward_funcs]
    if is_video_batch(images):  # image rewards score every frame; a sample gets its frames' mean
        reward_funcs = [
            func if takes_videos(func) else _per_frame(func, name) for func, name in zip(reward_funcs, names)
        ]
    kwargs = dict(prompts=list(prompts), images=list(images), completions=list(images), trainer_state=trainer_state,
                  **columns)  # fmt: skip
    # Async rewards (a judge or server client) start first and run concurrently on one event loop, while the
    # synchronous ones run here one after the other; results are taken in the rewards' order either way.
    pending: dict[int, Future] = {}
    asynchronous = [i for i, func in enumerate(reward_funcs) if is_async_reward(func)]
    if asynchronous:  # a thread per async reward waits on its coroutine, so that its retries stay sequential
        pool = ThreadPoolExecutor(max_workers=len(asynchronous), thread_name_prefix="async-reward")
        for i in asynchronous:
            pending[i] = pool.submit(call_with_retries, reward_funcs[i], names[i], retries, deadlines[i], **kwargs)
        pool.shutdown(wait=False)
    outputs = {}
    try:
        for i, func in enumerate(reward_funcs):
            if i not in pending:
                outputs[i] = call_with_retries(func, names[i], retries, deadlines[i], **kwargs)
        for i, future in pending.items():
            outputs[i] = future.result()
    finally:
        for future in pending.values():
            future.cancel()
    total = torch.zeros(len(images), dtype=torch.float32)
    per_reward: dict[str, torch.Tensor] = {}
    for i, (name, weight) in enumerate(zip(names, weights)):
        scores = check_rewards(name, outputs[i], len(images), first_sample).cpu()
        per_reward[name] = scores
        total += weight * scores.nan_to_num(0.0)
    if per_reward:
        unscored = torch.stack(list(per_reward.values())).isnan().all(dim=0).nonzero().flatten().tolist()
        if unscored:
            first = unscored[0]
            raise ValueError(
                f"No reward applies to sample {first_sample + first} (prompt {prompts[first]!r}"
                f"{f' and {len(unscored) - 1} more' if len(unscored) > 1 else ''}): every reward function "
                f"({', '.join(per_reward)}) returned None for it. A reward returns None only for samples that another "
                "reward scores."
            )
    return total, per_reward


def _per_frame(func: RewardFunc, name: str) -> RewardFunc:
    """``func`` (an image reward) called on every frame of the videos it receives, returning each video's mean score
    (:mod:`~trl_jagg.rewards.video`); asynchronous when ``func`` is."""
    awaited = coroutine_function(func)
    if awaited is not None:

        async def call_async(**kwargs: Any) -> list[float | None]:
            expanded, counts = frame_kwargs(kwargs)
            return video_means(check_rewards(name, await awaited(**expanded), sum(counts)), counts)

        return call_async

    def call(**kwargs: Any) -> list[float | None]:
        expanded, counts = frame_kwargs(kwargs)
        return video_means(check_rewards(name, func(**expanded), sum(counts)), counts)

    return call


def scores_each_sample(func: RewardFunc) -> bool:
    """Whether ``func`` declares (``func.per_sample = True``) that a sample's score depends on that sample alone,
    so that it may score a batch in parts, e.g. each rollout chunk while the next one samples. The remote reward and
    the pointwise VLM judges declare it; a pairwise judge (a win rate within a prompt's images) does not."""
    return getattr(func, "per_sample", False) is True
