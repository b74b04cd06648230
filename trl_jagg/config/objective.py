"""The objective's field group of :class:`~trl_jagg.GRPOJaggConfig`: which loss trains the model (GRPO or
DiffusionNFT), DiffusionNFT's own fields and its check."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_jagg.config.reporting import fail
from trl_jagg.core.nft import OLD_POLICY_DECAY_TYPES

OBJECTIVES = ("grpo", "nft")


@dataclass
class ObjectiveArguments:
    """The training objective and DiffusionNFT's fields."""

    objective: str = field(
        default="grpo",
        metadata={
            "help": f"Training objective, one of {OBJECTIVES}: `grpo` (PPO-clipped policy gradient through the reverse "
            "SDE, Flow-GRPO / DanceGRPO) or `nft` (DiffusionNFT: deterministic ODE rollouts by a slowly following "
            "old policy, the negative-aware flow-matching loss on forward-noised clean samples, no log-probabilities; "
            "trains a random `train_timestep_fraction` of the rollout's timesteps, `beta` is its KL coefficient, "
            "`use_jagg` groups a sample's timesteps). See docs/models.md for how it follows NVlabs/DiffusionNFT."
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

    def _check_objective_fields(self) -> None:
        """The objective and DiffusionNFT's own fields; GRPO-only settings that NFT cannot honour are refused."""
        if self.objective not in OBJECTIVES:
            fail("objective", f"is {self.objective!r}", f"Use one of {OBJECTIVES}.")
        if self.objective != "nft":
            return
        if not self.nft_beta > 0:
            fail("nft_beta", f"is {self.nft_beta}", "Use a positive guidance strength (DiffusionNFT: 1, or 0.1).")
        if self.nft_decay_type not in OLD_POLICY_DECAY_TYPES:
            fail("nft_decay_type", f"is {self.nft_decay_type!r}", f"Use one of {sorted(OLD_POLICY_DECAY_TYPES)}.")
        grpo_only = {
            "sde_window_size": (self.sde_window_size != 0, "NFT rollouts are deterministic ODE: set it to 0."),
            "drop_zero_advantages": (
                self.drop_zero_advantages,
                "NFT trains a zero-advantage sample too (optimality 1/2): set it to False.",
            ),
            "ratio_normalization": (self.ratio_normalization, "NFT has no PPO ratio: set it to False."),
        }
        for name, (is_set, fix) in grpo_only.items():
            if is_set:
                fail(name, f"is {getattr(self, name)!r} with objective='nft'", fix)
