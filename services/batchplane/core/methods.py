"""The built-in balancing methods: one list that the configuration, strategies and the planner
all read. Pure; no I/O."""

from __future__ import annotations

#: Methods that partition a step's samples over buckets by cost (`planner.balance.partition`).
PARTITION_METHODS: tuple[str, ...] = ("karmarkar_karp", "greedy", "round_robin")
#: Every built-in balancing method: the partitions and "token_budget" (variable-size
#: microbatches under a token or cost budget, `planner.token_budget`).
BALANCE_METHODS: tuple[str, ...] = (*PARTITION_METHODS, "token_budget")
