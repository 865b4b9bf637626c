"""Tests of `batchplane bench balance` on tiny configurations: record fields, the simulated
iteration time model, the synthetic draw, --lengths files and flags."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from batchplane.bench import balance as bench
from batchplane.core.mesh import ClientPlaceTree
from batchplane.planner.models import LLAMA_12B, VIT_2B

FIELDS = {
    "dp", "context", "method", "max_over_mean", "max_over_min", "encoder_max_over_mean",
    "sim_iteration_s", "speedup_vs_vanilla",
}
TINY = ["--tp", "2", "--samples-per-rank", "16", "--steps", "3"]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def _by(records: list[dict]) -> dict[tuple[int, int, str], dict]:
    return {(r["dp"], r["context"], r["method"]): r for r in records}


def test_balancing_is_never_slower_than_vanilla_on_the_skewed_draw() -> None:
    messages: list[str] = []
    out = bench.run(_args([*TINY, "--dp", "2", "--dp", "4", "--context", "4096", "--context", "16384"]), messages.append)
    json.dumps(out, allow_nan=False)
    assert out["benchmark"] == "balance" and out["source"] == "synthetic" and len(messages) == 4
    records = out["records"]
    assert [(r["dp"], r["context"], r["method"]) for r in records] == [
        (dp, c, m) for dp in (2, 4) for c in (4096, 16384) for m in bench.METHODS
    ]
    by = _by(records)
    for r in records:
        assert set(r) == FIELDS
        assert r["max_over_min"] >= r["max_over_mean"] >= 1.0 and r["encoder_max_over_mean"] >= 1.0
        vanilla = by[(r["dp"], r["context"], "vanilla")]
        assert r["speedup_vs_vanilla"] == pytest.approx(vanilla["sim_iteration_s"] / r["sim_iteration_s"])
        if r["method"] != "vanilla":
            assert r["speedup_vs_vanilla"] >= 1.0
            assert r["max_over_mean"] < vanilla["max_over_mean"]
    summary = out["summary"]
    assert summary["paper"]["mean"] == 1.77 and summary["paper"]["max"] == 4.54
    for method in ("hybrid", "backbone"):
        speedups = [r["speedup_vs_vanilla"] for r in records if r["method"] == method]
        assert summary[method]["mean_speedup"] == pytest.approx(np.mean(speedups))
        assert summary[method]["max_speedup"] == max(speedups)
        assert set(summary[method]["per_context"]) == {"4096", "16384"}
    for context, stats in out["workload"].items():
        assert stats["samples"] == 3 * 16 * (2 + 4)
        assert stats["capped_share"] <= 1.0 and 0.0 <= stats["encoder_flops_share"] < 1.0


def test_simulate_places_encoder_and_backbone_flops_on_the_right_ranks() -> None:
    mesh = ClientPlaceTree(dp=2, tp=2, order="dp-tp-cp-pp")  # DP fastest: dp 0 holds ranks 0 and 2
    text = np.array([10, 20, 30, 40], np.int64)
    image_tokens = np.array([0, 100, 400, 900], np.int64)
    table = bench.sample_table(text, image_tokens)
    vanilla = bench.vision_language_strategy(text_method="round_robin", microbatches=1, backbone_cost=LLAMA_12B.cost)
    plan = vanilla.run(0, table, mesh, default_cost=LLAMA_12B.cost)
    encoder, backbone = bench.simulate(plan, mesh)
    bb, enc = LLAMA_12B.cost(text + image_tokens), VIT_2B.cost(image_tokens)
    # Round robin: samples 0 and 2 on dp 0 (ranks 0, 2), samples 1 and 3 on dp 1 (ranks 1, 3).
    dp0, dp1 = (bb[0] + bb[2]) / 2, (bb[1] + bb[3]) / 2
    np.testing.assert_allclose(backbone, [dp0, dp1, dp0, dp1])
    e0, e1 = enc[2] / 2, (enc[1] + enc[3]) / 2
    np.testing.assert_allclose(encoder, [e0, e1, e0, e1])

    hybrid = bench.vision_language_strategy(
        text_method="karmarkar_karp", microbatches=1, backbone_cost=LLAMA_12B.cost, encoder_cost=VIT_2B.cost
    )
    plan = hybrid.run(0, table, mesh, default_cost=LLAMA_12B.cost)
    encoder, backbone = bench.simulate(plan, mesh)
    # Three samples with images over four ranks: one each, the largest apart; rank 3 has none.
    assert sorted(encoder.tolist()) == sorted([0.0, *enc[1:].tolist()])
    for images, rank in zip(plan.subplans[0].buckets, range(mesh.world)):
        assert encoder[rank] == pytest.approx(enc[images].sum())
    rank_costs = plan.rank_costs() / 2
    np.testing.assert_allclose(backbone, rank_costs[[mesh.coords(r).dp for r in range(mesh.world)]])


def test_the_draw_fits_the_context_and_has_the_stated_skew() -> None:
    rng = np.random.default_rng(0)
    text, image_tokens = bench.draw_samples(rng, 100_000, context=4096)
    assert text.min() >= 8 and (text + image_tokens).max() <= 4096 and image_tokens.min() >= 0
    stats = bench.workload_stats([(text, image_tokens)], context=4096)
    assert 0.975 < stats["text_le_64_share"] < 0.985
    assert 0.08 < stats["tail_text_token_share"] < 0.10
    assert 0.09 < stats["text_only_share"] < 0.11
    long = bench.workload_stats([bench.draw_samples(rng, 100_000, context=16384)], context=16384)
    assert stats["capped_share"] > 5 * long["capped_share"] > 0.0  # the cap bites at short contexts
    assert long["mean_image_tokens"] > stats["mean_image_tokens"]


def test_text_only_lengths_file_makes_hybrid_equal_backbone(tmp_path) -> None:
    path = tmp_path / "text.npy"
    np.save(path, np.random.default_rng(2).integers(1, 5000, 500))
    out = bench.run(_args([*TINY, "--dp", "4", "--context", "4096", "--lengths", str(path)]), lambda m: None)
    assert out["source"] == str(path)
    by = _by(out["records"])
    assert by[(4, 4096, "hybrid")]["sim_iteration_s"] == by[(4, 4096, "backbone")]["sim_iteration_s"]
    assert all(r["encoder_max_over_mean"] == 1.0 for r in out["records"])  # no images at all
    assert out["workload"]["4096"]["mean_image_tokens"] == 0.0
    assert out["workload"]["4096"]["capped_share"] < 0.01


@pytest.mark.parametrize("form", ["npy", "npz"])
def test_lengths_file_with_images_keeps_only_samples_that_fit(tmp_path, form) -> None:
    text = np.array([30, 40, 50, 6000], np.int64)
    image_tokens = np.array([0, 500, 3000, 0], np.int64)
    path = tmp_path / f"vl.{form}"
    if form == "npy":
        np.save(path, np.stack([text, image_tokens]))
    else:
        np.savez(path, text=text, image_tokens=image_tokens)
    workload = bench.load_workload(path)
    np.testing.assert_array_equal(workload.image_tokens, image_tokens)
    out = bench.run(_args([*TINY, "--dp", "2", "--context", "4096", "--lengths", str(path)]), lambda m: None)
    stats = out["workload"]["4096"]
    assert stats["mean_text_tokens"] < 51  # the 6,000-token sample never fits 4096
    with pytest.raises(ValueError, match="no sample fits context 16"):
        bench.run(_args([*TINY, "--dp", "2", "--context", "16", "--lengths", str(path)]), lambda m: None)


@pytest.mark.parametrize(
    "array", [np.array([3, 0, 5]), np.array([1.5, 2.0]), np.array([[1, 2], [3, -1]]), np.zeros((3, 2), np.int64)]
)
def test_bad_lengths_file(tmp_path, array) -> None:
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(ValueError, match="--lengths"):
        bench.load_workload(path)


@pytest.mark.parametrize("argv", [["--dp", "0"], ["--context", "-1"], ["--tflops", "0"], ["--tflops", "nan"], ["--steps", "0"]])
def test_bad_flags_are_rejected(argv) -> None:
    with pytest.raises(SystemExit):
        _args(argv)
