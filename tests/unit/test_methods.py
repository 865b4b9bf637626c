"""One list of balancing methods (`core.methods`): the configuration, strategies and the planner
read it, and each method in it works where it is offered."""

from __future__ import annotations

import numpy as np
import pytest

from batchplane.core import config
from batchplane.core.methods import BALANCE_METHODS, PARTITION_METHODS
from batchplane.planner import balance, dgraph


def test_every_part_reads_the_one_list() -> None:
    assert config.BALANCE_METHODS is BALANCE_METHODS
    assert dgraph.BUILTIN_METHODS is BALANCE_METHODS
    assert balance.METHODS is PARTITION_METHODS
    assert set(PARTITION_METHODS) < set(BALANCE_METHODS)


@pytest.mark.parametrize("method", PARTITION_METHODS)
def test_every_partition_method_partitions(method: str) -> None:
    costs = np.arange(1.0, 11.0)
    groups = balance.partition(costs, 3, method)
    assert sorted(np.concatenate(groups).tolist()) == list(range(10)) and len(groups) == 3


@pytest.mark.parametrize("method", BALANCE_METHODS)
def test_every_method_is_accepted_by_configuration_and_strategies(method: str) -> None:
    budget = {"max_tokens": 64} if method == "token_budget" else {}
    job = config.job_from_mapping({"job": "m", "sources": [{"name": "a", "path": "a"}], "balance": {"method": method, **budget}})
    assert job.balance.method == method
    dgraph.DGraph("text").balance(method, **budget)
