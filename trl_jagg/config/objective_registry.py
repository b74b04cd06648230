"""The objective registry: one :class:`ObjectiveSpec` per training objective, as peft maps a config to its code.

A spec is data and the check of the objective's own fields (no diffusers, no trainer), so the config checks a run
against it before anything heavy loads; the update stage it names (``trl_jagg/objectives/``) is imported only when a
trainer is built (:meth:`ObjectiveSpec.update_stage_class`), so the config never imports the update code. Adding an
objective is its update module in ``trl_jagg/objectives/``, its field check in ``objective_checks.py``, its fields in
``objective.py`` and one :func:`register_objective` call here (CONTRIBUTING.md, "Adding an objective").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trl_jagg.config.objective_checks import check_awm_fields, check_dgpo_fields, check_nft_fields

ROLLOUT_SAMPLERS = ("sde", "ode")


@dataclass(frozen=True)
class ObjectiveSpec:
    """What the rest of the library needs to know about one objective.

    Attributes:
        name: the ``GRPOJaggConfig.objective`` value.
        title: its name in words (logs, the model card).
        rollout_sampler: ``"sde"``, a stochastic sampler whose rollout keeps every step's log-probability and the
            trajectory (the SDE window applies); ``"ode"``, a deterministic sampler whose rollout the update uses
            only through its clean samples (every step is ODE, ``ode_solver_order`` acts on all of them).
        keeps_old_policy: the update keeps a copy of the trained weights that follows them (DiffusionNFT's and
            DGPO's old policy, AWM's KL-EMA), checkpointed (``nft_old_policy.safetensors``, stamped with the
            objective).
        needs_reference: the loss reads the frozen base model whatever ``beta`` is (a frozen copy is kept for full
            fine-tuning).
        clips_step_log_ratio: ``clip_range`` clips a ratio of sampler-step log-probabilities (GRPO's scale, 1e-4).
        check_fields: the check of the objective's own fields (and of the settings it needs), given the config.
        fields: the config fields that only this objective reads (a non-default value with another objective is
            refused: ``trl_jagg/config/rules.py``).
        also_reads: shared fields that act with this objective beyond the conditions GRPO gives them.
        update: ``"module:Class"``, the update stage of one micro-batch.
        refused: settings this objective cannot serve, ``field -> fix``: a value other than the field's default is
            refused with the fix.
        card_summary: the model card's "Training" sentence, ``{jagg}`` standing for the JAGG clause.
        card_jagg: the JAGG clause when ``use_jagg`` is on.
        card_settings: the model card's objective rows, ``label -> template`` formatted with the config's fields.
        citation: BibTeX of the objective's paper.
        tags: Hub tags of a model trained with it.
    """

    name: str
    title: str
    rollout_sampler: str
    update: str
    keeps_old_policy: bool = False
    needs_reference: bool = False
    clips_step_log_ratio: bool = False
    check_fields: Callable[[Any], None] | None = None
    fields: tuple[str, ...] = ()
    also_reads: tuple[str, ...] = ()
    refused: Mapping[str, str] = field(default_factory=dict)
    card_summary: str = ""
    card_jagg: str = ""
    card_settings: Mapping[str, str] = field(default_factory=dict)
    citation: str = ""
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.rollout_sampler not in ROLLOUT_SAMPLERS:
            raise ValueError(f"ObjectiveSpec {self.name!r}: rollout_sampler must be one of {ROLLOUT_SAMPLERS}.")

    @property
    def deterministic_rollout(self) -> bool:
        """Every rollout step is ODE: no SDE window, no log-probabilities."""
        return self.rollout_sampler == "ode"

    def update_stage_class(self) -> type:
        """The update stage's class, imported now (it imports the trainer's pieces and torch)."""
        module, _, name = self.update.partition(":")
        return getattr(importlib.import_module(module), name)

    def card_training_summary(self, use_jagg: bool) -> str:
        """The model card's sentence on how the model was trained."""
        return self.card_summary.format(jagg=self.card_jagg if use_jagg else "")

    def card_rows(self, config: Any) -> dict[str, str]:
        """The model card's settings rows of this objective, from ``config``."""
        return {label: template.format(config=config) for label, template in self.card_settings.items()}


OBJECTIVES: dict[str, ObjectiveSpec] = {}
"""Every registered objective by its ``GRPOJaggConfig.objective`` name."""


def register_objective(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Add ``spec`` to :data:`OBJECTIVES` (a name registers once)."""
    if spec.name in OBJECTIVES:
        raise ValueError(f"objective {spec.name!r} is registered already.")
    OBJECTIVES[spec.name] = spec
    return spec


def get_objective(name: str) -> ObjectiveSpec:
    """The spec of objective ``name``; an unknown name is a ``ValueError`` listing the registered ones."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}: use one of {tuple(OBJECTIVES)}.") from None


register_objective(
    ObjectiveSpec(
        name="grpo",
        title="GRPO",
        rollout_sampler="sde",
        update="trl_jagg.objectives.grpo:GRPOUpdateStage",
        clips_step_log_ratio=True,
        card_summary="GRPO on the denoising trajectory of a flow-matching model{jagg}.",
        card_jagg=", with JAGG group gradients in the update stage",
        card_settings={"sampler / noise level": "{config.sampler} / {config.noise_level}"},
        citation="""@article{shao2024deepseekmath,
  title   = {DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models},
  author  = {Shao, Zhihong and Wang, Peiyi and Zhu, Qihao and Xu, Runxin and Song, Junxiao and Zhang, Mingchuan and
             Li, Y. K. and Wu, Y. and Guo, Daya},
  journal = {arXiv preprint arXiv:2402.03300},
  year    = {2024}
}""",
    )
)

FORWARD_PROCESS_REFUSED = {
    "sde_window_size": "its rollouts are deterministic ODE: set it to 0.",
    "drop_zero_advantages": "it trains a zero-advantage sample too: set it to False.",
    "ratio_normalization": "it has no sampler-step ratio: set it to False.",
    "sampler": "its rollouts are a deterministic ODE, with no SDE sampler: leave it at its default.",
    "noise_level": "its rollouts are a deterministic ODE, with no SDE noise: leave it at its default.",
    "train_timesteps": "it draws its own trained timesteps (its *_num_train_timesteps or train_timestep_fraction "
    "fields): leave it at its default.",
    "kl_std": "its KL is a distance between velocities, not between Gaussian sampler steps: leave it at its default.",
    "step_gradient_reweighting": "it has no sampler steps to reweight: leave it at its default.",
    "jagg_cache_velocities": "the velocity cache serves the intermediates of a GRPO trajectory, which a "
    "forward-process update does not train: leave it at its default.",
    "jagg_cache_mode": "the velocity cache serves GRPO trajectories only: leave it at its default.",
    "jagg_cache_tolerance": "the velocity cache serves GRPO trajectories only: leave it at its default.",
    "jagg_probe_steps": "jagg_frac='auto' (the probe) is GRPO's: leave it at its default.",
}
"""The GRPO settings a forward-process objective (DiffusionNFT, AWM, DGPO) never reads (its rollout is an ODE, its
update trains forward-noised clean samples): a value other than the default is refused, not ignored in silence.
``sde_window_size`` first: with a window, the message names it rather than the ``train_timesteps`` it needs."""

register_objective(
    ObjectiveSpec(
        name="nft",
        title="DiffusionNFT",
        rollout_sampler="ode",
        update="trl_jagg.objectives.nft:NFTUpdateStage",
        keeps_old_policy=True,
        check_fields=check_nft_fields,
        fields=("nft_beta", "nft_decay_type"),
        also_reads=("train_timestep_fraction",),
        refused={
            **FORWARD_PROCESS_REFUSED,
            "drop_zero_advantages": "NFT trains a zero-advantage sample too (optimality 1/2): set it to False.",
            "epsilon": "it has no ratio to clip (its loss is bounded by its optimality weights): leave it at its "
            "default.",
            "epsilon_high": "it has no ratio to clip: leave it at its default.",
        },
        card_summary="DiffusionNFT, the negative-aware flow-matching objective on forward-noised clean samples of "
        "deterministic rollouts{jagg}.",
        card_jagg=", with JAGG group gradients across each sample's timesteps",
        card_settings={
            "rollout / NFT beta / old-policy decay type": "ODE / {config.nft_beta} / {config.nft_decay_type}"
        },
        citation="""@article{zheng2025diffusionnft,
  title   = {DiffusionNFT: Online Diffusion Reinforcement with Forward Process},
  author  = {Zheng, Kaiwen and Chen, Huayu and Ye, Haotian and Wang, Haoxiang and Zhang, Qinsheng and Jiang, Kai and
             Su, Hang and Ermon, Stefano and Zhu, Jun and Liu, Ming-Yu},
  journal = {arXiv preprint arXiv:2509.16117},
  year    = {2025}
}""",
        tags=("diffusion-nft",),
    )
)

register_objective(
    ObjectiveSpec(
        name="awm",
        title="AWM",
        rollout_sampler="ode",
        update="trl_jagg.objectives.awm:AWMUpdateStage",
        keeps_old_policy=True,
        check_fields=check_awm_fields,
        fields=(
            "awm_weighting",
            "awm_ghuber_power",
            "awm_num_train_timesteps",
            "awm_timestep_fraction",
            "awm_timestep_strategy",
            "awm_advantage_max",
            "awm_ema_kl_beta",
            "awm_kl_ema_decay",
            "awm_kl_ema_ramp_rate",
        ),  # fmt: skip
        refused=FORWARD_PROCESS_REFUSED,
        card_summary="AWM (Advantage Weighted Matching): advantage-weighted flow matching on forward-noised clean "
        "samples of deterministic rollouts{jagg}.",
        card_jagg=", with JAGG group gradients across each sample's timesteps",
        card_settings={
            "rollout / weighting / trained timesteps": "ODE / {config.awm_weighting} / "
            "{config.awm_num_train_timesteps}",
            "KL-EMA beta / decay": "{config.awm_ema_kl_beta} / {config.awm_kl_ema_decay}",
        },
        citation="""@article{xue2025awm,
  title   = {Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models},
  author  = {Xue, Shuchen and others},
  journal = {arXiv preprint arXiv:2509.25050},
  year    = {2025}
}""",
        tags=("awm",),
    )
)

register_objective(
    ObjectiveSpec(
        name="dgpo",
        title="DGPO",
        rollout_sampler="ode",
        update="trl_jagg.objectives.dgpo:DGPOUpdateStage",
        keeps_old_policy=True,
        needs_reference=True,
        check_fields=check_dgpo_fields,
        fields=(
            "dgpo_beta",
            "dgpo_num_train_timesteps",
            "dgpo_trunc_steps",
            "dgpo_shared_noise",
            "dgpo_clip_dsm",
            "dgpo_clip_kl",
            "dgpo_old_policy_decay",
            "dgpo_old_policy_ramp_rate",
            "dgpo_sample_old_policy_after",
        ),  # fmt: skip
        refused=FORWARD_PROCESS_REFUSED,
        card_summary="DGPO (Direct Group Preference Optimization): the group-level DPO loss on forward-noised clean "
        "samples of deterministic rollouts{jagg}.",
        card_jagg=", with JAGG group gradients across each sample's timesteps",
        card_settings={
            "rollout / DPO beta / trained timesteps": "ODE / {config.dgpo_beta} / {config.dgpo_num_train_timesteps} "
            "of 0..{config.dgpo_trunc_steps}",
        },
        citation="""@article{luo2025dgpo,
  title   = {Reinforcing Diffusion Models by Direct Group Preference Optimization},
  author  = {Luo, Yihong and Hu, Tianyang and Tang, Jing},
  journal = {arXiv preprint arXiv:2510.08425},
  year    = {2025}
}""",
        tags=("dgpo",),
    )
)
