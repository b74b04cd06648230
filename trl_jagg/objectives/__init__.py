"""The training objectives: the registry that maps ``GRPOJaggConfig.objective`` to its spec and update stage
(:mod:`~trl_jagg.objectives.registry`), the update code they share (:mod:`~trl_jagg.objectives.update`), and one
module per objective (``grpo.py``, ``nft.py``).

Importing this package loads the registry only (no torch), so the config checks a run against it before anything
heavy loads.
"""

from __future__ import annotations

from trl_jagg.objectives.registry import OBJECTIVES, ObjectiveSpec, get_objective, register_objective

__all__ = ["OBJECTIVES", "ObjectiveSpec", "get_objective", "register_objective"]
