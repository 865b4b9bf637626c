"""Tests of batchplane.planner.dgraph (DGraph primitives compiled into a Strategy, run once per
step) and batchplane.planner.strategy (loading a job's strategy file): I1 (every good sample in
exactly one microbatch of one bucket), I2 (the same number of microbatches on every bucket) and
I4 (determinism) as properties over random steps and meshes for every balancing method, token
budgets, groups, intra on/off, axes DP and CP; secondary graphs over WORLD; the low-level hooks;
errors naming the graph and primitive; and the example strategies in examples/strategies/."""

from __future__ import annotations

import ast
import hashlib
import pathlib
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import ConfigError
from batchplane.core.mesh import ClientPlaceTree
from batchplane.demo.images import PAYLOAD
from batchplane.planner import DGraph, Strategy, StrategyError, models
from batchplane.planner.balance import spread
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.plan import SampleTable, StepPlan
from batchplane.planner.strategy import job_mesh, load_strategy

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = {"llm_long_short": "examples/strategies/llm_long_short.py", "vlm": "examples/strategies/vlm.py"}
QUADRATIC = make_cost_fn("quadratic")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
METHODS = ("karmarkar_karp", "greedy", "round_robin")


# ---- helpers ----------------------------------------------------------------------------


def _table(lengths, *, sources=None, image_tokens=None, seed: int = 0) -> SampleTable:
    """A step's allocation in a shuffled order: unique (source, seq), lengths (0 = bad)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    n = len(lengths)
    rng = np.random.default_rng(seed)
    source = np.asarray(sources if sources is not None else rng.integers(0, 3, n), dtype=np.int32)
    seq = np.arange(n, dtype=np.int64) + 1000
    features = {} if image_tokens is None else {"image_tokens": np.asarray(image_tokens, dtype=np.float64)}
    table = SampleTable(
        source=source, seq=seq, row=rng.permutation(n).astype(np.int64), length=lengths, epoch=np.zeros(n, np.int32), features=features
    )
    return table.take(rng.permutation(n))


@st.composite
def steps(draw, *, images: bool = False, max_n: int = 90) -> SampleTable:
    """Random steps: mostly short samples with a long tail, some bad ones (length 0), and with
    `images` an "image_tokens" feature, positive on a random subset, skewed too."""
    n = draw(st.integers(0, max_n))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = np.where(rng.random(n) < 0.85, rng.integers(1, 128, n), rng.integers(128, 8192, n))
    lengths[rng.random(n) < draw(st.sampled_from([0.0, 0.1, 0.4]))] = 0
    image_tokens = None
    if images:
        share = draw(st.sampled_from([0.0, 0.2, 0.6, 1.0]))
        tokens = np.where(rng.random(n) < 0.8, rng.integers(1, 256, n), rng.integers(256, 4096, n))
        image_tokens = np.where(rng.random(n) < share, tokens, 0)
    return _table(lengths, image_tokens=image_tokens, seed=int(rng.integers(2**31)))


meshes = st.builds(ClientPlaceTree, pp=st.integers(1, 2), dp=st.integers(1, 6), cp=st.integers(1, 3), tp=st.integers(1, 2))


def _graph(
    method: object = "karmarkar_karp",
    *,
    name: str = "text",
    axis: str = "DP",
    group_size: int | None = None,
    microbatches: int = 1,
    intra: bool = True,
    **balance,
) -> DGraph:
    g = DGraph(name)
    g.mix()
    g.distribute(axis=axis, group_size=group_size)
    g.cost(models.LLAMA_12B.cost)
    g.balance(method, microbatches=microbatches, intra=intra, **balance)
    return g


def _images(method: str = "greedy", **distribute) -> DGraph:
    g = DGraph("images", metadata="image_tokens")
    g.distribute(axis="WORLD", **distribute)
    g.cost(models.VIT_2B.cost)
    g.balance(method)
    return g


def _keys(table: SampleTable, index=None) -> list[tuple[int, int]]:
    index = np.arange(len(table)) if index is None else index
    return list(zip(table.source[index].tolist(), table.seq[index].tolist()))


def check_i1_i2(plan: StepPlan, allocated: SampleTable, buckets: int) -> None:
    """I1: the plan's samples are exactly the good samples, each in one microbatch of one
    bucket; I2: every bucket has the same number of microbatches."""
    good = allocated.length > 0
    assert plan.bad_samples == int(np.count_nonzero(~good))
    assert sorted(_keys(plan.samples)) == sorted(_keys(allocated, np.flatnonzero(good)))
    assert _keys(plan.samples) == sorted(_keys(plan.samples)), "samples in (source, seq) order"
    assert np.all(plan.samples.length > 0)
    assert plan.dp == buckets
    assert len({len(bucket) for bucket in plan.microbatches}) == 1, "I2"
    parts = [mb for bucket in plan.microbatches for mb in bucket]
    assert all(mb.dtype == np.int64 and np.all(np.diff(mb) > 0) for mb in parts), "ascending int64 indices"
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    assert np.array_equal(np.sort(flat), np.arange(len(plan.samples))), "I1: each good sample exactly once"


def fingerprint(plan: StepPlan) -> tuple:
    """Everything a trainer and the encoder ranks observe of a plan."""
    return (
        plan.step,
        plan.axis,
        plan.bad_samples,
        _keys(plan.samples),
        plan.costs.tolist(),
        tuple(tuple(mb.tolist() for mb in bucket) for bucket in plan.microbatches),
        tuple((s.name, s.axis, tuple(b.tolist() for b in s.buckets), s.costs.tolist()) for s in plan.subplans),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- I1, I2, I4 over random steps and meshes --------------------------------------------


@SETTINGS
@given(steps(), meshes, st.sampled_from(METHODS), st.sampled_from(["DP", "CP"]), st.integers(1, 3), st.booleans(), st.data())
def test_strategy_run_partitions_good_samples_into_aligned_microbatches(allocated, mesh, method, axis, microbatches, intra, data) -> None:
    buckets = mesh.buckets(axis)
    assert buckets == (mesh.sizes["dp"] if axis == "DP" else mesh.sizes["dp"] * mesh.sizes["cp"])
    group_size = data.draw(st.sampled_from([None, *_divisors(buckets), buckets + 1]), label="group_size")

    def build() -> Strategy:
        return _graph(method, axis=axis, group_size=group_size, microbatches=microbatches, intra=intra).plan()

    strategy = build()
    strategy.check(mesh)
    plan = strategy.run(7, allocated, mesh, default_cost=QUADRATIC)
    check_i1_i2(plan, allocated, buckets)
    assert (plan.step, plan.axis, plan.num_microbatches) == (7, axis, microbatches)
    np.testing.assert_array_equal(plan.costs, models.LLAMA_12B.cost(plan.samples.length.astype(np.int64)))
    # A microbatch is a filler only when the step has too few good samples.
    empty = sum(len(mb) == 0 for bucket in plan.microbatches for mb in bucket)
    assert empty == max(buckets * microbatches - len(plan.samples), 0)
    if not intra:
        for bucket in plan.microbatches:
            order = np.concatenate(bucket)
            assert np.all(np.diff(order) > 0), "intra=False keeps the bucket's sample order across its microbatches"
    # I4: a freshly compiled strategy on the same inputs plans the same, bit for bit.
    assert fingerprint(build().run(7, allocated, mesh, default_cost=QUADRATIC)) == fingerprint(plan)


@SETTINGS
@given(
    steps(),
    meshes,
    st.sampled_from(["DP", "CP"]),
    st.sampled_from([16, 100, 1024, 8192, 65536]),
    st.integers(1, 3),
    st.booleans(),
)
def test_token_budget_plans_are_aligned_and_fit_the_budget(allocated, mesh, axis, max_tokens, microbatches, padded) -> None:
    strategy = _graph("token_budget", axis=axis, microbatches=microbatches, max_tokens=max_tokens, padded=padded).plan()
    strategy.check(mesh)
    plan = strategy.run(0, allocated, mesh, default_cost=QUADRATIC)
    buckets = mesh.buckets(axis)
    check_i1_i2(plan, allocated, buckets)
    assert plan.num_microbatches >= microbatches
    empty = sum(len(mb) == 0 for bucket in plan.microbatches for mb in bucket)
    assert empty == max(buckets * plan.num_microbatches - len(plan.samples), 0), "groups are split before a microbatch is left empty"
    for bucket in plan.microbatches:
        for mb in bucket:
            if len(mb) >= 2:  # a single sample may exceed the budget alone
                lengths = plan.samples.length[mb].astype(np.int64)
                used = len(mb) * int(lengths.max()) if padded else int(lengths.sum())
                assert used <= max_tokens
    again = _graph("token_budget", axis=axis, microbatches=microbatches, max_tokens=max_tokens, padded=padded).plan()
    assert fingerprint(again.run(0, allocated, mesh, default_cost=QUADRATIC)) == fingerprint(plan)


def _meshes_of_world(world: int) -> list[ClientPlaceTree]:
    return [
        ClientPlaceTree(pp=pp, dp=world // (pp * cp * tp), cp=cp, tp=tp)
        for pp in (1, 2)
        for cp in (1, 2, 3)
        for tp in (1, 2)
        if world % (pp * cp * tp) == 0
    ]


@pytest.mark.parametrize("world", range(1, 9))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(allocated=steps(max_n=60), data=st.data())
def test_token_budget_keeps_i1_and_i2_at_every_world_size(world, allocated, data) -> None:
    mesh = data.draw(st.sampled_from(_meshes_of_world(world)), label="mesh")
    axis = data.draw(st.sampled_from(["DP", "CP"]), label="axis")
    budget = data.draw(
        st.one_of(st.fixed_dictionaries({"max_tokens": st.integers(1, 20000)}), st.fixed_dictionaries({"max_cost": st.floats(1e6, 1e16)})),
        label="budget",
    )
    plan = (
        _graph("token_budget", axis=axis, microbatches=data.draw(st.integers(1, 3)), **budget)
        .plan()
        .run(1, allocated, mesh, default_cost=QUADRATIC)
    )
    assert mesh.world == world
    check_i1_i2(plan, allocated, mesh.buckets(axis))
    empty = sum(len(mb) == 0 for bucket in plan.microbatches for mb in bucket)
    assert empty == max(mesh.buckets(axis) * plan.num_microbatches - len(plan.samples), 0)


@SETTINGS
@given(steps(), meshes, st.sampled_from(METHODS), st.integers(1, 2))
def test_a_user_balancing_callable_is_used_like_a_builtin(allocated, mesh, method, microbatches) -> None:
    calls = []

    def zigzag(costs: np.ndarray, parts: int) -> list[np.ndarray]:
        calls.append(parts)
        order = np.argsort(-costs, kind="stable")
        lane = np.arange(len(costs)) % (2 * parts)
        lane = np.where(lane < parts, lane, 2 * parts - 1 - lane)
        return [order[lane == p] for p in range(parts)]

    plan = _graph(zigzag, microbatches=microbatches).plan().run(0, allocated, mesh, default_cost=QUADRATIC)
    check_i1_i2(plan, allocated, mesh.sizes["dp"])
    assert plan.num_microbatches == microbatches
    assert calls and calls[0] == mesh.sizes["dp"]


def test_empty_and_all_bad_steps_give_filler_microbatches() -> None:
    mesh = ClientPlaceTree(dp=3, cp=2)
    for allocated in (SampleTable.empty(), _table([0, 0, 0])):
        plan = _graph(microbatches=2).plan().run(0, allocated, mesh, default_cost=QUADRATIC)
        check_i1_i2(plan, allocated, 3)
        assert plan.num_microbatches == 2 and plan.bad_samples == len(allocated)


def test_the_default_cost_applies_when_a_graph_registers_none() -> None:
    g = DGraph("text").distribute(axis="DP")
    plan = g.plan().run(0, _table([3, 5, 0, 7]), ClientPlaceTree(dp=2), default_cost=QUADRATIC)
    assert sorted(plan.costs.tolist()) == [9.0, 25.0, 49.0]


# ---- secondary graphs -------------------------------------------------------------------


@SETTINGS
@given(steps(images=True), meshes, st.sampled_from(["greedy", "karmarkar_karp", "round_robin"]))
def test_an_images_graph_over_world_holds_exactly_the_samples_with_images(allocated, mesh, method) -> None:
    def build() -> Strategy:
        return _graph(microbatches=2).plan(_images(method))

    plan = build().run(3, allocated, mesh, default_cost=QUADRATIC)
    check_i1_i2(plan, allocated, mesh.sizes["dp"])  # the primary graph still holds every sample
    (images,) = plan.subplans
    assert (images.name, images.axis, images.metadata) == ("images", "WORLD", "image_tokens")
    assert len(images.buckets) == mesh.world
    tokens = plan.samples.features["image_tokens"]
    flat = np.concatenate(images.buckets)
    assert np.array_equal(np.sort(flat), np.flatnonzero(tokens > 0)), "each sample with images in exactly one bucket"
    assert all(np.all(np.diff(b) > 0) for b in images.buckets)
    expected = np.where(tokens > 0, models.VIT_2B.cost(tokens.astype(np.int64)), 0.0)
    np.testing.assert_allclose(images.costs, expected)
    if method == "greedy" and len(flat):
        totals = images.bucket_costs()
        assert totals.max() - totals.min() <= images.costs.max() * (1 + 1e-9)
    assert fingerprint(build().run(3, allocated, mesh, default_cost=QUADRATIC)) == fingerprint(plan)


def test_greedy_balances_skewed_images_better_than_round_robin() -> None:
    rng = np.random.default_rng(5)
    n = 96
    tokens = np.where(rng.random(n) < 0.85, rng.integers(16, 256, n), rng.integers(2048, 8192, n))
    tokens[::7] = 0  # text-only samples
    allocated = _table(rng.integers(64, 4096, n), image_tokens=tokens, seed=1)
    mesh = ClientPlaceTree(pp=1, dp=4, cp=1, tp=2)
    ratios = {}
    for method in ("greedy", "round_robin"):
        plan = _graph().plan(_images(method)).run(0, allocated, mesh, default_cost=QUADRATIC)
        ratios[method] = spread(plan.subplans[0].bucket_costs())[1]  # max / mean
    assert ratios["greedy"] < 1.1
    assert ratios["round_robin"] > 1.5 * ratios["greedy"], ratios


def test_a_step_without_image_samples_has_empty_image_buckets() -> None:
    """A VLM job's step drawn only from text sources (no sample reports image_tokens) plans its
    text and leaves every encoder rank without images."""
    mesh = ClientPlaceTree(dp=2, tp=2)
    for allocated in (_table([5, 9, 0, 30, 4]), _table([5, 9, 30, 4], image_tokens=[0, 0, 0, 0])):
        plan = _graph().plan(_images()).run(0, allocated, mesh, default_cost=QUADRATIC)
        check_i1_i2(plan, allocated, 2)
        assert [len(b) for b in plan.subplans[0].buckets] == [0, 0, 0, 0]
        assert not plan.subplans[0].costs.any()


def test_a_secondary_graph_can_use_groups_and_the_dp_axis() -> None:
    mesh = ClientPlaceTree(dp=4, tp=2)
    allocated = _table(np.arange(1, 41), image_tokens=np.arange(40) % 3 * 100)
    strategy = _graph().plan(_images(group_size=4))
    strategy.check(mesh)
    plan = strategy.run(0, allocated, mesh, default_cost=QUADRATIC)
    assert len(plan.subplans[0].buckets) == 8
    assert sorted(np.concatenate(plan.subplans[0].buckets).tolist()) == np.flatnonzero(plan.samples.features["image_tokens"] > 0).tolist()


# ---- low-level hooks --------------------------------------------------------------------


def test_plan_raw_replaces_distribute_and_balance() -> None:
    mesh = ClientPlaceTree(dp=3, cp=2)
    seen = {}

    def by_index(samples: SampleTable, costs: np.ndarray, tree: ClientPlaceTree):
        seen.update(n=len(samples), costs=costs.copy(), tree=tree)
        n = len(samples)
        return [[np.arange(b, n, 6), np.arange(b + 3, n, 6)] for b in range(3)]

    allocated = _table([4, 0, 8, 1, 2, 3, 9, 7, 6, 5, 0, 10])
    plan = DGraph("text").cost("linear").plan_raw(by_index).plan().run(0, allocated, mesh, default_cost=QUADRATIC)
    check_i1_i2(plan, allocated, 3)
    assert seen["n"] == 10 and seen["tree"] is mesh
    np.testing.assert_array_equal(seen["costs"], plan.costs)
    assert [[mb.tolist() for mb in bucket] for bucket in plan.microbatches] == [[[0, 6], [3, 9]], [[1, 7], [4]], [[2, 8], [5]]]


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        (None, "must return"),
        ([[[0, 1, 2, 3]], [[4, 5]]], "returned 2 buckets, the axis has 3"),
        ([[[0, 1]], [[2, 3]], [[4], [5]]], "same number of microbatches"),
        ([[[0, 1]], [[2, 3]], [[4, 4]]], "exactly one microbatch"),  # 5 missing, 4 twice
        ([[[0, 1]], [[2, 3]], [[4]]], "exactly one microbatch"),  # 5 missing
        ([[[0, 1]], [[2, 3]], [[4, 5, 6]]], "exactly one microbatch"),  # 6 is no sample
        ([[[0, -1]], [[2, 3]], [[4, 5]]], "exactly one microbatch"),
        ([[["a"]], [[2, 3]], [[4, 5]]], "must return"),
    ],
)
def test_a_bad_plan_raw_result_raises_naming_plan_raw(result, problem: str) -> None:
    strategy = DGraph("text").plan_raw(lambda samples, costs, mesh: result).plan()
    with pytest.raises(StrategyError, match=r"^text\.plan_raw: .*" + problem):
        strategy.run(0, _table([1, 2, 3, 4, 5, 6]), ClientPlaceTree(dp=3), default_cost=QUADRATIC)


def test_plan_raw_of_a_secondary_graph_is_checked_and_indexes_its_members() -> None:
    mesh = ClientPlaceTree(dp=2)
    allocated = _table([5, 6, 7, 8], sources=[0, 0, 0, 0], image_tokens=[0, 10, 0, 20])
    images = DGraph("images", metadata="image_tokens").distribute(axis="WORLD")
    images.plan_raw(lambda samples, costs, tree: [[np.array([1])], [np.array([0])]])
    plan = _graph().plan(images).run(0, allocated, mesh, default_cost=QUADRATIC)
    assert [b.tolist() for b in plan.subplans[0].buckets] == [[3], [1]]
    images.plan_raw(lambda samples, costs, tree: [[np.array([0, 1])]])
    with pytest.raises(StrategyError, match=r"^images\.plan_raw: returned 1 buckets"):
        _graph().plan(images).run(0, allocated, mesh, default_cost=QUADRATIC)


def test_summary_buffer_adds_features_the_cost_model_uses() -> None:
    def summary(samples: SampleTable) -> dict[str, np.ndarray]:
        return {"loss_tokens": samples.length - 1.0}

    def cost(lengths: np.ndarray, features=None) -> np.ndarray:
        return np.asarray(features["loss_tokens"]) * 10.0

    allocated = _table([3, 0, 5, 1, 8])
    g = DGraph("text").cost(cost).summary_buffer(summary).balance("greedy")
    plan = g.plan().run(0, allocated, ClientPlaceTree(dp=2), default_cost=QUADRATIC)
    np.testing.assert_array_equal(plan.samples.features["loss_tokens"], plan.samples.length - 1.0)
    np.testing.assert_array_equal(plan.costs, (plan.samples.length - 1.0) * 10.0)
    # A secondary graph's summary feeds the secondary's metadata.
    images = DGraph("images", metadata="big").distribute(axis="WORLD").cost("linear")
    images.summary_buffer(lambda samples: {"big": np.where(samples.length > 4, samples.length, 0.0)})
    plan = DGraph("text").plan(images).run(0, allocated, ClientPlaceTree(dp=2), default_cost=QUADRATIC)
    assert sorted(plan.samples.length[np.concatenate(plan.subplans[0].buckets)].tolist()) == [5, 8]


def test_a_summary_of_the_wrong_shape_names_summary_buffer() -> None:
    g = DGraph("text").summary_buffer(lambda samples: {"x": np.zeros(len(samples) + 1)})
    with pytest.raises(StrategyError, match=r"^text\.summary_buffer: feature 'x' has shape"):
        g.plan().run(0, _table([1, 2]), ClientPlaceTree(), default_cost=QUADRATIC)


# ---- strategy-level checks and errors ----------------------------------------------------


def test_weights_come_from_the_mix_or_the_job() -> None:
    names, default = ("web", "code", "books"), (1.0, 2.0, 3.0)
    assert DGraph().mix().plan().weights(names, default) == default
    assert DGraph().plan().weights(names, default) == default
    assert DGraph().mix({"web": 3, "code": 0.5}).plan().weights(names, default) == (3.0, 0.5, 1.0)
    with pytest.raises(StrategyError, match=r"^text\.mix: \['nope'\] name no source"):
        DGraph().mix({"nope": 1.0}).plan().weights(names, default)
    with pytest.raises(StrategyError, match=r"^text\.mix: at least one source"):
        DGraph().mix({"web": 0, "code": 0, "books": 0}).plan().weights(names, default)


def test_broadcast_is_collected_from_every_graph() -> None:
    assert DGraph().plan().broadcast == frozenset()
    assert DGraph().plan(DGraph("images", metadata="image_tokens").broadcast_at("TP")).broadcast == frozenset({"TP"})


def _run_error(build) -> None:
    build().run(0, _table([1, 2, 3]), ClientPlaceTree(dp=2), default_cost=QUADRATIC)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: DGraph("bad name"), "DGraph name"),
        (lambda: DGraph("text").mix([("web", 1)]), r"text\.mix: schedule must be a mapping"),
        (lambda: DGraph("text").mix({"web": -1}), r"text\.mix: weight of 'web'"),
        (lambda: DGraph("text").mix({"web": float("nan")}), r"text\.mix: weight of 'web'"),
        (lambda: DGraph("text").mix({"web": True}), r"text\.mix: weight of 'web'"),
        (lambda: DGraph("text").distribute(axis="TP"), r"text\.distribute: axis must be one of"),
        (lambda: DGraph("text").distribute(group_size=0), r"text\.distribute: group_size"),
        (lambda: DGraph("text").distribute(group_size=2.0), r"text\.distribute: group_size"),
        (lambda: DGraph("text").cost(3), r"text\.cost: expected a callable"),
        (lambda: DGraph("text").balance("best"), r"text\.balance: method must be one of"),
        (lambda: DGraph("text").balance(7), r"text\.balance: method must be a name or a callable"),
        (lambda: DGraph("text").balance(microbatches=0), r"text\.balance: microbatches"),
        (lambda: DGraph("text").balance(microbatches=True), r"text\.balance: microbatches"),
        (lambda: DGraph("text").balance("token_budget"), r"text\.balance: 'token_budget' needs exactly one"),
        (lambda: DGraph("text").balance("token_budget", max_tokens=8, max_cost=8.0), r"text\.balance: 'token_budget' needs exactly one"),
        (lambda: DGraph("text").balance("token_budget", max_tokens=0), r"text\.balance: max_tokens"),
        (lambda: DGraph("text").balance("token_budget", max_cost=float("inf")), r"text\.balance: max_cost"),
        (lambda: DGraph("text").broadcast_at("PP"), r"text\.broadcast_at: dim must be one of"),
        (lambda: DGraph("text").plan_raw("plan"), r"text\.plan_raw: expected a callable"),
        (lambda: DGraph("text").summary_buffer(None), r"text\.summary_buffer: expected a callable"),
        (lambda: DGraph("text").distribute(axis="WORLD").plan(), r"text\.distribute: the primary graph"),
        (lambda: DGraph("text").plan(DGraph("images").mix()), r"images\.mix: only the primary graph"),
        (lambda: DGraph("text").plan(DGraph("text")), "DGraph names must differ"),
        (
            lambda: DGraph("text").distribute(group_size=3).plan().check(ClientPlaceTree(dp=4)),
            r"text\.distribute: group_size 3 must divide",
        ),
        (
            lambda: DGraph("text").plan(DGraph("images").distribute("WORLD", group_size=3)).check(ClientPlaceTree(dp=2, tp=2)),
            r"images\.distribute: group_size 3 must divide the 4 WORLD buckets",
        ),
        (
            lambda: DGraph("text").distribute(group_size=2).balance("token_budget", max_tokens=64).plan().check(ClientPlaceTree(dp=4)),
            r"text\.distribute: group_size does not apply",
        ),
        (lambda: _run_error(lambda: DGraph("text").cost(lambda lengths, features=None: -lengths).plan()), r"graph 'text': its cost model"),
        (
            lambda: _run_error(lambda: DGraph("text").cost(lambda lengths, features=None: lengths[:1]).plan()),
            r"graph 'text': its cost model",
        ),
        (
            lambda: _run_error(lambda: DGraph("text", metadata="image_tokens").plan()),
            r"graph 'text': metadata 'image_tokens' is not a feature",
        ),
    ],
)
def test_errors_name_the_graph_and_the_primitive(call, message: str) -> None:
    with pytest.raises(StrategyError, match="^" + message):
        call()


def test_group_size_at_least_the_bucket_count_balances_all_buckets_at_once() -> None:
    mesh = ClientPlaceTree(dp=4)
    allocated = _table(np.arange(1, 30))
    whole = _graph().plan().run(0, allocated, mesh, default_cost=QUADRATIC)
    for group_size in (4, 9):
        strategy = _graph(group_size=group_size).plan()
        strategy.check(mesh)
        assert fingerprint(strategy.run(0, allocated, mesh, default_cost=QUADRATIC)) == fingerprint(whole)


# ---- loading strategy files --------------------------------------------------------------


def _job(strategy: str | None, *, base_dir: pathlib.Path = REPO, **extra):
    data = {
        "job": "strategy-test",
        "sources": [{"name": "web", "path": "data/web"}, {"name": "captions", "path": "data/captions"}],
        "mesh": {"pp": 2, "dp": 4, "cp": 2, "tp": 2},
        "batch": {"global_batch_size": 64, "microbatches": 2},
        **extra,
    }
    if strategy is not None:
        data["strategy"] = strategy
    return job_from_mapping(data, base_dir=base_dir)


def _vlm_step(n: int = 96, seed: int = 3) -> SampleTable:
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.8, rng.integers(16, 512, n), rng.integers(2048, 16384, n))
    lengths[::11] = 0
    tokens = np.where(rng.random(n) < 0.5, rng.integers(64, 2048, n), 0)
    return _table(lengths, sources=rng.integers(0, 2, n), image_tokens=tokens, seed=seed)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_strategies_load_and_plan_a_4d_mesh(example: str) -> None:
    # vlm.py delivers the image columns, which the job must declare
    payload = {"payload": [dict(c) for c in PAYLOAD]} if example == "vlm" else {}
    job = _job(EXAMPLES[example], batch={"global_batch_size": 64, "microbatches": 2, **payload})
    assert job.strategy_digest == hashlib.sha256((REPO / EXAMPLES[example]).read_bytes()).hexdigest()
    strategy = load_strategy(job)
    assert isinstance(strategy, Strategy)
    mesh = job_mesh(job)
    assert mesh == ClientPlaceTree(pp=2, dp=4, cp=2, tp=2)
    assert strategy.weights(job.source_names, job.weights) == (1.0, 1.0)
    allocated = _vlm_step()
    plan = strategy.run(5, allocated, mesh, default_cost=QUADRATIC)
    check_i1_i2(plan, allocated, 4)
    assert (plan.axis, plan.num_microbatches) == ("DP", 2)
    np.testing.assert_array_equal(plan.costs, models.LLAMA_12B.cost(plan.samples.length.astype(np.int64)))
    assert strategy.primary.balancing.method == "karmarkar_karp"
    if example == "vlm":
        (images,) = plan.subplans
        assert (images.name, images.axis, len(images.buckets)) == ("images", "WORLD", 32)
        assert images.columns == ("pixel_values", "image_grid_thw")
        tokens = plan.samples.features["image_tokens"]
        assert np.array_equal(np.sort(np.concatenate(images.buckets)), np.flatnonzero(tokens > 0))
        np.testing.assert_allclose(images.costs[tokens > 0], models.VIT_2B.cost(tokens[tokens > 0].astype(np.int64)))
    else:
        assert plan.subplans == ()
    assert fingerprint(load_strategy(job).run(5, allocated, mesh, default_cost=QUADRATIC)) == fingerprint(plan)


def _strategy_body_lines(path: pathlib.Path) -> list[str]:
    """The non-blank, non-comment lines of the body of `strategy()` in a strategy file."""
    source = path.read_text()
    tree = ast.parse(source)
    (fn,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "strategy"]
    lines = source.splitlines()[fn.body[0].lineno - 1 : fn.end_lineno]
    return [line for line in lines if line.strip() and not line.strip().startswith("#")]


def test_example_strategies_are_seven_and_twelve_lines() -> None:
    llm = _strategy_body_lines(REPO / EXAMPLES["llm_long_short"])
    vlm = _strategy_body_lines(REPO / EXAMPLES["vlm"])
    assert len(llm) <= 7, llm
    assert len(vlm) <= 12 and len(vlm) - len(llm) <= 5, vlm
    for example, path in EXAMPLES.items():
        tree = ast.parse((REPO / path).read_text())
        doc = ast.get_docstring(tree)
        assert doc and f"strategy: {path}" in doc, example
        imports = [(n.module, [a.name for a in n.names]) for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert imports == [("batchplane.planner", ["DGraph", "models"])], example


def _write(tmp_path: pathlib.Path, body: str) -> str:
    (tmp_path / "s.py").write_text(textwrap.dedent(body))
    return "s.py"


_HEADER = "from batchplane.planner import DGraph, models\n"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("def strategy(mesh)\n    return None\n", "cannot load .*SyntaxError"),
        ("import no_such_module_here\n", "cannot load .*ModuleNotFoundError"),
        (_HEADER + "def plan(mesh):\n    return DGraph().plan()\n", "must define a function strategy"),
        (_HEADER + "strategy = DGraph().plan()\n", "must define a function strategy"),
        (_HEADER + "def strategy(mesh):\n    return DGraph()\n", "must return DGraph.plan.., got DGraph"),
        (_HEADER + "def strategy(mesh):\n    raise RuntimeError('boom')\n", "failed: RuntimeError: boom"),
        (_HEADER + "def strategy(mesh):\n    return DGraph().distribute(axis='TP').plan()\n", r"failed: StrategyError: text\.distribute"),
        (_HEADER + "def strategy(mesh):\n    return DGraph().mix({'nope': 1}).plan()\n", r"text\.mix: \['nope'\] name no source"),
        (
            _HEADER + "def strategy(mesh):\n    return DGraph().distribute(group_size=3).plan()\n",
            r"text\.distribute: group_size 3 must divide the 4 DP buckets",
        ),
    ],
)
def test_bad_strategy_files_are_config_errors_of_field_strategy(tmp_path: pathlib.Path, body: str, message: str) -> None:
    job = _job(_write(tmp_path, body), base_dir=tmp_path)
    with pytest.raises(ConfigError, match=message) as info:
        load_strategy(job)
    assert info.value.field == "strategy"
    assert info.value.value == "s.py"


def test_a_strategy_receives_the_job_mesh(tmp_path: pathlib.Path) -> None:
    body = (
        _HEADER
        + "SEEN = []\ndef strategy(mesh):\n    SEEN.append(mesh)\n    return DGraph().distribute(group_size=mesh.buckets('DP') // 2).plan()\n"
    )
    strategy = load_strategy(_job(_write(tmp_path, body), base_dir=tmp_path))
    assert strategy.primary.group_size == 2


def test_a_missing_strategy_file_is_a_config_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="cannot read strategy file") as info:
        _job("missing.py", base_dir=tmp_path)
    assert info.value.field == "strategy"


def test_an_unknown_cost_kind_names_balance_cost_kind(tmp_path: pathlib.Path) -> None:
    body = _HEADER + "def strategy(mesh):\n    return DGraph().cost('cubic').plan()\n"
    with pytest.raises(ConfigError) as info:
        load_strategy(_job(_write(tmp_path, body), base_dir=tmp_path))
    assert (info.value.field, info.value.value) == ("balance.cost.kind", "cubic")
    with pytest.raises(ConfigError) as info:
        load_strategy(_job(None, balance={"cost": {"kind": "cubic"}}))
    assert (info.value.field, info.value.value) == ("balance.cost.kind", "cubic")


def test_without_a_file_the_default_strategy_follows_the_balance_settings() -> None:
    job = _job(None, balance={"method": "token_budget", "max_tokens": 4096, "cost": {"kind": "linear"}})
    strategy = load_strategy(job)
    assert (strategy.primary.name, strategy.primary.axis, strategy.secondary) == ("text", "DP", ())
    b = strategy.primary.balancing
    assert (b.method, b.microbatches, b.max_tokens, b.padded) == ("token_budget", 2, 4096, True)
    allocated = _vlm_step()
    plan = strategy.run(0, allocated, job_mesh(job), default_cost=QUADRATIC)
    check_i1_i2(plan, allocated, 4)
    np.testing.assert_array_equal(plan.costs, plan.samples.length.astype(np.float64))
