"""Tests of `batchplane bench balance` on tiny configurations: record fields, the simulated
iteration time model, the synthetic draw, the per-rank independent draws of the paper's vanilla,
--lengths files and flags."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from batchplane.bench import balance as bench
from batchplane.core.mesh import ClientPlaceTree
from batchplane.planner.models import LLAMA_12B, VIT_2B

FIELDS = {
    "dp",
    "context",
    "method",
    "max_over_mean",
    "max_over_min",
    "encoder_max_over_mean",
    "sim_iteration_s",
    "speedup_vs_vanilla",
    "speedup_vs_round_robin",
    "speedup_vs_independent",
}
TINY = ["--tp", "2", "--samples-per-rank", "16", "--steps", "3"]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def _by(records: list[dict]) -> dict[tuple[int, int, str], dict]:
    return {(r["dp"], r["context"], r["method"]): r for r in records}


def test_balancing_is_never_slower_than_either_vanilla_on_the_skewed_draw() -> None:
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
        for vanilla_method, field in bench.VANILLAS.items():
            vanilla = by[(r["dp"], r["context"], vanilla_method)]
            assert r[field] == pytest.approx(vanilla["sim_iteration_s"] / r["sim_iteration_s"])
            if r["method"] in ("backbone", "hybrid"):
                assert r[field] >= 1.0
                assert r["max_over_mean"] < vanilla["max_over_mean"]
        assert r["speedup_vs_vanilla"] == r["speedup_vs_round_robin"]
        if r["method"] == "hybrid":  # the images graph beats both ways of leaving images unbalanced
            assert r["encoder_max_over_mean"] < by[(r["dp"], r["context"], "vanilla_independent")]["encoder_max_over_mean"]
    summary = out["summary"]
    assert summary["paper"]["mean"] == 1.77 and summary["paper"]["max"] == 4.54
    for method in ("hybrid", "backbone"):
        for key, field in (("vs_round_robin", "speedup_vs_round_robin"), ("vs_independent", "speedup_vs_independent")):
            speedups = [r[field] for r in records if r["method"] == method]
            assert summary[method][key]["mean_speedup"] == pytest.approx(np.mean(speedups))
            assert summary[method][key]["max_speedup"] == max(speedups)
            assert set(summary[method][key]["per_context"]) == {"4096", "16384"}
        # The top level keeps its meaning from before there were two vanillas.
        assert {k: summary[method][k] for k in ("mean_speedup", "max_speedup", "per_context")} == summary[method]["vs_round_robin"]
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

    # The independent vanilla: dp 0 trains samples 0 and 1 (its own draw), dp 1 samples 2 and 3;
    # a replica's samples with images go whole, in order, to its ranks (dp 1: 2 -> rank 1, 3 -> rank 3).
    own = bench.independent_strategy(microbatches=1, backbone_cost=LLAMA_12B.cost)
    plan = own.run(0, table, mesh, default_cost=LLAMA_12B.cost)
    encoder, backbone = bench.simulate(plan, mesh, encoder_split="dealt")
    dp0, dp1 = (bb[0] + bb[1]) / 2, (bb[2] + bb[3]) / 2
    np.testing.assert_allclose(backbone, [dp0, dp1, dp0, dp1])
    np.testing.assert_allclose(encoder, [enc[1], enc[2], 0.0, enc[3]])
    with pytest.raises(ValueError, match="encoder_split"):
        bench.simulate(plan, mesh, encoder_split="fluid")

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


@pytest.mark.parametrize("array", [np.array([3, 0, 5]), np.array([1.5, 2.0]), np.array([[1, 2], [3, -1]]), np.zeros((3, 2), np.int64)])
def test_bad_lengths_file(tmp_path, array) -> None:
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(ValueError, match="--lengths"):
        bench.load_workload(path)


@pytest.mark.parametrize("argv", [["--dp", "0"], ["--context", "-1"], ["--tflops", "0"], ["--tflops", "nan"], ["--steps", "0"]])
def test_bad_flags_are_rejected(argv) -> None:
    with pytest.raises(SystemExit):
        _args(argv)


def test_independent_vanilla_trains_each_ranks_own_draw() -> None:
    dp, per_rank = 4, 10
    text, image_tokens = bench.step_draw(seed=3, dp=dp, context=4096, step=5, samples_per_rank=per_rank)
    assert text.shape == image_tokens.shape == (dp * per_rank,)
    mesh = ClientPlaceTree(dp=dp, tp=2)
    strategy = bench.independent_strategy(microbatches=3, backbone_cost=LLAMA_12B.cost)
    plan = strategy.run(5, bench.sample_table(text, image_tokens), mesh, default_cost=LLAMA_12B.cost)
    for d, rank in enumerate(plan.microbatches):
        assert len(rank) == 3
        own = np.concatenate(rank)
        np.testing.assert_array_equal(own, np.arange(d * per_rank, (d + 1) * per_rank))  # in order, its block only
        mine = bench.rank_draw(seed=3, dp=dp, context=4096, step=5, rank=d, samples_per_rank=per_rank)
        np.testing.assert_array_equal(text[own], mine[0])
        np.testing.assert_array_equal(image_tokens[own], mine[1])


def test_independent_draws_are_deterministic_and_per_rank() -> None:
    key = {"dp": 4, "context": 8192, "step": 2, "samples_per_rank": 50}
    a = bench.step_draw(seed=1, **key)
    b = bench.step_draw(seed=1, **key)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], bench.step_draw(seed=2, **key)[0])
    assert not np.array_equal(a[0], bench.step_draw(seed=1, **{**key, "step": 3})[0])
    blocks = a[1].reshape(4, 50)
    assert len({tuple(block) for block in blocks}) == 4  # every rank has its own stream
    with pytest.raises(ValueError, match="rank"):
        bench.rank_draw(seed=1, dp=4, context=8192, step=2, rank=4, samples_per_rank=50)
    run = [*TINY, "--dp", "2", "--context", "4096", "--seed", "7"]
    assert bench.run(_args(run), lambda m: None) == bench.run(_args(run), lambda m: None)


def test_independent_draws_vary_per_step_and_converge_to_the_mixture() -> None:
    # A two-part mixture from a file: 3 short samples to 1 long one (share 0.25).
    workload = bench.Workload(np.array([10, 10, 10, 1000], np.int64), np.zeros(4, np.int64))
    dp, per_rank, steps = 4, 20, 400
    shares = np.array(
        [
            [
                np.mean(
                    bench.rank_draw(seed=0, dp=dp, context=4096, step=s, rank=d, samples_per_rank=per_rank, workload=workload)[0] == 1000
                )
                for d in range(dp)
            ]
            for s in range(steps)
        ]
    )  # [step, rank]
    assert len(np.unique(shares)) > 5 and shares.std() > 0.05  # per step a rank's share varies ...
    assert np.any(shares[:, 0] != shares[:, 1])  # ... and differs between ranks of one step
    np.testing.assert_allclose(shares.mean(axis=0), 0.25, atol=0.03)  # ... and converges per rank
    # The synthetic mixture: text-only samples (0.1) and long-tail text (0.02), per rank.
    text_only, tail = np.zeros((100, dp)), np.zeros((100, dp))
    for s in range(100):
        for d in range(dp):
            text, image_tokens = bench.rank_draw(seed=0, dp=dp, context=16384, step=s, rank=d, samples_per_rank=72)
            text_only[s, d], tail[s, d] = np.mean(image_tokens == 0), np.mean(text > bench.BODY_TEXT[1])
    assert text_only.std() > 0.01 and tail.std() > 0.005
    np.testing.assert_allclose(text_only.mean(axis=0), bench.TEXT_ONLY_SHARE, atol=0.02)
    np.testing.assert_allclose(tail.mean(axis=0), 1 - bench.BODY_SHARE, atol=0.01)
