"""The objective's field group of :class:`~trl_jagg.GRPOJaggConfig`: which loss trains the model (GRPO,
DiffusionNFT, AWM or DGPO), each objective's own fields, and the check the objective registry gives each
(:mod:`trl_jagg.objectives.registry`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl_jagg.config.objective_registry import OBJECTIVES, get_objective
from trl_jagg.config.reporting import fail


@dataclass
class ObjectiveArguments:
    """The training objective and the fields of the objectives other than GRPO."""

    objective: str = field(
        default="grpo",
        metadata={
            "help": f"Training objective, one of {tuple(OBJECTIVES)}: `grpo` (PPO-clipped policy gradient through the "
            "reverse SDE, Flow-GRPO / DanceGRPO); `nft` (DiffusionNFT: deterministic ODE rollouts by a slowly "
            "following old policy, the negative-aware flow-matching loss on forward-noised clean samples, no "
            "log-probabilities; trains a random `train_timestep_fraction` of the rollout's timesteps, `beta` is its "
            "KL coefficient, `use_jagg` groups a sample's timesteps); `awm` (Advantage Weighted Matching: "
            "advantage-weighted flow matching on forward-noised clean samples, on-policy, the `awm_*` fields); "
            "`dgpo` (DGPO: the group-level DPO loss against the base model, the `dgpo_*` fields). See "
            "docs/objectives.md for which to pick, and docs/peers/ for how each follows its authors' code."
        },
    )
    nft_beta: float = field(
        default=1.0,
        metadata={
            "help": "`objective='nft'`: the guidance strength beta of the implicit positive / negative policies "
            "(`beta v + (1 - beta) v_old` and `(1 + beta) v_old - beta v`); DiffusionNFT uses 1 (0.1 for OCR and "
            "multi-reward runs)."
        },
    )
    nft_decay_type: int = field(
        default=1,
        metadata={
            "help": "`objective='nft'`: how the sampling (old) policy follows the trained one after each rollout, "
            "`old = decay * old + (1 - decay) * current`, DiffusionNFT's `decay_type`: 0 (decay 0: on-policy), 1 "
            "(0.001 per optimizer step up to 0.5), 2 (0 for 75 steps, then 0.0075 per step up to 0.999)."
        },
    )

    awm_weighting: str = field(
        default="ghuber",
        metadata={
            "help": "`objective='awm'`: the weighting of the matching log-probability `lp = -w(t, mse)`, one of "
            "`uniform`, `t`, `t2`, `huber`, `ghuber` (the authors': `ghuber`)."
        },
    )
    awm_ghuber_power: float = field(
        default=0.25, metadata={"help": "`objective='awm'`: the power `p` of the `ghuber` weighting (0.25)."}
    )
    awm_num_train_timesteps: int = field(
        default=6,
        metadata={"help": "`objective='awm'`: timesteps trained per micro-batch, one rollout index per stratum."},
    )
    awm_timestep_fraction: float = field(
        default=0.9,
        metadata={
            "help": "`objective='awm'`: the strata cover the rollout indices below "
            "`int(num_inference_steps * awm_timestep_fraction)`."
        },
    )
    awm_timestep_strategy: str = field(
        default="discrete",
        metadata={
            "help": "`objective='awm'`: `discrete` (strata from index 0), `discrete_wo_init` (from 1) or "
            "`discrete_with_init` (index 0 always, the rest stratified from 1)."
        },
    )
    awm_advantage_max: float | None = field(
        default=1.0,
        metadata={
            "help": "`objective='awm'`: the advantages, clipped to `adv_clip_max`, are rescaled to "
            "`±awm_advantage_max` (the authors' 1); None keeps them as clipped (Flow-Factory)."
        },
    )
    awm_ema_kl_beta: float = field(
        default=1.0,
        metadata={"help": "`objective='awm'`: the coefficient of `mean (v - v_ema)^2`, the KL to the KL-EMA copy."},
    )
    awm_kl_ema_decay: float = field(
        default=0.3,
        metadata={
            "help": "`objective='awm'`: the KL-EMA follows the trained weights after each rollout with decay "
            "`min(awm_kl_ema_decay, awm_kl_ema_ramp_rate * global_step)`."
        },
    )
    awm_kl_ema_ramp_rate: float = field(
        default=0.001, metadata={"help": "`objective='awm'`: the KL-EMA decay's rate per optimizer step."}
    )
    dgpo_beta: float = field(
        default=100.0,
        metadata={
            "help": "`objective='dgpo'`: the preference scale of the group logits (the authors' `beta_dpo`: 10 for "
            "PickScore, 100 for GenEval and OCR)."
        },
    )
    dgpo_num_train_timesteps: int = field(
        default=4,
        metadata={"help": "`objective='dgpo'`: distinct rollout indices trained per optimizer step."},
    )
    dgpo_trunc_steps: int = field(
        default=6,
        metadata={"help": "`objective='dgpo'`: the trained indices are drawn from `0..dgpo_trunc_steps`."},
    )
    dgpo_shared_noise: bool = field(
        default=True,
        metadata={"help": "`objective='dgpo'`: every image of a prompt group gets the same forward noise `eps`."},
    )
    dgpo_clip_dsm: bool = field(
        default=True,
        metadata={
            "help": "`objective='dgpo'`: detach an image's denoising error where `exp(old_dsm - dsm)` left "
            "`[1 - clip_range, 1 + clip_range]` on the side its advantage pushes (needs the old policy's velocity)."
        },
    )
    dgpo_clip_kl: bool = field(default=False, metadata={"help": "`objective='dgpo'`: the same clip on the KL term."})
    dgpo_old_policy_decay: float = field(
        default=0.3,
        metadata={
            "help": "`objective='dgpo'`: the old policy follows the trained weights with decay "
            "`min(dgpo_old_policy_decay, dgpo_old_policy_ramp_rate * global_step)`."
        },
    )
    dgpo_old_policy_ramp_rate: float = field(
        default=0.001, metadata={"help": "`objective='dgpo'`: the old-policy decay's rate per optimizer step."}
    )
    dgpo_sample_old_policy_after: int = field(
        default=200,
        metadata={
            "help": "`objective='dgpo'`: from this optimizer step on, the old policy samples the rollouts (before, "
            "the trained weights do)."
        },
    )

    def _check_objective_fields(self) -> None:
        """The objective is registered; its own fields pass its check; the settings it cannot serve are refused."""
        if self.objective not in OBJECTIVES:
            fail("objective", f"is {self.objective!r}", f"Use one of {tuple(OBJECTIVES)}.")
        spec = get_objective(self.objective)
        if spec.check_fields is not None:
            spec.check_fields(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, fix in spec.refused.items():
            if getattr(self, name) != defaults[name]:
                fail(name, f"is {getattr(self, name)!r} with objective={spec.name!r}", fix)
        if spec.deterministic_rollout and self.jagg_frac == "auto":
            fail(
                "jagg_frac",
                f"is 'auto' with objective={spec.name!r}",
                "The probe that sets it measures GRPO trajectory groups: give a fraction in [0, 1] (1.0 groups "
                "every timestep).",
            )
