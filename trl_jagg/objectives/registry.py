"""The objective registry: one :class:`ObjectiveSpec` per training objective, as peft maps a config to its code.

A spec is data (no torch, no diffusers), so the config can check a run against it before anything heavy loads; the
update stage it names is imported only when a trainer is built (:meth:`ObjectiveSpec.update_stage_class`). Adding an
objective is its update module in ``trl_jagg/objectives/`` and one :func:`register_objective` call here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
        keeps_old_policy: the rollouts are sampled by an old policy that follows the trained weights, kept beside
            them and checkpointed (``nft_old_policy.safetensors``).
        update: ``"module:Class"``, the update stage of one micro-batch.
        fields: the config fields that only this objective reads (a non-default value with another objective has no
            effect).
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
    fields: tuple[str, ...] = ()
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

register_objective(
    ObjectiveSpec(
        name="nft",
        title="DiffusionNFT",
        rollout_sampler="ode",
        update="trl_jagg.objectives.nft:NFTUpdateStage",
        keeps_old_policy=True,
        fields=("nft_beta", "nft_decay_type"),
        refused={
            "sde_window_size": "NFT rollouts are deterministic ODE: set it to 0.",
            "drop_zero_advantages": "NFT trains a zero-advantage sample too (optimality 1/2): set it to False.",
            "ratio_normalization": "NFT has no PPO ratio: set it to False.",
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
