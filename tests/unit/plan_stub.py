"""A stand-in for a step's plan, for tests of the plan sequence (`planner.planning`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchplane.planner.plan import StepPlan


@dataclasses.dataclass(frozen=True)
class Plan(StepPlan):
    """Stands for the StepPlan of `step` (a StepPlan: `Planning.following` hands along only those)."""

    samples: Any = None
    microbatches: tuple = ()
    bad_samples: int = 0
    costs: Any = None
