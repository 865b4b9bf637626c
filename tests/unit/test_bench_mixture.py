"""Tests of `batchplane bench mixture` on short runs: record fields, the allocator's drift bounds,
exact share changes, the figures' own bounds, the schedules, and that the figures catch a late
change or a drift."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from batchplane import cli
from batchplane.bench import BENCHMARKS, load
from batchplane.bench import mixture as bench
from batchplane.planner.mixture import drift_bound

FIELDS = {
    "kind",
    "granularity",
    "steps",
    "batch",
    "sources",
    "max_drift_samples",
    "max_drift_over_batch",
    "max_window_share_error",
    "final_share_error",
    "realized_shares",
    "target_shares",
    "share_changes",
    "changes_exact",
    "seconds",
}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_every_kind_and_granularity_stays_within_the_bounds_and_changes_exactly() -> None:
    steps, batch, sources, window = 300, 64, 4, 20
    messages: list[str] = []
    argv = ["--steps", str(steps), "--batch", str(batch), "--sources", str(sources), "--window", str(window)]
    out = bench.run(_args(argv), messages.append)
    json.dumps(out)
    assert out["benchmark"] == "mixture" and out["drift_bound"] == drift_bound(sources) and len(messages) == 10
    assert list(out["schedules"]) == ["static", "staged", "curriculum", "callable", "adaptive"]
    records = out["records"]
    assert [(r["kind"], r["granularity"]) for r in records] == [
        (k, g) for k in ("static", "staged", "curriculum", "callable", "adaptive") for g in ("step", "microbatch")
    ]
    bound = drift_bound(sources)
    changes = {"static": 0, "staged": 2, "curriculum": steps - 1, "callable": steps - 1}
    for r in records:
        assert set(r) == FIELDS | ({"final_weights"} if r["kind"] == "adaptive" else set())
        assert (r["steps"], r["batch"], r["sources"]) == (steps, batch, sources)
        assert r["changes_exact"] is True, r
        if r["kind"] == "adaptive":
            assert 0 < r["share_changes"] < steps and r["final_weights"] != [0.25] * 4, "the weights adapted"
        else:
            assert r["share_changes"] == changes[r["kind"]], r
        # Tijdeman's bound for a static schedule; (K - 1) * B for any while the sources hold.
        assert r["max_drift_samples"] <= (bound if r["kind"] == "static" else (sources - 1) * bound) + 1e-9, r
        assert r["max_drift_over_batch"] == pytest.approx(r["max_drift_samples"] / batch)
        assert r["max_window_share_error"] <= 2 * r["max_drift_samples"] / (window * batch) + 1e-12
        assert r["final_share_error"] <= r["max_drift_samples"] / (steps * batch) + 1e-12
        assert sum(r["realized_shares"]) == pytest.approx(1.0) and sum(r["target_shares"]) == pytest.approx(1.0)
        assert max(abs(a - b) for a, b in zip(r["realized_shares"], r["target_shares"])) == pytest.approx(r["final_share_error"])
    static = records[0]
    assert static["target_shares"] == pytest.approx([0.4, 0.3, 0.2, 0.1])


def test_the_schedules_follow_the_documented_shapes() -> None:
    staged = bench.default_schedule("staged", sources=3, steps=300)
    assert [start for start, _ in staged.stages] == [0, 100, 200]
    assert staged.weights_at(99) == (3.0, 2.0, 1.0) and staged.weights_at(100) == (1.0, 2.0, 3.0)
    assert staged.weights_at(200) == (1.0, 0.5, 0.25)
    curriculum = bench.default_schedule("curriculum", sources=3, steps=300)
    assert curriculum.weights_at(0) == (7.0, 1.0, 1.0) and curriculum.weights_at(150) == (4.0, 1.0, 4.0)
    assert curriculum.weights_at(300) == (1.0, 1.0, 7.0)
    cosine = bench.default_schedule("callable", sources=3, steps=300)
    weights = np.array([cosine.weights_at(t / 7) for t in range(7 * 300)])
    assert weights.min() >= 0.1 - 1e-12 and weights.max() <= 1.9 + 1e-12
    assert cosine.weights_at(0) == pytest.approx(cosine.weights_at(150))  # period N / 2
    # Stage starts that coincide keep the first.
    assert [start for start, _ in bench.default_schedule("staged", sources=2, steps=2).stages] == [0, 1]


def test_the_figures_catch_a_change_one_step_late_and_a_drift() -> None:
    schedule = bench.default_schedule("staged", sources=2, steps=30)
    mixture = bench.Mixture(schedule, global_batch_size=16, stream_ends=[None, None])
    counts, shares, _ = bench.allocate(mixture, steps=30)
    expected = bench.expected_shares(schedule, steps=30, batch=16, microbatches=1)
    assert bench.fidelity(counts, shares, expected, window=5)["changes_exact"] is True
    late = expected.copy()
    late[10] = late[9]  # the second stage starting at step 11 instead of 10
    assert bench.fidelity(counts, shares, late, window=5)["changes_exact"] is False
    drifted = counts.copy()
    drifted[12] += [3, -3]
    figures = bench.fidelity(drifted, shares, expected, window=5)
    assert figures["max_drift_samples"] >= 3 - drift_bound(2)
    assert figures["max_window_share_error"] >= (3 - 2 * drift_bound(2)) / (5 * 16)


def test_the_cli_prints_one_json_object(capsys) -> None:
    assert BENCHMARKS["mixture"] == "batchplane.bench.mixture" and load("mixture") is bench
    code = cli.main(["bench", "mixture", "--json", "--steps", "12", "--batch", "8", "--kind", "curriculum", "--granularity", "microbatch"])
    captured = capsys.readouterr()
    assert code == 0
    out = json.loads(captured.out)
    assert [(r["kind"], r["granularity"], r["steps"]) for r in out["records"]] == [("curriculum", "microbatch", 12)]
    assert "[mixture] mixture: curriculum per microbatch done (1/1)" in captured.err


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--batch", "-1"], ["--kind", "nope"], ["--granularity", "epoch"]])
def test_bad_flags_are_rejected(argv) -> None:
    with pytest.raises(SystemExit):
        _args(argv)
