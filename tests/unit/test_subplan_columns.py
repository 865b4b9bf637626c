"""Tests of secondary graphs that deliver payload columns (`DGraph.deliver`): the strategy's
checks against the job's `batch.payload`, the columns recorded in the step's SubPlan, and
`DeliveryRules.sample_fetchers`, the per-sample count of constructors fetching a sample that the
loaders release on (a rank encodes images of samples another replica trains, so its
constructor fetches them too). The count is checked as a property against a brute-force count
over constructors, rank by rank."""

from __future__ import annotations

import pathlib
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchplane.core.config import job_from_mapping
from batchplane.core.delivery import DeliveryRules
from batchplane.core.errors import ConfigError
from batchplane.core.mesh import ClientPlaceTree
from batchplane.planner import DGraph, StrategyError, models
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.plan import SampleTable
from batchplane.planner.strategy import load_strategy

PAYLOAD = [
    {"name": "pixel_values", "kind": "blob", "dtype": "uint8", "shape": [588]},
    {"name": "image_grid_thw", "kind": "blob", "dtype": "int64", "shape": [3]},
    {"name": "weights", "kind": "token", "dtype": "float32"},
]


def _vlm(*, deliver: tuple[str, ...] = ("pixel_values", "image_grid_thw")):
    text = DGraph("text").mix().distribute(axis="DP").cost(models.LLAMA_12B.cost).balance("karmarkar_karp", microbatches=2)
    images = DGraph("images", metadata="image_tokens").distribute(axis="WORLD").cost(models.VIT_2B.cost).balance("greedy")
    if deliver:
        images.deliver(*deliver)
    return text.plan(images)


def test_deliver_is_recorded_in_every_step_plan() -> None:
    mesh = ClientPlaceTree(dp=2, tp=2)
    n = 40
    rng = np.random.default_rng(0)
    table = SampleTable(
        source=np.zeros(n, np.int32),
        seq=np.arange(n, dtype=np.int64),
        row=np.arange(n, dtype=np.int64),
        length=rng.integers(1, 200, n).astype(np.int32),
        epoch=np.zeros(n, np.int32),
        features={"image_tokens": np.where(rng.random(n) < 0.5, rng.integers(1, 300, n), 0).astype(np.float64)},
    )
    plan = _vlm().run(0, table, mesh, default_cost=make_cost_fn("quadratic"))
    (images,) = plan.subplans
    assert images.columns == ("pixel_values", "image_grid_thw")
    assert sorted(np.concatenate(images.buckets).tolist()) == np.flatnonzero(table.features["image_tokens"] > 0).tolist()


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (("nope",), "'nope' is not a column of the job's batch.payload"),
        (("weights",), "'weights' is a per-token column"),
    ],
)
def test_check_columns_refuses_what_the_job_does_not_declare(columns, message) -> None:
    with pytest.raises(StrategyError, match=message):
        _vlm(deliver=columns).check_columns({c["name"]: c["kind"] for c in PAYLOAD})


def test_two_graphs_cannot_deliver_the_same_column() -> None:
    text = DGraph("text").mix()
    a = DGraph("a", metadata="image_tokens").distribute(axis="WORLD").deliver("pixel_values")
    b = DGraph("b", metadata="image_tokens").distribute(axis="WORLD").deliver("pixel_values")
    with pytest.raises(StrategyError, match="already delivered by a"):
        text.plan(a, b).check_columns({"pixel_values": "blob"})


def test_the_primary_graph_delivers_nothing_itself() -> None:
    with pytest.raises(StrategyError, match="text.deliver"):
        DGraph("text").mix().deliver("pixel_values").plan()


def test_a_strategy_file_delivering_an_undeclared_column_fails_at_start_naming_the_field(tmp_path: pathlib.Path) -> None:
    (tmp_path / "s.py").write_text(
        textwrap.dedent("""
        from batchplane.planner import DGraph
        def strategy(mesh):
            text = DGraph("text").mix()
            images = DGraph("images", metadata="image_tokens").distribute(axis="WORLD").deliver("pixels")
            return text.plan(images)
    """)
    )
    job = job_from_mapping(
        {"job": "j", "sources": [{"name": "a", "path": "a"}], "strategy": "s.py", "batch": {"payload": PAYLOAD}}, base_dir=tmp_path
    )
    with pytest.raises(ConfigError, match="strategy") as caught:
        load_strategy(job)
    assert "'pixels' is not a column" in str(caught.value)


# ---- per-sample fetcher counts ---------------------------------------------------------------


@st.composite
def layouts(draw):
    """A mesh, its constructors' ranks, a step's buckets (a partition of its samples) on the DP
    axis and a WORLD graph's parts (a partition of a subset)."""
    dp, tp, pp = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    mesh = ClientPlaceTree(dp=dp, tp=tp, pp=pp)
    per = draw(st.sampled_from([1, 2, mesh.world]))
    layout = [list(range(c, min(c + per, mesh.world))) for c in range(0, mesh.world, per)]
    n = draw(st.integers(0, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    owner = rng.integers(0, dp, n)
    buckets = [np.flatnonzero(owner == b) for b in range(dp)]
    encoded = rng.random(n) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    encoder = rng.integers(0, mesh.world, n)
    parts = [np.flatnonzero(encoded & (encoder == r)) for r in range(mesh.world)]
    broadcast = frozenset({"TP"}) if draw(st.booleans()) else frozenset()
    return mesh, layout, buckets, parts, n, broadcast


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_sample_fetchers_counts_each_constructor_once_per_sample(case) -> None:
    mesh, layout, buckets, parts, n, broadcast = case
    rules = DeliveryRules(mesh, broadcast=broadcast)
    copies = rules.sample_fetchers(layout, buckets, [("WORLD", parts)], n)
    expected = np.zeros(n, np.int32)
    for ranks in layout:  # brute force: the samples each constructor's ranks need, as a set
        wanted: set[int] = set()
        for r in ranks:
            v = rules.variant(r)
            if v.tensors:
                wanted |= set(buckets[v.bucket].tolist())
            wanted |= set(parts[r].tolist())
        for s in wanted:
            expected[s] += 1
    assert copies.tolist() == expected.tolist()
    # Without a delivering graph the count is the bucket's fetchers, for every sample.
    plain = rules.sample_fetchers(layout, buckets, [], n)
    per_bucket = rules.fetchers(layout)
    for b, index in enumerate(buckets):
        assert (plain[index] == per_bucket[b]).all()
        assert (copies[index] >= per_bucket[b]).all()
