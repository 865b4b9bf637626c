"""Tests of batchplane.journal.retention: reclamation never deletes what a live watermark needs
(steps at or above the floor, the manifest versions from the floor's base to the latest, objects
a kept step lists, objects of steps not yet committed), respects the minimum age, and reclaims
what it may; producers pause at max_lag."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.errors import InvalidArgument
from batchplane.journal.retention import (
    StepInfo,
    VersionInfo,
    RetentionPolicy,
    ObjectInfo,
    Watermark,
    backpressure,
    reclaim,
)

_settings = settings(max_examples=150, deadline=None)


@st.composite
def _journal(draw):
    """A journal of n steps committed over manifest versions 0..latest, some compacted, some
    objects shared or orphaned, and live watermarks at versions/steps already committed."""
    n = draw(st.integers(0, 25))
    versions_of = sorted(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)))
    latest = max(versions_of, default=0) + draw(st.integers(0, 2))
    times = {v: 10.0 * v for v in range(latest + 1)}
    bases, base = [], 0
    for v in range(latest + 1):
        if draw(st.booleans()):
            base = v  # a compacted checkpoint
        bases.append(base)
    first_version = draw(st.integers(0, latest))  # older versions were reclaimed already
    versions = [VersionInfo(v, times[v], max(bases[v], first_version)) for v in range(first_version, latest + 1)]
    steps = []
    for s in range(n):
        objs = (f"tgb/{s}",) if s % 5 else (f"tgb/{s}", f"tgb/pack{s // 10}")  # some objects hold several steps
        steps.append(StepInfo(s, versions_of[s], times[versions_of[s]], objs))
    stored = [ObjectInfo(k, s.step, s.committed_at_s) for s in steps for k in s.objects if k.startswith("tgb/") and k[4:].isdigit()]
    extra = draw(st.lists(st.tuples(st.integers(0, n + 3), st.floats(0, 200)), max_size=6))
    stored += [ObjectInfo(f"orphan/{i}/{s}", s, t) for i, (s, t) in enumerate(extra)]
    marks = [Watermark(draw(st.integers(0, latest)), draw(st.integers(0, n))) for _ in range(draw(st.integers(0, 3)))]
    now = draw(st.floats(0, 300))
    policy = RetentionPolicy(min_age_s=draw(st.sampled_from([0.0, 15.0, 100.0])), max_lag=draw(st.integers(1, 10)))
    return steps, versions, stored, marks, now, policy


@_settings
@given(_journal())
def test_reclamation_never_deletes_what_a_live_watermark_needs(case) -> None:
    steps, versions, stored, marks, now, policy = case
    out = reclaim(watermarks=marks, steps=steps, versions=versions, stored=stored, now_s=now, policy=policy)
    gone_objects = set(out.objects)
    latest = max((v.version for v in versions), default=None)
    if not marks:
        assert out.steps == () and out.versions == () and out.floor_step is None
    for m in marks:
        # Every step the checkpoint will read, and every object they list, survive.
        for s in steps:
            if s.step >= m.step:
                assert s.step not in out.steps
                assert not gone_objects & set(s.objects)
        # Its manifest version, every later one, and every version they are read through survive.
        needed = {v.version for v in versions if v.version >= m.manifest_version}
        by_version = {v.version: v for v in versions}
        for v in list(needed):
            needed |= set(range(by_version[v].base, v + 1))
        assert not needed & set(out.versions)
    assert latest is None or latest not in out.versions
    # Nothing young goes; kept steps keep their objects; no object of an uncommitted step goes.
    committed = {s.step: s for s in steps}
    for s in out.steps:
        assert now - committed[s].committed_at_s >= policy.min_age_s
    for v in versions:
        if v.version in out.versions:
            assert now - v.written_at_s >= policy.min_age_s
    kept_objects = {k for s in steps if s.step not in out.steps for k in s.objects}
    assert not gone_objects & kept_objects
    for o in stored:
        if o.key in out.orphans:
            assert o.step in committed or (out.floor_step is not None and o.step < out.floor_step)
            assert now - o.written_at_s >= policy.min_age_s
    # Kept versions are a contiguous run that ends at the latest.
    kept = sorted(v.version for v in versions if v.version not in out.versions)
    assert kept == list(range(kept[0], kept[-1] + 1)) if kept else not versions


@_settings
@given(_journal())
def test_reclamation_reclaims_what_no_watermark_needs(case) -> None:
    steps, versions, stored, marks, now, policy = case
    out = reclaim(watermarks=marks, steps=steps, versions=versions, stored=stored, now_s=now, policy=policy)
    if not marks:
        return
    floor = min(m.step for m in marks)
    for s in steps:
        if s.step < floor and now - s.committed_at_s >= policy.min_age_s:
            assert s.step in out.steps
    assert out.floor_step == floor and out.floor_version == min(m.manifest_version for m in marks)


def test_reclaim_example() -> None:
    steps = [StepInfo(s, s // 2, float(s), (f"tgb/{s}",)) for s in range(10)]
    versions = [VersionInfo(v, float(2 * v), 0 if v < 3 else 3) for v in range(5)]
    stored = [
        ObjectInfo("tgb/x-old-epoch-4", 4, 0.0),  # step 4 was committed with other objects: orphan
        ObjectInfo("tgb/x-pending-12", 12, 0.0),  # step 12 not committed yet: kept
        ObjectInfo("tgb/x-fresh-5", 5, 99.0),  # too young
    ]
    marks = [Watermark(manifest_version=4, step=6), Watermark(manifest_version=3, step=7)]
    out = reclaim(watermarks=marks, steps=steps, versions=versions, stored=stored, now_s=100.0, policy=RetentionPolicy(min_age_s=5.0))
    assert out.floor_step == 6 and out.floor_version == 3
    assert out.steps == (0, 1, 2, 3, 4, 5)
    assert out.orphans == ("tgb/x-old-epoch-4",)
    assert out.objects == (*(f"tgb/{s}" for s in range(6)), "tgb/x-old-epoch-4")
    assert out.versions == (0, 1, 2)  # 3 is the base of 3 and 4 (the latest)
    # Version 3's base is 3; moving it to 0 keeps everything.
    versions[3] = VersionInfo(3, 6.0, 0)
    versions[4] = VersionInfo(4, 8.0, 0)
    out = reclaim(watermarks=marks, steps=steps, versions=versions, stored=stored, now_s=100.0, policy=RetentionPolicy(min_age_s=5.0))
    assert out.versions == ()
    # Age: with min_age_s=97, only steps committed at <= 3.0 may go.
    out = reclaim(watermarks=marks, steps=steps, versions=versions, now_s=100.0, policy=RetentionPolicy(min_age_s=97.0))
    assert out.steps == (0, 1, 2, 3) and out.orphans == ()


def test_a_shared_object_survives_while_a_kept_step_lists_it() -> None:
    steps = [StepInfo(0, 0, 0.0, ("pack/0",)), StepInfo(1, 0, 0.0, ("pack/0",)), StepInfo(2, 1, 0.0, ("tgb/2",))]
    versions = [VersionInfo(0, 0.0, 0), VersionInfo(1, 0.0, 1)]
    out = reclaim(watermarks=[Watermark(1, 1)], steps=steps, versions=versions, now_s=10.0, policy=RetentionPolicy(min_age_s=0.0))
    assert out.steps == (0,) and out.objects == ()
    out = reclaim(watermarks=[Watermark(1, 2)], steps=steps, versions=versions, now_s=10.0, policy=RetentionPolicy(min_age_s=0.0))
    assert out.steps == (0, 1) and out.objects == ("pack/0",) and out.versions == (0,)


@pytest.mark.parametrize(
    ("marks", "next_step", "max_lag", "floor", "lag", "pause"),
    [
        ([], 0, 4, 0, 0, False),
        ([], 3, 4, 0, 3, False),
        ([], 4, 4, 0, 4, True),
        ([Watermark(0, 10), Watermark(0, 8)], 11, 4, 8, 3, False),
        ([Watermark(0, 10), Watermark(0, 8)], 12, 4, 8, 4, True),
        ([Watermark(0, 20)], 12, 4, 20, -8, False),
    ],
)
def test_backpressure(marks, next_step, max_lag, floor, lag, pause) -> None:
    out = backpressure(watermarks=marks, next_step=next_step, policy=RetentionPolicy(max_lag=max_lag))
    assert (out.floor_step, out.lag, out.pause) == (floor, lag, pause)


def test_backpressure_without_watermarks_counts_from_the_origin() -> None:
    out = backpressure(watermarks=[], next_step=105, policy=RetentionPolicy(max_lag=5), origin_step=100)
    assert (out.floor_step, out.pause) == (100, True)


def test_bad_inputs_are_refused_naming_the_field() -> None:
    policy = RetentionPolicy()
    with pytest.raises(InvalidArgument, match="retention.max_lag"):
        RetentionPolicy(max_lag=0)
    with pytest.raises(InvalidArgument, match="retention.min_age_s"):
        RetentionPolicy(min_age_s=-1.0)
    with pytest.raises(InvalidArgument, match="now_s"):
        reclaim(watermarks=[], steps=[], versions=[], now_s=float("nan"), policy=policy)
    with pytest.raises(InvalidArgument, match=r"watermarks\[0\].step"):
        reclaim(watermarks=[Watermark(0, -1)], steps=[], versions=[], now_s=0.0, policy=policy)
    with pytest.raises(InvalidArgument, match="steps: listed twice"):
        reclaim(watermarks=[], steps=[StepInfo(1, 0, 0.0, ()), StepInfo(1, 0, 0.0, ())], versions=[], now_s=0.0, policy=policy)
    with pytest.raises(InvalidArgument, match=r"versions\[2\].base"):
        reclaim(watermarks=[], steps=[], versions=[VersionInfo(2, 0.0, 3)], now_s=0.0, policy=policy)
    with pytest.raises(InvalidArgument, match="next_step"):
        backpressure(watermarks=[], next_step=-1, policy=policy)
