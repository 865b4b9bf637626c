"""The source partitioner (`batchplane.operator.partition`, MegaScale-Data §5.1): the paper's
constraints as properties over random profiles and pod limits (memory per pod, every source in
exactly one group, 1..A actors, 1..W workers per actor, determinism), worked examples with the
numbers done by hand, the 64-source fixture, and the profile and DataPlane formats."""

from __future__ import annotations

import ast
import math
import pathlib
import re

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from batchplane.core.errors import ConfigError
from batchplane.operator import partition as part
from batchplane.operator.partition import (
    GiB,
    MiB,
    PartitionError,
    PartitionSettings,
    ProfileSet,
    SourceProfile,
    describe,
    format_memory,
    parse_cpu,
    parse_memory,
    partition,
    profiles_from_mapping,
    to_dataplane,
    to_values,
)

POD = PartitionSettings(pod_memory_bytes=32 * GiB, pod_cpus=8, memory_headroom=0.0)
#: actor_base + buffer with the default settings.
FIXED = 256 * MiB + 512 * MiB


def src(name: str, *, cost: float = 1e-3, state: int = MiB, weight: float = 1.0) -> SourceProfile:
    return SourceProfile(name=name, path=f"/data/{name}", state_bytes=state, cost_s=cost, weight=weight)


def with_(base: PartitionSettings = POD, **changes) -> PartitionSettings:
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    return PartitionSettings(**{**fields, **changes})


# ---- the 64-source fixture --------------------------------------------------------------------

#: kind, sources, decode + transform seconds per sample (low, high), state bytes (low, high),
#: mixture weight (low, high); values drawn log-uniformly (weights uniformly) from one seed.
KINDS = (
    ("web", 24, (15e-6, 60e-6), (8 * MiB, 600 * MiB), (0.5, 3.0)),
    ("code", 12, (30e-6, 120e-6), (40 * MiB, 400 * MiB), (0.3, 1.5)),
    ("chat", 8, (40e-6, 150e-6), (4 * MiB, 60 * MiB), (0.2, 1.0)),
    ("math", 8, (5e-6, 20e-6), (1 * MiB, 16 * MiB), (0.1, 0.6)),
    ("imagetext", 8, (2e-3, 15e-3), (200 * MiB, 2 * GiB), (0.3, 1.2)),
    ("video", 4, (40e-3, 150e-3), (2 * GiB, 7 * GiB), (0.2, 0.8)),
)


def profiles_64() -> list[SourceProfile]:
    """64 synthetic sources: cheap text with small state up to video with gigabytes of it."""
    rng = np.random.default_rng(64)
    out = []
    for kind, count, cost, state, weight in KINDS:
        for i in range(count):
            out.append(
                SourceProfile(
                    name=f"{kind}-{i:02d}",
                    path=f"s3://corpus/{kind}/{i:02d}/",
                    state_bytes=int(np.exp(rng.uniform(np.log(state[0]), np.log(state[1])))),
                    cost_s=float(np.exp(rng.uniform(np.log(cost[0]), np.log(cost[1])))),
                    weight=round(float(rng.uniform(*weight)), 3),
                )
            )
    return out


def fixture_document() -> dict:
    """The fixture as a `batchplane profile` document (for `batchplane partition`)."""
    return {
        "job": "synthetic-64",
        "sources": [
            {"name": p.name, "path": p.path, "state_bytes": p.state_bytes, "transform_s_per_sample": p.cost_s, "weight": p.weight}
            for p in profiles_64()
        ],
    }


# ---- an independent statement of the model ---------------------------------------------------


def usable(s: PartitionSettings) -> int:
    return int(s.pod_memory_bytes * (1 - s.memory_headroom))


def memory_of(sources, workers: int, s: PartitionSettings) -> int:
    state = sum(p.state_bytes for p in sources)
    fixed = s.actor_base_bytes + s.buffer_bytes
    if s.state_per == "worker":
        return fixed + workers * (s.worker_base_bytes + state)
    return fixed + state + workers * s.worker_base_bytes


def worker_limit(s: PartitionSettings) -> int:
    cores = math.floor(s.pod_cpus + 1e-9)
    return min(s.max_workers_per_actor or cores, cores)


# ---- strategies -------------------------------------------------------------------------------


@st.composite
def profile_lists(draw) -> list[SourceProfile]:
    names = draw(st.lists(st.text("abcdefghijk0123456789-_.", min_size=1, max_size=6), min_size=1, max_size=20, unique=True))
    return [
        SourceProfile(
            name=name,
            path=f"/d/{name}",
            state_bytes=draw(st.one_of(st.integers(0, 64 * MiB), st.integers(0, 3 * GiB))),
            cost_s=draw(st.one_of(st.just(0.0), st.floats(1e-7, 0.5))),
            weight=draw(st.one_of(st.just(0.0), st.floats(0.001, 10.0))),
        )
        for name in names
    ]


@st.composite
def pod_settings(draw) -> PartitionSettings:
    return PartitionSettings(
        pod_memory_bytes=draw(st.integers(512 * MiB, 64 * GiB)),
        pod_cpus=draw(st.one_of(st.integers(1, 32), st.floats(1.0, 32.0))),
        max_workers_per_actor=draw(st.one_of(st.none(), st.integers(1, 16))),
        max_actors_per_source=draw(st.integers(1, 12)),
        cost_levels=draw(st.integers(1, 6)),
        samples_per_s=draw(st.one_of(st.none(), st.floats(1.0, 1e5))),
        actor_base_bytes=draw(st.integers(0, 512 * MiB)),
        buffer_bytes=draw(st.integers(0, 1 * GiB)),
        worker_base_bytes=draw(st.integers(0, 256 * MiB)),
        memory_headroom=draw(st.floats(0.0, 0.5)),
        state_per=draw(st.sampled_from(["worker", "actor"])),
        one_source_per_group=draw(st.booleans()),
    )


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- properties -------------------------------------------------------------------------------


@PROPERTY
@given(profile_lists(), pod_settings())
def test_constraints_hold_or_the_source_that_cannot_fit_is_named(profiles, s) -> None:
    overhead_too_big = memory_of([], 1, s) > usable(s)
    too_big = [p for p in sorted(profiles, key=lambda p: p.name) if memory_of([p], 1, s) > usable(s)]
    if overhead_too_big or too_big:
        with pytest.raises(PartitionError) as info:
            partition(profiles, s)
        message = str(info.value)
        assert str(usable(s)) in message
        if not overhead_too_big:
            assert f"source {too_big[0].name!r}" in message and str(too_big[0].state_bytes) in message
        return
    result = partition(profiles, s)

    placed = [p.name for g in result.groups for p in g.sources]
    assert sorted(placed) == sorted(p.name for p in profiles)  # every source, each exactly once
    by_name = {p.name: p for p in profiles}
    total_weight = sum(p.weight for p in profiles)
    for g in result.groups:
        assert 1 <= g.actors <= s.max_actors_per_source
        assert 1 <= g.workers_per_actor <= worker_limit(s) <= s.pod_cpus + 1e-9  # CPUs read from quantities round
        assert [p.name for p in g.sources] == sorted(p.name for p in g.sources)
        assert all(p == by_name[p.name] or p.weight == by_name[p.name].weight for p in g.sources)
        # One actor holds the whole state of every source of its group, with its workers.
        assert g.memory_bytes == memory_of(g.sources, g.workers_per_actor, s) <= usable(s)
        if g.capped:
            assert g.actors == s.max_actors_per_source and g.workers < g.workers_needed and len(g.sources) == 1
        else:
            assert g.workers >= g.workers_needed
        if s.samples_per_s is not None and not g.capped:
            shares = [(p.weight / total_weight if total_weight else 1 / len(profiles)) * p.cost_s for p in g.sources]
            assert g.workers >= sum(shares) * s.samples_per_s * (1 - 1e-9)
    if s.one_source_per_group:
        assert all(len(g.sources) == 1 for g in result.groups)
    for entry in to_dataplane(result, name="j")["spec"]["sourceGroups"]:
        requests, limits = entry["resources"]["requests"], entry["resources"]["limits"]
        assert parse_memory(requests["memory"], allow_zero=True) <= parse_memory(limits["memory"]) == s.pod_memory_bytes
        assert 1 <= entry["minReplicas"] <= entry["maxReplicas"] == s.max_actors_per_source
        assert parse_cpu(requests["cpu"]) == entry["workersPerActor"] <= s.pod_cpus + 1e-9


@PROPERTY
@given(profile_lists(), pod_settings(), st.randoms(use_true_random=False))
def test_the_same_profiles_in_any_order_give_the_same_partition(profiles, s, rnd) -> None:
    shuffled = list(profiles)
    rnd.shuffle(shuffled)
    try:
        first = partition(profiles, s)
    except PartitionError as exc:
        with pytest.raises(PartitionError) as info:
            partition(shuffled, s)
        assert str(info.value) == str(exc)
        return
    second = partition(shuffled, s)
    assert second == first
    assert yaml.safe_dump(to_dataplane(second, name="j")) == yaml.safe_dump(to_dataplane(first, name="j"))
    assert describe(second) == describe(first)


@PROPERTY
@given(profile_lists(), pod_settings())
def test_only_weight_ratios_matter(profiles, s) -> None:
    scaled = {p.name: p.weight * 4 for p in profiles}
    try:
        first = partition(profiles, s)
    except PartitionError:
        return
    again = partition(profiles, s, weights=scaled)
    assert [(g.name, g.sources and [p.name for p in g.sources], g.actors, g.workers_per_actor) for g in again.groups] == [
        (g.name, [p.name for p in g.sources], g.actors, g.workers_per_actor) for g in first.groups
    ]


# ---- worked examples --------------------------------------------------------------------------


def test_two_cheap_sources_share_one_actor() -> None:
    result = partition([src("b"), src("a")], POD)
    (group,) = result.groups
    assert group.name == "level0-0"
    assert [p.name for p in group.sources] == ["a", "b"]
    # unit = their mean demand (0.5 ms), so the pooled need is 2 workers, in one actor.
    assert (group.workers_needed, group.actors, group.workers_per_actor) == (2, 1, 2)
    assert group.memory_bytes == FIXED + 2 * (64 * MiB + 2 * MiB)


def test_costlier_sources_get_workers_in_proportion_to_their_cost() -> None:
    result = partition([src("cheap", cost=1e-3), src("dear", cost=8e-3)], POD)
    assert [(g.name, [p.name for p in g.sources], g.actors, g.workers_per_actor) for g in result.groups] == [
        ("level0-0", ["cheap"], 1, 1),
        ("level1-0", ["dear"], 1, 8),
    ]


def test_the_mixture_weight_folds_into_the_cost() -> None:
    """8x the cost at 1/8 the weight is the same demand: one level, one group."""
    result = partition([src("common", cost=1e-3, weight=8), src("rare", cost=8e-3, weight=1)], POD)
    (group,) = result.groups
    assert [p.name for p in group.sources] == ["common", "rare"]
    assert (group.actors, group.workers_per_actor) == (1, 2)


def test_a_target_rate_sizes_workers_in_cores() -> None:
    """1000 samples/s of 10 ms each is 10 cores: two actors of five (W = 8)."""
    result = partition([src("a", cost=0.01)], with_(samples_per_s=1000.0))
    (group,) = result.groups
    assert (group.workers_needed, group.actors, group.workers_per_actor) == (10, 2, 5)
    assert result.samples_per_s == pytest.approx(1000.0)


def test_short_memory_raises_the_actor_count() -> None:
    """16 workers of a source with 6 GiB of state: 5 fit a 32 GiB pod (768 MiB overhead, then
    6 GiB + 64 MiB each), so 4 actors, spread evenly to 4 workers: 25 GiB a pod."""
    result = partition([src("video", cost=0.01, state=6 * GiB)], with_(samples_per_s=1600.0))
    (group,) = result.groups
    assert (group.workers_needed, group.actors, group.workers_per_actor) == (16, 4, 4)
    assert group.memory_bytes == 25 * GiB
    assert to_values(result)["sourceGroups"][0]["resources"]["requests"]["memory"] == "25Gi"
    # Workers sharing one copy of the state: 8 workers fit, so 2 actors of 8.
    shared = partition([src("video", cost=0.01, state=6 * GiB)], with_(samples_per_s=1600.0, state_per="actor"))
    (group,) = shared.groups
    assert (group.actors, group.workers_per_actor, group.memory_bytes) == (2, 8, FIXED + 6 * GiB + 8 * 64 * MiB)


def test_headroom_leaves_part_of_the_pod_unplanned() -> None:
    """With 20 % headroom of 32 GiB, 25.6 GiB are usable: 4 workers of 6 GiB + 64 MiB fit."""
    result = partition([src("video", cost=0.01, state=6 * GiB)], with_(samples_per_s=1600.0, memory_headroom=0.2))
    (group,) = result.groups
    assert (group.actors, group.workers_per_actor) == (4, 4)
    tight = partition([src("video", cost=0.01, state=6 * GiB)], with_(samples_per_s=1600.0, memory_headroom=0.3))
    assert (tight.groups[0].actors, tight.groups[0].workers_per_actor) == (6, 3)


def test_a_source_is_never_given_more_than_a_actors() -> None:
    """100 cores wanted, A = 2 and W = 8: capped at 16 workers, with a warning naming it."""
    result = partition([src("huge", cost=0.1)], with_(samples_per_s=1000.0, max_actors_per_source=2))
    (group,) = result.groups
    assert (group.actors, group.workers_per_actor, group.capped) == (2, 8, True)
    assert len(result.warnings) == 1 and "(huge)" in result.warnings[0] and "needs 100 workers but gets 16" in result.warnings[0]
    assert result.samples_per_s == pytest.approx(160.0)


def test_without_a_rate_the_costliest_source_is_not_clamped() -> None:
    """Relative sizing keeps demand ratios: the costliest source gets A x W, the rest in proportion."""
    result = partition([src("a", cost=1e-3), src("b", cost=1.0)], with_(max_actors_per_source=2))
    assert result.warnings == ()
    workers = {g.sources[0].name: g.workers for g in result.groups}
    assert workers == {"a": 1, "b": 16}


def test_a_source_of_weight_zero_joins_the_cheapest_level_with_one_worker() -> None:
    result = partition([src("used", cost=1e-3), src("unused", cost=1.0, weight=0.0)], POD)
    (group,) = result.groups
    assert [p.name for p in group.sources] == ["unused", "used"]
    assert (group.actors, group.workers_per_actor) == (1, 1)
    assert result.levels[0].sources == ("unused", "used")


def test_sources_are_not_grouped_when_sharing_would_cost_pods() -> None:
    """Each 10 GiB source alone: 3 workers fit a pod, 2 needed, 1 pod. Together: 20 GiB of state
    per worker, 1 fits, 4 needed: 4 pods instead of 2, so they stay apart."""
    big = [src("x", cost=0.01, state=10 * GiB), src("y", cost=0.01, state=10 * GiB)]
    apart = partition(big, with_(samples_per_s=400.0))
    assert [[p.name for p in g.sources] for g in apart.groups] == [["x"], ["y"]]
    small = [src("x", cost=0.01, state=GiB), src("y", cost=0.01, state=GiB)]
    together = partition(small, with_(samples_per_s=400.0))
    assert [[p.name for p in g.sources] for g in together.groups] == [["x", "y"]]


def test_one_source_per_group() -> None:
    result = partition([src("a"), src("b"), src("c")], with_(one_source_per_group=True))
    assert [[p.name for p in g.sources] for g in result.groups] == [["a"], ["b"], ["c"]]


def test_cost_levels_follow_gaps_in_cost_and_merge_near_equal_costs() -> None:
    decades = [src(f"s{i}", cost=10.0 ** -(6 - i)) for i in range(5)]
    assert len(partition(decades, with_(cost_levels=4)).levels) == 4
    assert len(partition(decades, with_(cost_levels=1)).levels) == 1
    close = [src(f"s{i}", cost=1e-3 * (1 + 0.2 * i)) for i in range(4)]
    assert len(partition(close, with_(cost_levels=4)).levels) == 1


def test_kmeans_cuts_at_the_gaps() -> None:
    assert part._kmeans_1d(np.array([0.0, 0.1, 5.0, 5.1, 10.0]), 3) == [0, 2, 4]
    assert part._kmeans_1d(np.array([1.0, 2.0, 3.0]), 1) == [0]


def test_a_source_whose_state_alone_exceeds_a_pod_is_an_error_naming_it() -> None:
    with pytest.raises(PartitionError) as info:
        partition([src("fine"), src("enormous", state=40 * GiB)], POD)
    message = str(info.value)
    assert "source 'enormous'" in message and str(40 * GiB) in message and str(32 * GiB) in message
    with pytest.raises(PartitionError, match="no source needs"):
        partition([src("fine")], with_(actor_base_bytes=33 * GiB))


@pytest.mark.parametrize(
    ("profiles", "kwargs", "field"),
    [
        ([], {}, "sources"),
        ([src("a"), src("a")], {}, "sources.a"),
        ([src("a")], {"weights": {"nope": 1.0}}, "weights.nope"),
        ([src("a")], {"weights": {"a": -1.0}}, "weights.a"),
        ([src("a", cost=math.nan)], {}, "sources.a.cost_s"),
    ],
)
def test_bad_input_names_the_field(profiles, kwargs, field) -> None:
    with pytest.raises(ConfigError) as info:
        partition(profiles, POD, **kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"pod_cpus": 0.5}, "pod_cpus"),
        ({"max_actors_per_source": 0}, "max_actors_per_source"),
        ({"max_workers_per_actor": 0}, "max_workers_per_actor"),
        ({"samples_per_s": 0.0}, "samples_per_s"),
        ({"memory_headroom": 1.0}, "memory_headroom"),
        ({"state_per": "pod"}, "state_per"),
        ({"pod_memory_bytes": 0}, "pod_memory_bytes"),
    ],
)
def test_bad_settings_name_the_field(changes, field) -> None:
    with pytest.raises(ConfigError) as info:
        with_(**changes)
    assert info.value.field == field


def test_workers_per_actor_never_exceed_the_pods_cores() -> None:
    s = PartitionSettings(pod_memory_bytes=32 * GiB, pod_cpus=parse_cpu("3500m"), max_workers_per_actor=16, samples_per_s=1000.0)
    assert s.workers_per_actor_limit == 3
    (group,) = partition([src("a", cost=0.01)], s).groups
    assert (group.actors, group.workers_per_actor) == (4, 3)


# ---- the 64-source fixture --------------------------------------------------------------------


def test_the_64_source_fixture_partitions_within_the_limits() -> None:
    profiles = profiles_64()
    assert len({p.name for p in profiles}) == 64
    result = partition(profiles, PartitionSettings(pod_memory_bytes=32 * GiB, pod_cpus=8))
    assert sorted(p.name for g in result.groups for p in g.sources) == sorted(p.name for p in profiles)
    assert all(g.memory_bytes <= 0.9 * 32 * GiB and 1 <= g.actors <= 8 and 1 <= g.workers_per_actor <= 8 for g in result.groups)
    assert len(result.levels) == 4 and result.warnings == ()
    kinds = {g.name: {p.name.split("-")[0] for p in g.sources} for g in result.groups}
    assert kinds[result.groups[-1].name] == {"video"}  # the costliest level is video only
    video = [g for g in result.groups if kinds[g.name] == {"video"}]
    assert min(g.workers for g in video) > max(g.workers for g in result.groups if kinds[g.name] & {"web", "math"})
    assert any(g.workers_per_actor < 8 and g.actors > 1 for g in video)  # memory was short: more actors
    assert partition(list(reversed(profiles)), PartitionSettings(pod_memory_bytes=32 * GiB, pod_cpus=8)) == result


# ---- formats ----------------------------------------------------------------------------------


def test_profiles_from_a_profile_document() -> None:
    document = {
        "job": "j",
        "mixture": {"weights": {"a": 2}, "schedule": {"kind": "static"}},
        "mesh": {"dp": 2, "cp": 1, "tp": 4, "pp": 1, "order": "tp-cp-dp-pp"},
        "batch": {"global_batch_size": 64, "microbatches": 2},
        "sources": [
            {
                "name": "a",
                "path": "data/a",
                "state_bytes": 10,
                "transform_s_per_sample": 0.002,
                "read_s_per_sample": 0.001,
                "weight": 2,
                "token_column": "ids",
                "transform": "m:f",
                "transform_args": {"k": 1},
                "columns": ["x"],
                "repeat": 3,
            },
            {"name": "b", "state_bytes": 0, "transform_s_per_sample": 0},
        ],
    }
    assert profiles_from_mapping(document) == ProfileSet(
        job="j",
        sources=(
            SourceProfile("a", "data/a", 10, pytest.approx(0.003), 2.0, "ids", "m:f", {"k": 1}, ("x",), 3),
            SourceProfile("b", "", 0, 0.0, 1.0),
        ),
        mixture={"weights": {"a": 2}, "schedule": {"kind": "static"}},
        mesh={"dp": 2, "cp": 1, "tp": 4, "pp": 1},
        batch={"global_batch_size": 64, "microbatches": 2},
    )
    assert profiles_from_mapping(fixture_document()).sources == tuple(profiles_64())


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ([], "(top level)"),
        ({"sources": []}, "sources"),
        ({"sources": [{"state_bytes": 1, "transform_s_per_sample": 0}]}, "sources[0].name"),
        ({"sources": [{"name": "a", "transform_s_per_sample": 0}]}, "sources[0].state_bytes"),
        ({"sources": [{"name": "a", "state_bytes": 1.5, "transform_s_per_sample": 0}]}, "sources[0].state_bytes"),
        ({"sources": [{"name": "a", "state_bytes": 1}]}, "sources[0].transform_s_per_sample"),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": -1}]}, "sources[0].transform_s_per_sample"),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": 0, "weight": "x"}]}, "sources[0].weight"),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": 0, "columns": "x"}]}, "sources[0].columns"),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": 0, "repeat": 0}]}, "sources[0].repeat"),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": 0, "repeat": "x"}]}, "sources[0].repeat"),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": 0, "repeat": True}]}, "sources[0].repeat"),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": 0, "repeat": 1.5}]}, "sources[0].repeat"),
        (
            {
                "sources": [
                    {"name": "a", "state_bytes": 1, "transform_s_per_sample": 0},
                    {"name": "b", "state_bytes": 1, "transform_s_per_sample": 0, "repeat": -2},
                ]
            },
            "sources[1].repeat",
        ),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": 0}], "mesh": {"dp": 0}}, "mesh"),
        ({"sources": [{"name": "a", "state_bytes": 1, "transform_s_per_sample": 0}], "batch": {"microbatches": 1}}, "batch"),
    ],
)
def test_bad_profile_documents_name_the_field(document, field) -> None:
    with pytest.raises(ConfigError) as info:
        profiles_from_mapping(document)
    assert info.value.field == field


def test_repeat_is_carried_but_does_not_change_the_sizing() -> None:
    """A source's weight sets its share of the samples, so upsampling it (more passes per
    epoch) leaves its demand, and so the groups, as they were."""
    plain = partition([src("a"), src("b", cost=4e-3)], POD)
    upsampled = partition([SourceProfile("a", "/data/a", MiB, 1e-3, repeat=3), src("b", cost=4e-3)], POD)
    shape = [(g.name, [s.name for s in g.sources], g.actors, g.workers_per_actor, g.memory_bytes) for g in plain.groups]
    assert [(g.name, [s.name for s in g.sources], g.actors, g.workers_per_actor, g.memory_bytes) for g in upsampled.groups] == shape
    assert upsampled.demand == plain.demand
    assert {s.name: s.repeat for g in upsampled.groups for s in g.sources} == {"a": 3, "b": 1}


def test_dataplane_and_values_documents() -> None:
    configured = SourceProfile("a", "/data/a", MiB, 1e-3, 2.0, "ids", "m:f", {"k": 1}, ("x", "y"), repeat=3)
    result = partition([src("b", weight=2.0), configured], POD)
    resources = {"requests": {"cpu": "2", "memory": "900Mi"}, "limits": {"cpu": "2", "memory": "32Gi"}}
    group = {"name": "level0-0", "minReplicas": 1, "maxReplicas": 8, "workersPerActor": 2, "resources": resources}
    # repeat shapes the job's plan: in both documents, and only where it is not 1 (b's is).
    a = {"name": "a", "path": "/data/a", "tokenColumn": "ids", "transform": "m:f", "repeat": 3, "costSecondsPerSample": 0.001}
    b = {"name": "b", "path": "/data/b", "costSecondsPerSample": 0.001}
    assert to_dataplane(result, name="My_Job.v2") == {
        "apiVersion": "batchplane.dev/v1alpha1",
        "kind": "DataPlane",
        "metadata": {"name": "my-job-v2"},
        "spec": {"sourceGroups": [{**group, "sources": [a, b]}], "mixture": {"weights": {"a": 2.0, "b": 2.0}}},
    }
    profiles = ProfileSet(
        "j",
        (),
        {"weights": {}, "schedule": {"kind": "static"}},
        {"dp": 2, "cp": 1, "tp": 1, "pp": 1},
        {"global_batch_size": 8, "microbatches": 2},
    )
    spec = to_dataplane(result, name="j", profiles=profiles)["spec"]
    assert spec["mixture"] == {"weights": {"a": 2.0, "b": 2.0}, "schedule": {"kind": "static"}}
    assert (spec["mesh"], spec["batch"]) == ({"dp": 2, "cp": 1, "tp": 1, "pp": 1}, {"globalBatchSize": 8, "microbatches": 2})
    a_job = {**a, "transformArgs": {"k": 1}, "columns": ["x", "y"]}
    a_job["costSecondsPerSample"] = a_job.pop("costSecondsPerSample")  # last, as written
    assert to_values(result) == {"sourceGroups": [{**group, "sources": [a_job, b]}]}
    assert list(to_values(result)["sourceGroups"][0]["sources"][0]) == list(a_job)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32Gi", 32 * GiB),
        ("512Mi", 512 * MiB),
        ("1G", 10**9),
        ("1.5Gi", 3 * GiB // 2),
        ("1e3", 1000),
        (1000, 1000),
        ("100k", 100_000),
        (" 2Ki ", 2048),
    ],
)
def test_parse_memory(text, expected) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["4Gx", "-1Gi", "Gi", "", "0", "1e3Gi", "1.2.3"])
def test_parse_memory_rejects(text) -> None:
    with pytest.raises(ConfigError) as info:
        parse_memory(text, field="--pod-memory")
    assert info.value.field == "--pod-memory"


def test_parse_memory_may_allow_zero() -> None:
    assert parse_memory("0", allow_zero=True) == 0


@pytest.mark.parametrize(("text", "expected"), [("8", 8.0), ("7500m", 7.5), ("2.5", 2.5), (4, 4.0)])
def test_parse_cpu(text, expected) -> None:
    assert parse_cpu(text) == expected


@pytest.mark.parametrize("text", ["8x", "0", "-2", "1e3", ""])
def test_parse_cpu_rejects(text) -> None:
    with pytest.raises(ConfigError):
        parse_cpu(text)


@pytest.mark.parametrize(
    ("nbytes", "at_most", "expected"),
    [(25 * GiB, None, "25Gi"), (900 * MiB, None, "900Mi"), (10**9, None, "954Mi"), (10**9, 10**9, "1000000000"), (10**9, GiB, "954Mi")],
)
def test_format_memory(nbytes, at_most, expected) -> None:
    assert format_memory(nbytes, at_most=at_most) == expected


def test_the_partitioner_is_pure() -> None:
    """No I/O and no service libraries: only these imports, and no open()."""
    tree = ast.parse(pathlib.Path(part.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "math", "re", "collections.abc", "typing", "numpy", "batchplane.core.errors"}
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"open", "print", "input", "exec", "eval"}


def test_describe_lists_every_group_and_the_sustained_rate() -> None:
    result = partition(profiles_64(), PartitionSettings(pod_memory_bytes=32 * GiB, pod_cpus=8, samples_per_s=8000.0))
    text = describe(result)
    for g in result.groups:
        assert re.search(rf"^  {re.escape(g.name)}\s+{g.level}\s+{len(g.sources)}\s+{g.actors}\s+{g.workers_per_actor}\s", text, re.M)
    assert f"sustains {result.samples_per_s:,.0f} mixed samples/s" in text
    assert result.samples_per_s >= 8000.0
