"""The objective a run trains, from its settings (``--objective``): next-token loss
(:mod:`odb.training.step.objective`), a preference loss (:mod:`odb.training.step.preference`) or
a reward model's (:mod:`odb.training.step.reward`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from odb.training.step.objective import NEXT_TOKEN, Objective
from odb.training.step.preference import Preference
from odb.training.step.reward import Reward

if TYPE_CHECKING:
    from odb.training.config.settings import RunConfig
    from odb.training.step.engine import OdbEngine

__all__ = ["objective_of"]


def objective_of(config: RunConfig, reference_model: OdbEngine | None = None) -> Objective:
    """The run's objective (``reference_model``: the engine of reference ``model``, a host's
    separate reference model)."""
    settings = config.objective
    if not settings.is_preference:
        return NEXT_TOKEN
    if settings.scores:
        return Reward(center=settings.center_rewards_coefficient)
    return Preference(settings.objective, beta=settings.beta, gamma=settings.simpo_gamma,
                      reference=settings.reference_for(lora=config.model.lora is not None),
                      reference_model=reference_model)
