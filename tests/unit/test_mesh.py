"""Tests of batchplane.core.mesh (the ClientPlaceTree: rank order, coordinates, buckets per
distribution axis, from_env, resize, errors naming the field) and batchplane.core.delivery
(which variant of its bucket each rank receives: TP peers identical (I3), CP slices, pipeline
stage roles, TP broadcast exclusion, fetchers per bucket)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.delivery import ALL, FIRST, LAST, MIDDLE, DeliveryRules
from batchplane.core.mesh import AXES, DEFAULT_ORDER, DISTRIBUTION_AXES, ClientPlaceTree, Coord, MeshError, parse_order

ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]
sizes_st = st.fixed_dictionaries({axis: st.integers(1, 4) for axis in AXES})
_settings = settings(max_examples=60, deadline=None)


def _layout(world: int, per_constructor: int) -> list[list[int]]:
    """Constructor c serves ranks [c*n, (c+1)*n), as JobSettings.constructor_ranks."""
    return [list(range(start, min(start + per_constructor, world))) for start in range(0, world, per_constructor)]


# ---- rank order -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "pp", "dp", "cp", "tp"),
    [
        (0, 0, 0, 0, 0),
        (1, 0, 0, 0, 1),  # tp varies fastest: TP peers are neighbours
        (2, 0, 0, 1, 0),
        (3, 0, 0, 1, 1),
        (4, 0, 1, 0, 0),
        (5, 0, 1, 0, 1),
        (6, 0, 1, 1, 0),
        (8, 1, 0, 0, 0),  # pp varies slowest
        (13, 1, 1, 0, 1),
        (15, 1, 1, 1, 1),
    ],
)
def test_megatron_order_places_tp_fastest_and_pp_slowest(rank: int, pp: int, dp: int, cp: int, tp: int) -> None:
    mesh = ClientPlaceTree(pp=2, dp=2, cp=2, tp=2)
    assert mesh.order == ("tp", "cp", "dp", "pp")
    assert mesh.coords(rank) == Coord(rank, pp, dp, cp, tp)
    assert mesh.rank(pp=pp, dp=dp, cp=cp, tp=tp) == rank


@pytest.mark.parametrize(
    ("sizes", "order", "rank", "expected"),
    [
        # 8 GPUs, tp=2 dp=4: ranks 0,1 are one TP group of replica 0.
        (dict(dp=4, tp=2), DEFAULT_ORDER, 1, (0, 0, 0, 1)),
        (dict(dp=4, tp=2), DEFAULT_ORDER, 6, (0, 3, 0, 0)),
        # dp fastest: consecutive ranks are different replicas.
        (dict(dp=4, tp=2), "dp-tp-cp-pp", 1, (0, 1, 0, 0)),
        (dict(dp=4, tp=2), "dp-tp-cp-pp", 6, (0, 2, 0, 1)),
        # pp=3 dp=2 cp=2 tp=1, Megatron order: rank = cp + 2 dp + 4 pp.
        (dict(pp=3, dp=2, cp=2), DEFAULT_ORDER, 11, (2, 1, 1, 0)),
        (dict(pp=3, dp=2, cp=2), "pp-dp-cp-tp", 11, (2, 1, 1, 0)),  # pp fastest: rank = pp + 3 dp + 6 cp
        (dict(pp=3, dp=2, cp=2), "pp-dp-cp-tp", 4, (1, 1, 0, 0)),
    ],
)
def test_coords_of_example_orders(sizes: dict, order: str, rank: int, expected: tuple[int, int, int, int]) -> None:
    mesh = ClientPlaceTree(order=order, **sizes)
    c = mesh.coords(rank)
    assert (c.pp, c.dp, c.cp, c.tp) == expected
    assert mesh.rank(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp) == rank


def test_parse_order_is_case_and_space_tolerant() -> None:
    assert parse_order(" TP - cp-DP-pp") == ("tp", "cp", "dp", "pp")


@_settings
@given(sizes_st, st.sampled_from(ORDERS))
def test_coords_and_rank_are_inverse_bijections_for_every_order(sizes: dict, order: str) -> None:
    mesh = ClientPlaceTree(order=order, **sizes)
    assert mesh.world == sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"]
    seen = set()
    for rank in range(mesh.world):
        c = mesh.coords(rank)
        assert c.rank == rank
        assert all(0 <= getattr(c, axis) < sizes[axis] for axis in AXES)
        assert mesh.rank(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp) == rank
        seen.add((c.pp, c.dp, c.cp, c.tp))
    assert len(seen) == mesh.world  # every coordinate exactly once
    # The order's first axis varies fastest: stepping it moves one rank.
    first, stride = mesh.order[0], 1
    if sizes[first] > 1:
        assert mesh.rank(**{first: 1}) - mesh.rank() == stride


@_settings
@given(sizes_st, st.sampled_from(ORDERS))
def test_buckets_partition_the_ranks_on_every_axis(sizes: dict, order: str) -> None:
    mesh = ClientPlaceTree(order=order, **sizes)
    pp, dp, cp, tp = (sizes[a] for a in AXES)
    assert mesh.buckets("DP") == dp
    assert mesh.buckets("CP") == dp * cp
    assert mesh.buckets("WORLD") == mesh.world
    for axis in DISTRIBUTION_AXES:
        owner = np.full(mesh.world, -1)
        for bucket in range(mesh.buckets(axis)):
            ranks = mesh.bucket_ranks(axis, bucket)
            assert ranks.dtype == np.int64
            assert np.all(np.diff(ranks) > 0), "bucket ranks ascending"
            assert np.all(owner[ranks] == -1), "a rank in two buckets"
            owner[ranks] = bucket
            for rank in ranks.tolist():
                assert mesh.bucket_of(rank, axis) == bucket
        assert np.all(owner >= 0), "a rank in no bucket"
    for bucket in range(dp):
        ranks = mesh.bucket_ranks("DP", bucket)
        assert len(ranks) == cp * tp * pp
        assert {mesh.coords(r).dp for r in ranks.tolist()} == {bucket}
    for bucket in range(dp * cp):
        ranks = mesh.bucket_ranks("CP", bucket)
        assert len(ranks) == tp * pp
        assert {(mesh.coords(r).dp, mesh.coords(r).cp) for r in ranks.tolist()} == {divmod(bucket, cp)}


def test_ranks_selects_by_coordinates() -> None:
    mesh = ClientPlaceTree(pp=2, dp=2, cp=1, tp=2)
    assert mesh.ranks(dp=1).tolist() == [2, 3, 6, 7]
    assert mesh.ranks(pp=1, tp=0).tolist() == [4, 6]
    assert mesh.ranks().tolist() == list(range(8))


def test_equality_and_hash_follow_sizes_and_order() -> None:
    a = ClientPlaceTree(dp=2, tp=2)
    assert a == ClientPlaceTree(dp=2, tp=2) and hash(a) == hash(ClientPlaceTree(dp=2, tp=2))
    assert a != ClientPlaceTree(dp=2, tp=2, order="dp-tp-cp-pp")
    assert a != ClientPlaceTree(dp=4)
    assert "dp=2" in repr(a) and "tp-cp-dp-pp" in repr(a)


def test_a_large_mesh_is_cheap() -> None:
    mesh = ClientPlaceTree(pp=8, dp=256, cp=2, tp=8)
    assert mesh.world == 32768
    assert mesh.coords(32767) == Coord(32767, 7, 255, 1, 7)
    assert len(mesh.bucket_ranks("DP", 17)) == 8 * 2 * 8


# ---- from_env and resize ----------------------------------------------------------------


def test_from_env_derives_dp_and_the_rank() -> None:
    mesh, rank = ClientPlaceTree.from_env({"WORLD_SIZE": "16", "RANK": "13"}, pp=2, cp=2, tp=2)
    assert mesh == ClientPlaceTree(pp=2, dp=2, cp=2, tp=2)
    assert rank == 13
    mesh, rank = ClientPlaceTree.from_env({"WORLD_SIZE": " 8 ", "RANK": "0"}, tp=2, order="dp-tp-cp-pp")
    assert mesh == ClientPlaceTree(dp=4, tp=2, order="dp-tp-cp-pp")
    assert rank == 0


def test_from_env_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    mesh, rank = ClientPlaceTree.from_env(cp=2)
    assert (mesh.sizes, rank) == ({"pp": 1, "dp": 2, "cp": 2, "tp": 1}, 3)


@pytest.mark.parametrize(
    ("env", "model", "field"),
    [
        ({"RANK": "0"}, {}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "4"}, {}, "RANK"),
        ({"WORLD_SIZE": "", "RANK": "0"}, {}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "four", "RANK": "0"}, {}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "4", "RANK": "-1"}, {}, "RANK"),
        ({"WORLD_SIZE": "4", "RANK": "1.0"}, {}, "RANK"),
        ({"WORLD_SIZE": "\u00b2", "RANK": "0"}, {}, "WORLD_SIZE"),  # a digit int() does not read
        ({"WORLD_SIZE": "0", "RANK": "0"}, {}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "12", "RANK": "0"}, dict(pp=2, tp=4), "WORLD_SIZE"),  # not a multiple of 8
        ({"WORLD_SIZE": "8", "RANK": "8"}, {}, "RANK"),  # outside the world
        ({"WORLD_SIZE": "8", "RANK": "0"}, dict(cp=0), "mesh.cp"),
        ({"WORLD_SIZE": "8", "RANK": "0"}, dict(pp=-2), "mesh.pp"),
        ({"WORLD_SIZE": "8", "RANK": "0"}, dict(tp=2, order="tp-cp-dp"), "mesh.order"),
    ],
)
def test_from_env_errors_name_the_variable(env: dict, model: dict, field: str) -> None:
    with pytest.raises(MeshError, match=field) as info:
        ClientPlaceTree.from_env(env, **model)
    assert str(info.value).startswith(field)


def test_resize_changes_some_sizes_and_keeps_the_rest() -> None:
    mesh = ClientPlaceTree(pp=2, dp=4, cp=2, tp=2, order="tp-dp-cp-pp")
    smaller = mesh.resize(dp=3)
    assert smaller.sizes == {"pp": 2, "dp": 3, "cp": 2, "tp": 2}
    assert smaller.order == mesh.order
    assert smaller.world == 24
    assert smaller.bucket_ranks("DP", 2).tolist() == sorted(r for r in range(24) if smaller.coords(r).dp == 2)
    reordered = mesh.resize(order=DEFAULT_ORDER)
    assert reordered == ClientPlaceTree(pp=2, dp=4, cp=2, tp=2)
    assert mesh.sizes["dp"] == 4, "resize returns a new tree"
    with pytest.raises(MeshError, match=r"^mesh\.dp"):
        mesh.resize(dp=0)


# ---- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: ClientPlaceTree(dp=0), "mesh.dp"),
        (lambda: ClientPlaceTree(tp=-1), "mesh.tp"),
        (lambda: ClientPlaceTree(cp=1.5), "mesh.cp"),
        (lambda: ClientPlaceTree(pp=True), "mesh.pp"),
        (lambda: ClientPlaceTree(order="tp-cp-dp"), "mesh.order"),
        (lambda: ClientPlaceTree(order="tp-tp-dp-pp"), "mesh.order"),
        (lambda: ClientPlaceTree(dp=2).coords(2), "rank"),
        (lambda: ClientPlaceTree(dp=2).coords(-1), "rank"),
        (lambda: ClientPlaceTree(dp=2).rank(dp=2), "dp"),
        (lambda: ClientPlaceTree(tp=2).rank(tp=-1), "tp"),
        (lambda: ClientPlaceTree(dp=2).ranks(ep=0), "unknown mesh axis 'ep'"),
        (lambda: ClientPlaceTree(dp=2).buckets("TP"), "axis"),
        (lambda: ClientPlaceTree(dp=2).bucket_of(0, "dp"), "axis"),
        (lambda: ClientPlaceTree(dp=2).bucket_ranks("DP", 2), "bucket 2"),
        (lambda: ClientPlaceTree(dp=2, cp=2).bucket_ranks("CP", -1), "bucket -1"),
    ],
)
def test_errors_name_the_field(call, field: str) -> None:
    with pytest.raises(MeshError) as info:
        call()
    assert str(info.value).startswith(field)


# ---- delivery ---------------------------------------------------------------------------

meshes_st = st.builds(
    ClientPlaceTree,
    pp=st.integers(1, 3),
    dp=st.integers(1, 3),
    cp=st.integers(1, 3),
    tp=st.integers(1, 3),
    order=st.sampled_from(ORDERS),
)


@_settings
@given(meshes_st, st.sampled_from(["DP", "CP"]), st.booleans())
def test_tp_peers_get_equal_variants(mesh: ClientPlaceTree, axis: str, middle: bool) -> None:
    """I3: without a TP broadcast, the ranks of one (pp, dp, cp) receive the same variant, so the
    constructor builds it once and hands every TP peer the same bytes."""
    rules = DeliveryRules(mesh, axis=axis, middle_tensors=("position_ids",) if middle else ())
    for rank in range(mesh.world):
        c = mesh.coords(rank)
        peers = [mesh.rank(pp=c.pp, dp=c.dp, cp=c.cp, tp=t) for t in range(mesh.sizes["tp"])]
        assert {rules.variant(p) for p in peers} == {rules.variant(rank)}
        assert rules.variant(rank).bucket == mesh.bucket_of(rank, axis)


@_settings
@given(meshes_st, st.sampled_from(["DP", "CP"]))
def test_tp_broadcast_leaves_only_tp0_with_tensors(mesh: ClientPlaceTree, axis: str) -> None:
    rules = DeliveryRules(mesh, axis=axis, broadcast=frozenset({"TP"}), middle_tensors=("position_ids",))
    plain = DeliveryRules(mesh, axis=axis, middle_tensors=("position_ids",))
    for rank in range(mesh.world):
        v = rules.variant(rank)
        assert v.tensors == (mesh.coords(rank).tp == 0)
        # Apart from `tensors`, the broadcast changes nothing.
        assert (v.bucket, v.cp_rank, v.stage) == (plain.variant(rank).bucket, plain.variant(rank).cp_rank, plain.variant(rank).stage)


@_settings
@given(meshes_st)
def test_cp_peers_get_distinct_slices_of_one_bucket(mesh: ClientPlaceTree) -> None:
    """I3: on axis DP, the CP peers of a (pp, dp, tp) share the bucket and get cp_rank 0..cp-1;
    on axis CP each consumes whole sequences of its own bucket."""
    cp = mesh.sizes["cp"]
    by_dp = DeliveryRules(mesh, axis="DP")
    by_cp = DeliveryRules(mesh, axis="CP")
    for rank in range(mesh.world):
        c = mesh.coords(rank)
        peers = [mesh.rank(pp=c.pp, dp=c.dp, cp=k, tp=c.tp) for k in range(cp)]
        variants = [by_dp.variant(p) for p in peers]
        assert {v.bucket for v in variants} == {c.dp}
        assert [v.cp_rank for v in variants] == (list(range(cp)) if cp > 1 else [None])
        assert [by_cp.variant(p).bucket for p in peers] == [c.dp * cp + k for k in range(cp)]
        assert all(by_cp.variant(p).cp_rank is None for p in peers)


@pytest.mark.parametrize(
    ("pp", "middle_tensors", "stages", "tensors"),
    [
        (1, (), [ALL], [True]),
        (2, (), [FIRST, LAST], [True, True]),
        (3, (), [FIRST, MIDDLE, LAST], [True, False, True]),
        (4, (), [FIRST, MIDDLE, MIDDLE, LAST], [True, False, False, True]),
        (4, ("position_ids",), [FIRST, MIDDLE, MIDDLE, LAST], [True, True, True, True]),
    ],
)
def test_pipeline_stage_roles(pp: int, middle_tensors: tuple, stages: list[str], tensors: list[bool]) -> None:
    mesh = ClientPlaceTree(pp=pp, dp=2, tp=2)
    rules = DeliveryRules(mesh, middle_tensors=middle_tensors)
    for rank in range(mesh.world):
        v = rules.variant(rank)
        s = mesh.coords(rank).pp
        assert (v.stage, v.tensors) == (stages[s], tensors[s])


@pytest.mark.parametrize(
    ("sizes", "axis", "per_constructor", "broadcast", "middle", "expected"),
    [
        # One constructor per GPU: both TP peers of a replica fetch its samples...
        (dict(dp=2, tp=2), "DP", 1, (), (), [2, 2]),
        # ...unless the trainer broadcasts along TP: then only tp=0's constructor does.
        (dict(dp=2, tp=2), "DP", 1, ("TP",), (), [1, 1]),
        # One constructor per pod of 2 GPUs (one TP group): one fetch per replica.
        (dict(dp=2, tp=2), "DP", 2, (), (), [1, 1]),
        # A pod of 4 GPUs serves both replicas.
        (dict(dp=2, tp=2), "DP", 4, (), (), [1, 1]),
        # CP peers of a replica slice the same samples: each of their constructors fetches them.
        (dict(dp=2, cp=2), "DP", 1, (), (), [2, 2]),
        (dict(dp=2, cp=2), "DP", 2, (), (), [1, 1]),
        # Axis CP: every (dp, cp) is its own bucket.
        (dict(dp=2, cp=2), "CP", 1, (), (), [1, 1, 1, 1]),
        (dict(dp=2, cp=2, tp=2), "CP", 1, ("TP",), (), [1, 1, 1, 1]),
        # Three stages, one constructor each: the middle one needs nothing by default.
        (dict(pp=3), "DP", 1, (), (), [2]),
        (dict(pp=3), "DP", 1, (), ("position_ids",), [3]),
        (dict(pp=3, dp=2), "DP", 2, (), (), [2, 2]),
        # A layout that does not divide the world (last constructor serves fewer ranks).
        (dict(dp=3, tp=1), "DP", 2, (), (), [1, 1, 1]),
    ],
)
def test_fetchers_per_bucket(sizes: dict, axis: str, per_constructor: int, broadcast: tuple, middle: tuple, expected: list[int]) -> None:
    mesh = ClientPlaceTree(**sizes)
    rules = DeliveryRules(mesh, axis=axis, broadcast=frozenset(broadcast), middle_tensors=middle)
    layout = _layout(mesh.world, per_constructor)
    assert rules.fetchers(layout) == expected
    # Consistent with needs_samples per constructor.
    assert sum(len(rules.needs_samples(ranks)) for ranks in layout) == sum(expected)


def test_needs_samples_skips_ranks_without_tensors() -> None:
    mesh = ClientPlaceTree(dp=2, tp=2)
    rules = DeliveryRules(mesh, broadcast=frozenset({"TP"}))
    assert rules.needs_samples([1, 3]) == set()
    assert rules.needs_samples([0, 1, 3]) == {0}
    assert rules.needs_samples(range(4)) == {0, 1}
