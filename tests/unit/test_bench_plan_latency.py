"""Tests of `batchplane bench plan-latency` on tiny meshes: record fields, the configurations
swept, the split of a step's time into cost and balance, group sizes and the summary."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from batchplane.bench import plan_latency as bench

FIELDS = {
    "ranks",
    "tp",
    "pp",
    "dp",
    "cp",
    "samples_per_step",
    "context",
    "group_size",
    "cost_s",
    "balance_s",
    "total_s",
}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_sweep_records_every_configuration_with_cost_plus_balance_equal_to_total() -> None:
    messages: list[str] = []
    argv = ["--dp", "4", "--dp", "3", "--tp", "2", "--pp", "2", "--samples-per-rank", "72", "--samples-per-rank", "720"]
    argv += ["--context", "4096", "--steps", "3"]
    out = bench.run(_args(argv), messages.append)
    json.dumps(out, allow_nan=False)
    assert out["benchmark"] == "plan-latency" and out["steps"] == 3 and len(messages) == 4
    records = out["records"]
    # dp 3 is prime: no group size; dp 4 groups by 2.
    assert [(r["dp"], r["samples_per_step"], r["group_size"]) for r in records] == [
        (3, 216, None),
        (3, 2160, None),
        (4, 288, None),
        (4, 288, 2),
        (4, 2880, None),
        (4, 2880, 2),
    ]
    for r in records:
        assert set(r) == FIELDS
        assert (r["ranks"], r["tp"], r["pp"], r["cp"], r["context"]) == (r["dp"] * 4, 2, 2, 1, 4096)
        assert r["cost_s"] > 0.0 and r["balance_s"] > 0.0  # the cost models ran inside the plan
        assert r["cost_s"] + r["balance_s"] == pytest.approx(r["total_s"])
    growth = out["summary"]["growth_72_to_720"]
    assert [(g["ranks"], g["group_size"]) for g in growth] == [(12, None), (16, None), (16, 2)]
    for g in growth:
        assert g["ratio"] == pytest.approx(g["total_s_720"] / g["total_s_72"])
    assert out["summary"]["paper_table_2"] == [] and "ranks_1152_8k_72" not in out["summary"]


def test_summary_compares_the_1152_rank_8k_step_with_the_paper() -> None:
    argv = ["--dp", "36", "--samples-per-rank", "72", "--context", "8192", "--steps", "1", "--group-size", "12"]
    out = bench.run(_args(argv), lambda m: None)
    assert [(r["ranks"], r["group_size"]) for r in out["records"]] == [(1152, None), (1152, 12)]
    for key, record in zip(("ranks_1152_8k_72", "ranks_1152_8k_72_grouped"), out["records"]):
        figure = out["summary"][key]
        assert figure["group_size"] == record["group_size"] and figure["total_s"] == record["total_s"]
        assert figure["paper_over_ours"] == pytest.approx(0.464 / record["total_s"])
        assert figure["target_over_ours"] == pytest.approx(0.0464 / record["total_s"])
        assert figure["meets_target"] == (record["total_s"] <= 0.0464)


@pytest.mark.parametrize(
    ("dp", "chosen", "expected"),
    [
        (9, None, [3]),
        (36, None, [6]),
        (12, None, [3]),
        (16, None, [4]),
        (4, None, [2]),
        (7, None, []),
        (1, None, []),
        (36, [4, 5, 36, 6, 6], [4, 6]),
        (9, [9], []),
    ],
)
def test_group_sizes(dp, chosen, expected) -> None:
    assert bench.group_sizes(dp, chosen) == expected


def test_timed_cost_returns_the_model_and_counts_its_time() -> None:
    timed = bench._TimedCost(lambda lengths, features=None: np.asarray(lengths, np.float64) * 2)
    np.testing.assert_array_equal(timed(np.array([1, 2]), None), [2.0, 4.0])
    first = timed.seconds
    timed(np.array([3]))
    assert 0.0 < first < timed.seconds


@pytest.mark.parametrize("argv", [["--dp", "0"], ["--samples-per-rank", "0"], ["--group-size", "-2"], ["--steps", "0"]])
def test_bad_flags_are_rejected(argv) -> None:
    with pytest.raises(SystemExit):
        _args(argv)
