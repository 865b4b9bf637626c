"""Tests of `batchplane bench token-budget` on small configurations: record fields, alignment
and coverage of every batching, the planner against the offline greedy, the fixed-batch
baseline, the generated distributions, flags and the summary."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from batchplane.bench import token_budget as bench
from batchplane.core.config import LoaderSettings
from batchplane.planner.window import default_window_steps

FIELDS = {
    "distribution",
    "lmax",
    "world",
    "batching",
    "window_steps",
    "steps_per_rank",
    "aligned",
    "padding_rate",
    "samples_per_step",
    "coverage_ok",
    "max_padded_tokens",
}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_run_on_a_lengths_file(tmp_path) -> None:
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(16, 200, 90), rng.integers(1500, 3000, 10)])  # some > Lmax
    path = tmp_path / "mix.npy"
    np.save(path, rng.permutation(lengths))
    messages: list[str] = []
    argv = ["--lengths", str(path), "--lmax", "2048", "--world", "2", "--global-batch", "32"]
    argv += ["--window-steps", "1", "--window-steps", "4"]
    out = bench.run(_args(argv), messages.append)
    json.dumps(out)  # JSON-serializable
    assert out["benchmark"] == "token-budget" and out["global_batch"] == 32 and out["window_steps"] == [1, 4]
    assert len(messages) == 1
    records = out["records"]
    assert [(r["batching"], r["window_steps"]) for r in records] == [
        ("planner", 1),
        ("planner", 4),
        ("offline_greedy", None),
        ("fixed_batch", None),
    ]
    for r in records:
        assert set(r) == FIELDS
        assert (r["distribution"], r["lmax"], r["world"]) == ("mix", 2048, 2)
        assert len(r["steps_per_rank"]) == 2 and all(isinstance(s, int) for s in r["steps_per_rank"])
        assert r["coverage_ok"] is True and r["aligned"] is True
        assert 0.0 <= r["padding_rate"] < 1.0
        assert r["max_padded_tokens"] <= max(2048, int(lengths.max()))
    p1, p4, og, fb = records
    assert p1["samples_per_step"] == pytest.approx(100 / (2 * p1["steps_per_rank"][0]))
    # Lengths up to ~3000 > Lmax: the fixed batch is a single sample, 50 steps per rank.
    assert fb["steps_per_rank"] == [50, 50] and fb["padding_rate"] == 0.0
    # Offline greedy by hand: the 10 long samples alone, then the 90 short ones, sorted
    # descending, in next-fit groups of floor(2048 / first) samples; dealt to 2 ranks.
    short = np.sort(lengths[lengths < 1500])[::-1]
    groups, i = 10, 0
    while i < len(short):
        i += 2048 // int(short[i])
        groups += 1
    assert og["steps_per_rank"] == [-(-groups // 2)] * 2
    # A wider window plans like the offline greedy more closely, and far better than fixed.
    assert p4["padding_rate"] <= p1["padding_rate"] and max(p4["steps_per_rank"]) <= max(p1["steps_per_rank"])
    assert p4["steps_per_rank"][0] < 50 and p4["padding_rate"] < 0.2
    summary = out["summary"]["mix"]
    assert summary["stats"]["max"] == int(lengths.max()) and summary["stats"]["samples"] == 100
    assert summary["padding_rate_offline_greedy"] == og["padding_rate"]
    s1, s4 = summary["planner"]
    assert s4["window_steps"] == 4 and s4["padding_rate"] == p4["padding_rate"]
    assert s4["padding_pp_vs_offline_greedy"] == pytest.approx(100 * (p4["padding_rate"] - og["padding_rate"]))
    assert s4["steps_ratio_vs_offline_greedy"] == pytest.approx(p4["steps_per_rank"][0] / og["steps_per_rank"][0])
    assert s1["steps_ratio_fixed_batch"] == pytest.approx(50 / p1["steps_per_rank"][0])


def test_default_window_is_the_planners_and_stays_near_the_offline_greedy() -> None:
    argv = ["--distribution", "sharegpt4o-like", "--samples", "4096", "--lmax", "12288", "--world", "8"]
    out = bench.run(_args(argv), lambda message: None)
    k = default_window_steps(bench.GLOBAL_BATCH, read_ahead_samples=LoaderSettings().read_ahead_samples)
    assert out["window_steps"] == [k] == [out["default_window_steps"]]
    by = {r["batching"]: r for r in out["records"]}
    planner, greedy, fixed = by["planner"], by["offline_greedy"], by["fixed_batch"]
    assert planner["window_steps"] == k
    for r in out["records"]:
        assert r["coverage_ok"] is True and r["aligned"] is True
    assert planner["padding_rate"] <= greedy["padding_rate"] + bench.MARGIN_PP / 100
    assert max(planner["steps_per_rank"]) <= 1.02 * max(greedy["steps_per_rank"])
    assert out["summary"]["sharegpt4o-like"]["planner"][0]["within_margin"] is True
    # The long tail (12,110 tokens) forces bs = 1: no padding, many more steps.
    assert fixed["steps_per_rank"] == [512] * 8 and fixed["padding_rate"] == 0.0


def test_synthetic_sweep_is_aligned_covers_every_sample_and_fits_the_budget() -> None:
    argv = ["--distribution", "longtail", "--distribution", "all-short", "--lmax", "2048"]
    argv += ["--world", "3", "--world", "8"]
    out = bench.run(_args(argv), lambda message: None)
    assert list(out["summary"]) == ["longtail", "all-short"]
    assert len(out["records"]) == 2 * 2 * 3
    for r in out["records"]:
        assert r["coverage_ok"] is True
        assert r["max_padded_tokens"] <= 2048  # the six distributions never exceed 2048 tokens
        if r["batching"] != "fixed_batch":
            assert r["aligned"] is True
    # World 3 does not divide the 256-sample steps: round-robin fixed batches misalign.
    fixed_3 = [r for r in out["records"] if r["batching"] == "fixed_batch" and r["world"] == 3]
    assert any(not r["aligned"] for r in fixed_3)
    longtail = out["summary"]["longtail"]
    # The long tail forces bs = 1 for fixed batches; token budgets need far fewer steps.
    assert longtail["planner"][0]["steps_ratio_fixed_batch"] > 2.0
    # ... with no padding at bs = 1, while token budgets pad little.
    assert longtail["padding_rate_fixed_batch"] == 0.0
    assert longtail["planner"][0]["padding_rate"] < 0.1


def test_generated_lengths_follow_their_recipes() -> None:
    for name, components in bench.DISTRIBUTIONS.items():
        a = bench.synthetic_lengths(name, seed=0)
        assert a.dtype == np.int64 and len(a) == 1000
        assert a.min() >= min(lo for _, lo, _ in components) and a.max() <= max(hi for _, _, hi in components)
        assert np.array_equal(a, bench.synthetic_lengths(name, seed=0))
    longtail = bench.synthetic_lengths("longtail", seed=0)
    assert np.count_nonzero(longtail >= 1024) == 100
    for name, m in bench.MATCHED.items():
        stats = bench.length_stats(bench.synthetic_lengths(name, seed=0))
        assert stats["samples"] == bench.MATCHED_SAMPLES
        assert stats["max"] <= m.max and stats["min"] >= bench.MIN_LENGTH
        assert abs(stats["median"] / m.median - 1) < 0.03 and abs(stats["cv"] - m.cv) < 0.05
    mix = bench.synthetic_lengths("multimodal-mix", seed=0, samples=500)
    assert len(mix) == 500 and mix.max() <= bench.MATCHED["sharegpt4o-like"].max


@pytest.mark.parametrize(
    "argv",
    [
        ["--global-batch", "0"],
        ["--window-steps", "0"],
        ["--lmax", "-1"],
        ["--world", "0"],
        ["--samples", "0"],
        ["--distribution", "nope"],
        ["--window", "4"],
    ],
)
def test_bad_flags_are_rejected(argv) -> None:
    with pytest.raises(SystemExit):
        _args(argv)


def test_bad_lengths_file(tmp_path) -> None:
    path = tmp_path / "bad.npy"
    np.save(path, np.array([3, 0, 5]))
    with pytest.raises(ValueError, match="--lengths"):
        bench.run(_args(["--lengths", str(path), "--lmax", "2048", "--world", "1"]), lambda message: None)
