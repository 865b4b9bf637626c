"""The planner: one per job. Owns the mixture, the balancing and the ledger of what each step
consumed; never touches sample payloads.

Strategy files import their primitives from here: `from batchplane.planner import DGraph, models`.
"""

from batchplane.planner import models
from batchplane.planner.dgraph import DGraph, Strategy, StrategyError

__all__ = ["DGraph", "Strategy", "StrategyError", "models"]
