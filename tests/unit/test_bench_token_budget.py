"""Tests of `batchplane bench token-budget` on tiny configurations: record fields, alignment
and coverage of the token-budget plans, the fixed-batch baseline, flags and the summary."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from batchplane.bench import token_budget as bench

FIELDS = {
    "distribution", "lmax", "world", "batching", "steps_per_rank", "aligned", "padding_rate",
    "samples_per_step", "coverage_ok", "max_padded_tokens",
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
    argv = ["--lengths", str(path), "--lmax", "2048", "--world", "2", "--window", "32"]
    out = bench.run(_args(argv), messages.append)
    json.dumps(out)  # JSON-serializable
    assert out["benchmark"] == "token-budget" and out["window"] == 32 and out["samples"] == 1000
    assert len(messages) == 1
    records = out["records"]
    assert [r["batching"] for r in records] == ["token_budget", "fixed_batch"]
    for r in records:
        assert set(r) == FIELDS
        assert (r["distribution"], r["lmax"], r["world"]) == ("mix", 2048, 2)
        assert len(r["steps_per_rank"]) == 2 and all(isinstance(s, int) for s in r["steps_per_rank"])
        assert r["coverage_ok"] is True
        assert 0.0 <= r["padding_rate"] < 1.0
        assert r["max_padded_tokens"] <= max(2048, int(lengths.max()))
    tb, fb = records
    assert tb["aligned"] is True
    assert tb["samples_per_step"] == pytest.approx(100 / (2 * tb["steps_per_rank"][0]))
    # Lengths up to ~3000 > Lmax: the fixed batch is a single sample, 50 steps per rank.
    assert fb["steps_per_rank"] == [50, 50] and fb["padding_rate"] == 0.0
    assert tb["steps_per_rank"][0] < 50 and tb["padding_rate"] < 0.2
    summary = out["summary"]["mix"]
    assert summary["padding_rate_token_budget"] == tb["padding_rate"]
    assert summary["steps_ratio"] == pytest.approx(50 / tb["steps_per_rank"][0])


def test_synthetic_sweep_is_aligned_covers_every_sample_and_fits_the_budget() -> None:
    argv = ["--distribution", "longtail", "--distribution", "all-short", "--lmax", "2048"]
    argv += ["--world", "3", "--world", "8"]
    out = bench.run(_args(argv), lambda message: None)
    assert list(out["summary"]) == ["longtail", "all-short"]
    assert len(out["records"]) == 2 * 2 * 2
    for r in out["records"]:
        assert r["coverage_ok"] is True
        assert r["max_padded_tokens"] <= 2048  # the six distributions never exceed 2048 tokens
        if r["batching"] == "token_budget":
            assert r["aligned"] is True
    # World 3 does not divide the 256-sample windows: round-robin fixed batches misalign.
    fixed_3 = [r for r in out["records"] if r["batching"] == "fixed_batch" and r["world"] == 3]
    assert any(not r["aligned"] for r in fixed_3)
    # The long tail forces bs = 1 for fixed batches; token budgets need far fewer steps.
    assert out["summary"]["longtail"]["steps_ratio"] > 2.0
    # ... with no padding at bs = 1, while token budgets pad little.
    assert out["summary"]["longtail"]["padding_rate_fixed_batch"] == 0.0
    assert out["summary"]["longtail"]["padding_rate_token_budget"] < 0.1


def test_synthetic_lengths_follow_the_stated_ranges() -> None:
    for name, components in bench.DISTRIBUTIONS.items():
        a = bench.synthetic_lengths(name, seed=0)
        assert a.dtype == np.int64 and len(a) == 1000
        assert a.min() >= min(lo for _, lo, _ in components) and a.max() <= max(hi for _, _, hi in components)
        assert np.array_equal(a, bench.synthetic_lengths(name, seed=0))
    longtail = bench.synthetic_lengths("longtail", seed=0)
    assert np.count_nonzero(longtail >= 1024) == 100


@pytest.mark.parametrize("argv", [["--window", "0"], ["--lmax", "-1"], ["--world", "0"], ["--distribution", "nope"]])
def test_bad_flags_are_rejected(argv) -> None:
    with pytest.raises(SystemExit):
        _args(argv)


def test_bad_lengths_file(tmp_path) -> None:
    path = tmp_path / "bad.npy"
    np.save(path, np.array([3, 0, 5]))
    with pytest.raises(ValueError, match="--lengths"):
        bench.run(_args(["--lengths", str(path), "--lmax", "2048", "--world", "1"]), lambda message: None)
