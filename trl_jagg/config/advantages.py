"""The advantages' field group of :class:`~trl_jagg.GRPOJaggConfig`: the rewards (weights, keyword arguments,
deadlines, retries, overlap with the rollout) and how they become advantages (scaling, stat tracking, several
rewards); their allowed values and their check."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trl_jagg.config.reporting import fail
from trl_jagg.core.grpo import MULTI_OBJECTIVE_AGGREGATIONS
from trl_jagg.utils.redaction import redacted

SCALE_REWARDS = ("group", "batch", "none")


def reward_kwargs_mapping(value: Any) -> dict | None:
    """``GRPOJaggConfig.reward_kwargs`` as a mapping: a flag's JSON text parsed (TrainingArguments' dict fields take
    the same form); the entries are checked against the rewards by ``load_reward_funcs``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(
                # The text is not shown: it may hold a key, and cannot be parsed to redact it.
                f"GRPOJaggConfig.reward_kwargs is not JSON ({error}). Give a JSON object, e.g. "
                """--reward_kwargs '{"vlm-judge": {"url": "http://localhost:8080/v1"}}'."""
            ) from None
    if value is not None and not isinstance(value, dict):
        raise TypeError(
            f"GRPOJaggConfig.reward_kwargs is {redacted(value)!r} ({type(value).__name__}); expected a mapping from "
            "reward names to their keyword arguments, or None."
        )
    return value


@dataclass
class AdvantageArguments:
    """The rewards and the advantages made of them."""

    scale_rewards: str = field(
        default="group",
        metadata={
            "help": f"Advantage scaling, one of {SCALE_REWARDS}: per-group std, the std of the whole gathered batch "
            "(a global std, Flow-GRPO's `global_std`), or none. The mean is always the group's (the prompt's). As in "
            "TRL, `True` means 'group' and `False` 'none'."
        },
    )
    advantage_std_ddof: int = field(
        default=1,
        metadata={
            "help": "Delta degrees of freedom of the advantage std: 1 is the unbiased std (torch, DanceGRPO), 0 the "
            "population std (numpy, Flow-GRPO). At G = 2 the two differ by a factor sqrt(2)."
        },
    )
    advantage_eps: float = field(
        default=1e-4,
        metadata={
            "help": "Added to the advantage std (Flow-GRPO 1e-4, DanceGRPO 1e-8); 0 is valid (a constant group's "
            "advantages are 0)."
        },
    )
    per_prompt_stat_tracking: bool = field(
        default=False,
        metadata={"help": "Normalise rewards with a per-prompt history across steps (Flow-GRPO's stat tracking)."},
    )
    stat_tracking_buffer_size: int | None = field(
        default=None, metadata={"help": "Rewards kept per prompt by the stat tracker (None: current batch only)."}
    )
    drop_zero_advantages: bool = field(
        default=False,
        metadata={
            "help": "Drop the samples whose advantage is exactly 0 (every sample of a zero-std group) from the update, "
            "as Flow-GRPO's SD3 script does: they cost no backward, and each step's loss averages over the others. "
            "Logged as `engine/zero_advantage/dropped_frac`."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Weight of each reward function in the total reward (defaults to 1 for each)."},
    )
    # `dict | str`, as TrainingArguments' dict fields: a flag gives the JSON text, parsed by __post_init__.
    reward_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of the reward factories, by reward name (as written in `reward_funcs`: a "
            'registry name or a URL), e.g. `{"vlm-judge": {"url": "http://localhost:8080/v1", "model": '
            '"UnifiedReward"}}`; a YAML mapping, or its JSON text on the command line. The trainer passes them to '
            "`load_reward_funcs`; a key that is not one of `reward_funcs` or a keyword the reward does not take is an "
            "error before anything loads. API keys stay in environment variables."
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": f"How several rewards make one advantage, one of {MULTI_OBJECTIVE_AGGREGATIONS} (TRL's names): "
            "'sum_then_normalize' sums the weighted rewards, then normalises the sum as `scale_rewards` says; "
            "'normalize_then_sum' (GDPO, Flow-Factory's 'gdpo') normalises each reward within its group first (its "
            "group std), sums them with `reward_weights`, then normalises the sum over the whole batch, so a reward "
            "with a large scale or spread cannot drown the others. With one reward the two differ only in the final "
            "std (group or batch). With 'normalize_then_sum' each reward's share is logged as "
            "`engine/advantages/<name>/abs_mean` (the mean |weight x group-normalised reward|). The presets follow "
            "their peer: flow-factory-flux2-dev (CLIP + PickScore, Flow-Factory's GDPO) sets 'normalize_then_sum', "
            "the others keep 'sum_then_normalize'."
        },
    )
    overlap_rewards: bool = field(
        default=True,
        metadata={
            "help": "Score each rollout chunk (`sample_batch_size` images) with the rewards that score every sample on "
            "its own (a remote server, a pointwise `vlm-judge`, any reward with `per_sample = True`) in background "
            "threads while the next chunk samples, instead of after the whole rollout. When every reward is such a "
            "reward, each micro-batch of the update waits for them only at its first loss: with per-group "
            "advantages (`scale_rewards` 'group' or 'none', no GDPO, no `per_prompt_stat_tracking` or "
            "`drop_zero_advantages`) only for the chunks holding its groups, so the first micro-batches train while "
            "the last chunk is scored; otherwise for all of them, after the KL reference (`beta > 0`) and the first "
            "step's forward. The scores, advantages and gradients are the same. Other rewards run after the rollout "
            "(and then the last chunk is awaited there). See docs/rewards.md."
        },
    )
    reward_retries: int = field(
        default=0,
        metadata={
            "help": "Extra attempts for a reward function that raises (a flaky remote server, a transient CUDA "
            "error); each retry is logged. When the last attempt fails too, a checkpoint is saved before the error "
            "stops the run. Output checks (a NaN, a wrong count) are not retried."
        },
    )
    reward_timeout: float | None = field(
        default=900.0,
        metadata={
            "help": "Seconds each reward function may take to score one batch (a rollout, a rollout chunk scored "
            "during the rollout, an evaluation), retries included. When it expires, the call is abandoned (an "
            "`async def` reward is cancelled; a synchronous one is left running in a daemon thread, its result "
            "dropped), every process saves a checkpoint of the steps trained so far, and the run stops with an "
            "error naming the reward and the step; a stop signal (SIGINT, SIGTERM) abandons a reward the same way. "
            "Default 900 s for every reward, local callables included (longer than the remote reward's own "
            "attempts, shorter than the process group's 30-minute timeout). None (YAML `null`) turns it off: a "
            "synchronous reward then runs in the trainer's thread. See docs/rewards.md."
        },
    )

    def _check_advantage_fields(self) -> None:
        """The advantage scaling and its std, the stat tracker, several rewards, the reward calls."""
        if self.scale_rewards not in SCALE_REWARDS:
            fail("scale_rewards", f"is {self.scale_rewards!r}", f"Use one of {SCALE_REWARDS}.")
        if self.per_prompt_stat_tracking and self.scale_rewards == "none":
            fail(
                "scale_rewards",
                "is 'none' with per_prompt_stat_tracking=True",
                "The stat tracker scales by a std: use 'group' or 'batch', or turn the tracker off.",
            )
        self._check_multi_objective_aggregation()
        if self.advantage_std_ddof not in (0, 1):
            fail("advantage_std_ddof", f"is {self.advantage_std_ddof!r}", "Use 0 (population std) or 1 (unbiased).")
        if not self.advantage_eps >= 0:
            fail("advantage_eps", f"is {self.advantage_eps}", "Use a value >= 0 (1e-4 or 1e-8 are typical).")
        if self.stat_tracking_buffer_size is not None and self.stat_tracking_buffer_size < 1:
            fail(
                "stat_tracking_buffer_size",
                f"is {self.stat_tracking_buffer_size}",
                "Use a positive value, or None for the default.",
            )
        if self.reward_retries < 0:
            fail("reward_retries", f"is {self.reward_retries}", "Use 0 (no retry) or more.")
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            fail("reward_timeout", f"is {self.reward_timeout}", "Use a number of seconds > 0, or None (see its help).")

    def _check_multi_objective_aggregation(self) -> None:
        if self.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
            fail(
                "multi_objective_aggregation",
                f"is {self.multi_objective_aggregation!r}",
                f"Use one of {MULTI_OBJECTIVE_AGGREGATIONS}.",
            )
        if self.multi_objective_aggregation == "normalize_then_sum" and (
            self.per_prompt_stat_tracking or self.scale_rewards == "none"
        ):
            conflict = "per_prompt_stat_tracking=True" if self.per_prompt_stat_tracking else "scale_rewards='none'"
            fail(
                "multi_objective_aggregation",
                f"is 'normalize_then_sum' with {conflict}",
                "normalize_then_sum normalises by group and batch stds of the current batch: turn the stat tracker "
                "off and keep scale_rewards 'group' or 'batch', or use 'sum_then_normalize'.",
            )
