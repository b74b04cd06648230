"""The training objectives' update code: what every objective's update stage shares
(:mod:`~trl_jagg.objectives.update`, :mod:`~trl_jagg.objectives.forward`) and one module per objective (``grpo.py``,
``nft.py``, ``awm.py``, ``dgpo.py``). The registry that maps ``GRPOJaggConfig.objective`` to its spec and its
update stage is data the config reads (:mod:`trl_jagg.config.objective_registry`), re-exported here.
"""

from __future__ import annotations

from trl_jagg.config.objective_registry import OBJECTIVES, ObjectiveSpec, get_objective, register_objective

__all__ = ["OBJECTIVES", "ObjectiveSpec", "get_objective", "register_objective"]
