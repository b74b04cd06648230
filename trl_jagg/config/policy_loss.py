"""The policy loss's field group of :class:`~trl_jagg.GRPOJaggConfig`: the PPO clip range (TRL's ``epsilon``; its
former name ``clip_range`` still accepted), the KL term, the ratio and gradient options, the inner epochs; their
allowed values and their check."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trl_jagg.config.objective_registry import get_objective
from trl_jagg.config.reporting import fail, warn_user
from trl_jagg.recipes import RECIPES

GAUSSIAN_SAMPLERS = ("sde", "dance")  # log-probs are true Gaussian log-densities (CPS drops the constants)
KL_STDS = ("step", "flow_grpo")
CFG_GRADIENTS = ("both", "conditional")
CLIP_RANGE_SLACK = 100.0
"""How far (a factor) a clip range may lie outside the recipes' (1e-5 .. 1e-3, Flow-GRPO's Wan2.1 the widest) before
the config warns about its scale: TRL's token default 0.2 warns."""


class FormerName:
    """A field's former name (``clip_range`` for ``epsilon``), kept as a dataclass field so that it is still an init
    keyword, a YAML key and a ``--flag``: a value given under it is moved to the field by :meth:`resolve` (called
    first by ``GRPOJaggConfig.__post_init__``) with a FutureWarning naming the field. Read, it is the field's value;
    once resolved it cannot be set to another one (a copy of the config that sets every field, as
    ``redacted_fields`` does, sets the same value)."""

    def __init__(self, field_name: str):
        self.field_name = field_name
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.field_name)

    def __set__(self, obj: Any, value: Any) -> None:
        if value is None:  # the dataclass default: nothing given under the former name
            return
        if not obj.__dict__.get(self._resolved_key):
            obj.__dict__[self._given_key] = value
        elif value != getattr(obj, self.field_name):
            raise AttributeError(
                f"GRPOJaggConfig.{self.name} is the former name of {self.field_name}, read-only. Set "
                f"{self.field_name} instead."
            )

    @property
    def _given_key(self) -> str:
        return f"_{self.name}_given"

    @property
    def _resolved_key(self) -> str:
        return f"_{self.name}_resolved"

    def resolve(self, obj: Any) -> None:
        """Move a value given under the former name to the field, warning; refuse two different values."""
        obj.__dict__[self._resolved_key] = True
        value = obj.__dict__.pop(self._given_key, None)
        if value is None:
            return
        warn_user(
            f"GRPOJaggConfig.{self.name} is deprecated: it is now called {self.field_name}, TRL's name. Use "
            f"{self.field_name}={value!r} (the YAML key and the --flag too).",
            FutureWarning,
        )
        default = next(item.default for item in dataclasses.fields(obj) if item.name == self.field_name)
        current = getattr(obj, self.field_name)
        if current != default and current != value:
            fail(self.name, f"is {value!r} and {self.field_name} is {current!r}", f"Give only {self.field_name}.")
        setattr(obj, self.field_name, value)


@dataclass
class PolicyLossArguments:
    """GRPO's PPO-clipped policy loss of every trained step, its KL term and the inner epochs. Its check reads
    ``sampler`` (sampling)."""

    epsilon: float = field(
        default=1e-4,
        metadata={
            "help": "PPO clip range, TRL's `epsilon`: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]. Tiny "
            "because log-probs are averaged over latent dims: 1e-4 for flow models' per-dimension log-probs, not "
            "TRL's 0.2 for tokens (1e-5 for CPS)."
        },
    )
    clip_range: float | None = field(
        default=None,
        metadata={
            "help": "Deprecated: the former name of `epsilon`, still accepted (with a FutureWarning) as a keyword, "
            "a YAML key and a flag; it sets `epsilon`. Read, it is `epsilon`."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clip range, as in TRL: the ratio is clipped to [1 - epsilon, 1 + epsilon_high] (DAPO's "
            "clip-higher). Defaults to the lower one."
        },
    )
    adv_clip_max: float = field(
        default=5.0, metadata={"help": "Advantages are clipped to [-adv_clip_max, adv_clip_max]."}
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient against the reference model (the base weights: adapter disabled for LoRA, a "
            "frozen copy for full fine-tuning). 0 skips the reference forward."
        },
    )
    kl_std: str = field(
        default="step",
        metadata={
            "help": f"Std the KL term divides by, one of {KL_STDS}: `step`, the step Gaussian's std (the exact KL of "
            "the step), or `flow_grpo`, Flow-GRPO's `std_dev_t` (for `sde` the diffusion coefficient g without "
            "sqrt(|dt|), which makes the KL the exact one times |dt|; for `cps` the step std). `beta` means "
            "different things under the two."
        },
    )
    ratio_normalization: bool = field(
        default=False,
        metadata={
            "help": "GRPO-Guard's RatioNorm (arXiv 2510.22319, Flow-GRPO's `rationorm`): the PPO ratio of a step is "
            "exp(s (log p - log p_old) + |mu - mu_old|^2 / (2 s)), s the step's std, which removes the ratio's "
            "negative drift and puts every step on one scale. Gaussian samplers only (`sde`, `dance`); the rollout "
            "keeps its velocities to recompute mu_old. Pair it with GRPO-Guard's clip range (4e-6, not 1e-4)."
        },
    )
    step_gradient_reweighting: bool = field(
        default=False,
        metadata={
            "help": "GRPO-Guard's per-step reweighting (Flow-GRPO's `rationorm` divides each step's policy loss by "
            "|dt|): the policy term of step k is weighted by 1 / |sigma_k - sigma_{k+1}|; the KL term is not."
        },
    )
    cfg_gradient: str = field(
        default="both",
        metadata={
            "help": f"Which classifier-free guidance branches the update differentiates, one of {CFG_GRADIENTS}: "
            "`both`, or `conditional` (the unconditional prediction runs without a graph and is a constant, so the "
            "backward covers half the samples)."
        },
    )
    quantize_timesteps: bool = field(
        default=False,
        metadata={
            "help": "Floor the backbone's timestep input to a whole scheduler timestep, int(sigma * 1000) / 1000 "
            "for Flux (DanceGRPO); the sampler keeps the exact sigma."
        },
    )
    same_group_noise: bool = field(
        default=False,
        metadata={
            "help": "Start every image of a prompt group from the same initial noise (Flow-GRPO `same_latent`, "
            "DanceGRPO `init_same_noise`), drawn from a per-group seed, so a group split across processes shares it."
        },
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Inner PPO epochs: optimisation passes over each rollout before sampling anew."}
    )

    def _check_policy_loss_fields(self) -> None:
        """The clip ranges, the advantage clip, the KL, the ratio options and the inner epochs."""
        if self.epsilon <= 0:
            fail("epsilon", f"is {self.epsilon}", "Use a positive value (1e-4 for SDE, 1e-5 for CPS).")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            fail("epsilon_high", f"is {self.epsilon_high}", "Use a positive value, or None for the lower clip range.")
        if self.adv_clip_max <= 0:
            fail("adv_clip_max", f"is {self.adv_clip_max}", "Use a positive value (5 in Flow-GRPO).")
        if self.beta < 0:
            fail("beta", f"is {self.beta}", "Use 0 (no KL) or a positive weight.")
        if self.num_iterations < 1:
            fail("num_iterations", f"is {self.num_iterations}", "Use 1 or more.")
        if self.kl_std not in KL_STDS:
            fail("kl_std", f"is {self.kl_std!r}", f"Use one of {KL_STDS}.")
        if self.ratio_normalization and self.sampler not in GAUSSIAN_SAMPLERS:
            fail(
                "ratio_normalization",
                f"is on with sampler={self.sampler!r}, whose log-prob has no Gaussian normalisation",
                f"Use a sampler in {GAUSSIAN_SAMPLERS}, or ratio_normalization=False.",
            )
        if self.cfg_gradient not in CFG_GRADIENTS:
            fail("cfg_gradient", f"is {self.cfg_gradient!r}", f"Use one of {CFG_GRADIENTS}.")

    def _warn_clip_range_scale(self) -> None:
        """Warn when the clip range is far from the flow-model recipes' (TRL's token default 0.2 is 2000x Flow-GRPO's
        1e-4): it then clips nearly nothing or nearly everything. Only for an objective whose clip acts on a ratio
        of sampler-step log-probabilities, against the recipes of such objectives."""
        if not get_objective(self.objective).clips_step_log_ratio:
            return
        clipped = [
            recipe
            for recipe in RECIPES.values()
            if "epsilon" in recipe.config
            and get_objective(recipe.config.get("objective", "grpo")).clips_step_log_ratio
        ]
        used = sorted({recipe.config["epsilon"] for recipe in clipped})
        if used[0] / CLIP_RANGE_SLACK <= self.epsilon <= used[-1] * CLIP_RANGE_SLACK:
            return
        recipes = ", ".join(f"{recipe.name} {recipe.config['epsilon']:g}" for recipe in clipped)
        warn_user(
            f"GRPOJaggConfig.epsilon is {self.epsilon:g}, more than {CLIP_RANGE_SLACK:g}x outside the clip ranges of "
            f"the flow-model recipes ({recipes}): a step's log-prob is a mean over latent dimensions, so its ratio "
            "moves far less than a token's, and a token-scale value such as TRL's 0.2 effectively never clips. Use "
            "1e-4 (SDE / Dance samplers) or 1e-5 (CPS)."
        )


PolicyLossArguments.clip_range = FormerName("epsilon")  # after the dataclass took `None` as the field's default
PolicyLossArguments.clip_range.__set_name__(PolicyLossArguments, "clip_range")
