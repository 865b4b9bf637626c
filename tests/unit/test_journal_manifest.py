"""The journal's manifest state (batchplane.journal.manifest): apply's rules, rebase, the visible
prefix, and the versioned JSON encoding with its refusals."""

from __future__ import annotations

import copy
import dataclasses
import json
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.journal import manifest
from batchplane.journal.manifest import (
    FORMAT,
    FORMAT_VERSION,
    CheckpointMismatch,
    Commit,
    CommittedStep,
    CommitRefused,
    Fenced,
    ManifestFormatError,
    ManifestState,
    Mark,
    ProducerState,
    Rebased,
    Refusal,
    Register,
    Retain,
    StepEntry,
    StepObject,
    Unmark,
    VersionRecord,
    apply,
    decode_next,
    decode_record,
    decode_state,
    encode_record,
    rebase,
    state_doc,
    state_text,
)

PRODUCERS = ("p0", "p1", "p2")


def entry(step: int, tag: str = "a") -> StepEntry:
    return StepEntry(step, (StepObject(f"tgb/{step}-{tag}", 10 + step, f"sha256:{step:04x}"),))


def registered(*producers: str) -> ManifestState:
    state = ManifestState()
    for p in producers:
        state = apply(state, Register(p))
    return state


# Random histories: each producer p commits a run of its own steps (step % 3 == index of p),
# sometimes registers again, and the watermark sometimes advances.
@st.composite
def histories(draw: st.DrawFn) -> tuple[ManifestState, list]:
    state = registered(*PRODUCERS)
    changes: list = [Register(p) for p in PRODUCERS]
    nxt = {p: i for i, p in enumerate(PRODUCERS)}
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["commit", "commit", "register", "retain"]))
        if kind == "register":
            change = Register(draw(st.sampled_from(PRODUCERS)))
        elif kind == "retain":
            top = state.visible_through + 1
            if top <= state.watermark:
                continue
            change = Retain(draw(st.integers(state.watermark + 1, top)))
        else:
            p = draw(st.sampled_from(PRODUCERS))
            n = draw(st.integers(1, 3))
            steps = [nxt[p] + 3 * i for i in range(n)]
            nxt[p] = steps[-1] + 3
            change = Commit(p, state.producer(p).epoch, tuple(entry(s) for s in steps))
        state = apply(state, change)
        changes.append(change)
    return state, changes


def visible_brute_force(state: ManifestState) -> int:
    s = state.watermark
    while state.is_committed(s):
        s += 1
    return s - 1


@settings(max_examples=60, deadline=None)
@given(histories())
def test_states_round_trip_through_their_encoding_and_the_visible_prefix_is_the_committed_prefix(history) -> None:
    state, changes = history
    assert state.visible_through == visible_brute_force(state)
    assert decode_state(json.loads(json.dumps(state_doc(state)))) == state
    record = VersionRecord(version=state.version, change=changes[-1], written_at_s=12.5, state=state)
    data = encode_record(record)
    assert decode_record(data, version=state.version) == record
    assert encode_record(decode_record(data)) == data  # deterministic
    # Replaying the changes one record at a time (as a reader does) gives the same state.
    replay = ManifestState()
    for i, change in enumerate(changes, start=1):
        rec = decode_record(encode_record(VersionRecord(i, change, 0.0)), version=i)
        replay = apply(replay, rec.change)
    assert replay == state


@settings(max_examples=60, deadline=None)
@given(histories(), st.sampled_from(PRODUCERS), st.lists(st.integers(0, 40), min_size=1, max_size=5, unique=True), st.booleans())
def test_rebase_keeps_exactly_the_uncommitted_steps_and_what_it_keeps_applies(history, p, steps, same_objects) -> None:
    state, _ = history
    me = state.producer(p)
    steps = sorted(steps)
    pending = Commit(p, me.epoch, tuple(entry(s, "a" if same_objects else "b") for s in steps))
    try:
        rebased = rebase(state, pending)
    except CommitRefused as exc:
        assert exc.reason is Refusal.NOT_ADVANCING
        assert all(s <= me.last_step and not state.is_committed(s) for s in exc.steps)
        return
    kept = [e.step for e in rebased.commit.steps] if rebased.commit else []
    assert sorted([*kept, *rebased.mine, *rebased.taken]) == steps
    assert all(not state.is_committed(s) for s in kept)
    assert all(state.step(s).entry == entry(s, "a" if same_objects else "b") and state.step(s).producer == p for s in rebased.mine)
    assert all(state.is_committed(s) for s in rebased.taken)
    if rebased.commit:
        after = apply(state, rebased.commit)
        assert after.producer(p).last_step == kept[-1]
        assert all(after.step(s).version == after.version for s in kept)


def test_a_newer_registration_fences_the_older_epoch_and_keeps_the_last_step() -> None:
    state = registered("p0")
    state = apply(state, Commit("p0", 1, (entry(0), entry(1))))
    state = apply(state, Register("p0"))
    assert state.producer("p0").epoch == 2 and state.producer("p0").last_step == 1
    with pytest.raises(Fenced) as info:
        apply(state, Commit("p0", 1, (entry(2),)))
    assert info.value.reason is Refusal.FENCED and info.value.current_epoch == 2
    with pytest.raises(Fenced):
        rebase(state, Commit("p0", 1, (entry(2),)))
    assert apply(state, Commit("p0", 2, (entry(2),))).producer("p0").last_step == 2


@pytest.mark.parametrize(
    ("commit", "reason"),
    [
        (Commit("p9", 1, (entry(5),)), Refusal.UNREGISTERED),
        (Commit("p0", 3, (entry(5),)), Refusal.EPOCH_AHEAD),
        (Commit("p0", 1, ()), Refusal.EMPTY),
        (Commit("p0", 1, (entry(6), entry(5))), Refusal.NOT_INCREASING),
        (Commit("p0", 1, (entry(5), entry(5))), Refusal.NOT_INCREASING),
        (Commit("p0", 1, (entry(1),)), Refusal.ALREADY_COMMITTED),  # p1 committed it
        (Commit("p0", 1, (entry(3),)), Refusal.NOT_ADVANCING),  # below p0's last step 4
        (Commit("p0", 1, (StepEntry(5, ()),)), Refusal.EMPTY),
    ],
)
def test_apply_refuses_commits_the_state_does_not_allow(commit: Commit, reason: Refusal) -> None:
    state = registered("p0", "p1")
    state = apply(state, Commit("p0", 1, (entry(0), entry(4))))
    state = apply(state, Commit("p1", 1, (entry(1),)))
    with pytest.raises(CommitRefused) as info:
        apply(state, commit)
    assert info.value.reason is reason


def test_steps_committed_out_of_order_show_only_the_contiguous_prefix_and_retain_drops_below_it() -> None:
    state = registered("p0", "p1")
    state = apply(state, Commit("p1", 1, (entry(1), entry(3))))
    assert state.visible_through == -1
    state = apply(state, Commit("p0", 1, (entry(0), entry(2))))
    assert state.visible_through == 3
    with pytest.raises(CommitRefused) as info:
        apply(state, Retain(5))
    assert info.value.reason is Refusal.WATERMARK_AHEAD
    state = apply(state, Retain(2))
    assert [s.step for s in state.steps] == [2, 3] and state.is_committed(0) and state.step(0) is None
    assert state.visible_through == 3
    with pytest.raises(CommitRefused) as info:
        apply(state, Retain(2))
    assert info.value.reason is Refusal.WATERMARK_NOT_ADVANCING
    # a step below the watermark counts as committed: a rebase drops it as taken
    assert rebase(state, Commit("p1", 1, (entry(0, "z"), entry(5)))).taken == (0,)


def test_active_producers_counts_recent_changes() -> None:
    state = registered("p0", "p1", "p2")
    for s in range(0, 30, 3):
        state = apply(state, Commit("p0", 1, (entry(s),)))
    assert state.active_producers(within_versions=100) == 3
    assert state.active_producers(within_versions=5) == 1


# --- encoding refusals -----------------------------------------------------------------------


def good_doc() -> dict:
    state = registered("p0")
    state = apply(state, Commit("p0", 1, (entry(0),)))
    return json.loads(encode_record(VersionRecord(2, Commit("p0", 1, (entry(0),)), 1.0, state)))


def _set(path: tuple, value):
    def mutate(doc: dict) -> None:
        target = doc
        for part in path[:-1]:
            target = target[part]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return mutate


_DELETE = object()


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_set(("format",), "lance"), "format"),
        (_set(("format_version",), FORMAT_VERSION + 1), "format_version"),
        (_set(("format_version",), "1"), "format_version"),
        (_set(("extra",), 1), "extra"),
        (_set(("version",), _DELETE), "version"),
        (_set(("version",), 3), "version"),  # the key says 2
        (_set(("version",), True), "version"),
        (_set(("written_at_s",), "now"), "written_at_s"),
        (_set(("change", "kind"), "merge"), "change.kind"),
        (_set(("change", "epoch"), 0), "change.epoch"),
        (_set(("change", "producer"), "bad id!"), "change.producer"),
        (_set(("change", "steps"), []), "change.steps"),
        (_set(("change", "steps", 0, "step"), -1), "change.steps[0].step"),
        (_set(("change", "steps", 0, "objects", 0, "size"), -5), "change.steps[0].objects[0].size"),
        (_set(("change", "steps", 0, "objects", 0, "checksum"), ""), "change.steps[0].objects[0].checksum"),
        (_set(("change", "steps", 0, "objects", 0, "colour"), "red"), "change.steps[0].objects[0].colour"),
        (_set(("change", "steps", 0, "objects"), []), "change.steps[0].objects"),
        (_set(("state", "version"), 7), "state.version"),
        (_set(("state", "producers", 0, "epoch"), 0), "state.producers[0].epoch"),
        (_set(("state", "watermark"), 5), "state.steps"),
        (_set(("state", "steps"), "none"), "state.steps"),
        (_set(("state", "steps", 0, "producer"), "bad id!"), "state.steps[0].producer"),
        (_set(("state", "steps", 0, "version"), 0), "state.steps[0].version"),
        (_set(("state", "steps", 0, "objects", 0, "key"), "k" * 1025), "state.steps[0].objects[0].key"),
        (_set(("change", "steps", 0, "step"), True), "change.steps[0].step"),
        (_set(("change", "steps", 0, "objects", 0, "size"), 1.0), "change.steps[0].objects[0].size"),
    ],
)
def test_decoding_refuses_unknown_or_invalid_content_naming_the_field(mutate, field: str) -> None:
    doc = good_doc()
    mutate(doc)
    with pytest.raises(ManifestFormatError) as info:
        decode_record(json.dumps(doc).encode(), version=2)
    assert info.value.field == field
    assert repr(field) in str(info.value) and "manifest version 2" in str(info.value)


#: Values at and beside each kind of field's rules: integers around 0 and 1 and what JSON holds
#: as numbers besides them; empty, valid, malformed and overlong strings; other types.
_ODD_INTEGERS = st.sampled_from([-1, 0, 1, 2, True, 1.0, None, "1"])
_ODD_TEXTS = st.sampled_from(["", "k", "p0", "bad id!", "x" * 1025, "c" * 257, 1, None, []])
_ODD_LISTS = st.sampled_from([[], [{}], [1], {}, "objects", None])


@st.composite
def near_steps(draw, *, committed: bool) -> dict:
    """A step as a Commit (or, `committed`, a checkpoint) lists it, with up to two of its fields
    or its object's replaced by an odd value, removed, or joined by an unknown field."""
    item: dict = {"step": 3, "objects": [{"key": "tgb/3", "size": 5, "checksum": "crc32:1"}]}
    fields = {("step",): _ODD_INTEGERS, ("objects",): _ODD_LISTS}
    fields.update({("objects", 0, "key"): _ODD_TEXTS, ("objects", 0, "size"): _ODD_INTEGERS, ("objects", 0, "checksum"): _ODD_TEXTS})
    if committed:
        item.update(producer="p0", version=2)
        fields.update({("producer",): _ODD_TEXTS, ("version",): _ODD_INTEGERS})
    for _ in range(draw(st.integers(0, 2))):
        path = draw(st.sampled_from(sorted(fields)))
        objects = item.get("objects")
        parent = item if len(path) == 1 else objects[0] if isinstance(objects, list) and objects else None
        if not isinstance(parent, dict):
            continue  # an earlier change took the object away
        how = draw(st.sampled_from(["replace", "replace", "replace", "remove", "add"]))
        if how == "add":
            parent["colour"] = "red"
        elif how == "remove":
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = draw(fields[path])
    return item


def _field_by_field(read):
    """What `read()` decodes with the quick paths off (None when it refuses)."""
    off = lambda _: None  # noqa: E731
    with mock.patch.object(manifest, "_well_formed_entry", off), mock.patch.object(manifest, "_well_formed_objects", off):
        with mock.patch.object(manifest, "_well_formed_committed", off):
            try:
                return read()
            except ManifestFormatError:
                return None


@settings(max_examples=500, deadline=None)
@given(near_steps(committed=False))
def test_the_quick_decoding_of_a_commit_step_agrees_with_the_field_by_field_reader(item: dict) -> None:
    change = {"kind": "commit", "producer": "p0", "epoch": 1, "steps": [item]}
    slow = _field_by_field(lambda: manifest._Reader("test").change(copy.deepcopy(change), "change").steps[0])
    assert manifest._well_formed_entry(item) == slow


@settings(max_examples=500, deadline=None)
@given(near_steps(committed=True))
def test_the_quick_decoding_of_a_checkpoint_step_agrees_with_the_field_by_field_reader(item: dict) -> None:
    doc = {"version": 2, "watermark": 0, "producers": [], "steps": [item]}
    slow = _field_by_field(lambda: manifest._Reader("test").state(copy.deepcopy(doc), "state").steps[0])
    assert manifest._well_formed_committed(item) == slow


def test_decoding_refuses_what_is_not_a_json_object() -> None:
    for data in (b"not json", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(ManifestFormatError):
            decode_record(data)


def test_the_encoding_is_the_documented_format() -> None:
    doc = good_doc()
    assert doc["format"] == FORMAT and doc["format_version"] == 1
    assert doc["change"] == {
        "kind": "commit",
        "producer": "p0",
        "epoch": 1,
        "steps": [{"step": 0, "objects": [{"key": "tgb/0-a", "size": 10, "checksum": "sha256:0000"}]}],
    }
    assert doc["state"]["producers"] == [{"id": "p0", "epoch": 1, "last_step": 0, "version": 2}]
    plain = copy.deepcopy(doc)
    plain["state"] = None
    assert decode_record(json.dumps(plain).encode()).state is None


def _sorted_reference(state: ManifestState, change: Commit) -> tuple:
    """The steps after a commit as the first version of `apply` built them: every step sorted."""
    version = state.version + 1
    added = [CommittedStep(e, change.producer, version) for e in change.steps]
    return tuple(sorted((*state.steps, *added), key=lambda s: s.step))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=6), min_size=1, max_size=12), st.integers(0, 5))
def test_incremental_apply_matches_a_full_sort(batches: list[list[int]], retain: int) -> None:
    state = apply(apply(ManifestState(), Register("a")), Register("b"))
    last = {"a": -1, "b": -1}
    for i, batch in enumerate(batches):
        producer = "ab"[i % 2]
        steps = sorted({s for s in batch if s > last[producer] and not state.is_committed(s)})
        if not steps:
            continue
        change = Commit(producer, 1, tuple(StepEntry(s, (StepObject(f"k{s}", 1, "c"),)) for s in steps))
        want = _sorted_reference(state, change)
        state = apply(state, change)
        last[producer] = steps[-1]
        assert state.steps == want
        prefix = state.watermark
        while prefix in {s.step for s in want}:
            prefix += 1
        assert state.visible_through == prefix - 1
        assert all(state.step(s.step) == s for s in want)
        assert state.step(61) is None and not state.is_committed(61)
    if 0 < retain <= state.visible_through + 1:
        kept = apply(state, Retain(retain))
        assert kept.steps == tuple(s for s in state.steps if s.step >= retain)
        assert kept.visible_through == state.visible_through


def test_decode_next_applies_a_change_and_compares_a_checkpoint() -> None:
    state = apply(ManifestState(), Register("a"))
    change = Commit("a", 1, (StepEntry(0, (StepObject("k0", 1, "c"),)),))
    new = apply(state, change)
    for checkpoint in (None, new):
        data = encode_record(VersionRecord(2, change, 0.0, state=checkpoint))
        record, got = decode_next(data, state)
        assert got == new and record.change == change and record.state is None
        # A checkpoint written with sorted top-level keys (state before version), or with
        # spaces, is parsed whole and compared as a document.
        doc = json.loads(data)
        for other in (json.dumps(doc, sort_keys=True, separators=(",", ":")), json.dumps(doc)):
            record, got = decode_next(other.encode("ascii"), state)
            assert got == new and record.change == change and record.state is None
    wrong = dataclasses.replace(new, watermark=0, steps=())
    with pytest.raises(CheckpointMismatch):
        decode_next(encode_record(VersionRecord(2, change, 0.0, state=wrong)), state)
    with pytest.raises(ManifestFormatError, match="not JSON"):  # a cut tail
        decode_next(encode_record(VersionRecord(2, change, 0.0, state=new))[:-1], state)
    with pytest.raises(ManifestFormatError, match="version"):
        decode_next(encode_record(VersionRecord(3, change, 0.0)), state)


# --- apply's and rebase's positions against the per-step rules ------------------------------


@st.composite
def listed_states(draw: st.DrawFn) -> ManifestState:
    """A state with a watermark and steps listed above it, by "a" and "b" (entries tagged "a")."""
    watermark = draw(st.integers(0, 20))
    numbers = sorted(draw(st.sets(st.integers(watermark, 60), max_size=30)))
    steps = tuple(CommittedStep(entry(s), draw(st.sampled_from("ab")), 1 + s % 4) for s in numbers)
    producers = tuple(ProducerState(p, 1, draw(st.integers(-1, 60)), 1) for p in "ab")
    return ManifestState(version=5, watermark=watermark, steps=steps, producers=producers)


pending_steps = st.lists(st.tuples(st.integers(0, 70), st.sampled_from("ab")), max_size=10)


def _refusal(fn, *args) -> tuple:
    try:
        return ("ok", fn(*args))
    except CommitRefused as exc:
        return (exc.reason, exc.steps)


def _apply_per_step(state: ManifestState, change: Commit) -> ManifestState:
    """A Commit applied by the rules one step at a time (`is_committed` per step, then a sort
    of every step): what apply computed before it shared one search between check and merge."""
    current = state.producer(change.producer)
    steps = [e.step for e in change.steps]
    if not steps:
        raise CommitRefused(Refusal.EMPTY, "", steps=())
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise CommitRefused(Refusal.NOT_INCREASING, "", steps=steps)
    done = [s for s in steps if state.is_committed(s)]
    if done:
        raise CommitRefused(Refusal.ALREADY_COMMITTED, "", steps=done)
    if steps[0] <= current.last_step:
        raise CommitRefused(Refusal.NOT_ADVANCING, "", steps=[s for s in steps if s <= current.last_step])
    for e in change.steps:
        if not e.objects:
            raise CommitRefused(Refusal.EMPTY, "", steps=[e.step])
    new = dataclasses.replace(current, last_step=steps[-1], version=state.version + 1)
    producers = tuple(sorted((*(p for p in state.producers if p.producer != change.producer), new), key=lambda p: p.producer))
    return dataclasses.replace(state, version=state.version + 1, steps=_sorted_reference(state, change), producers=producers)


def _rebase_per_step(state: ManifestState, commit: Commit) -> Rebased:
    """rebase by the rules one step at a time (`step` and `is_committed` per pending step)."""
    current = state.producer(commit.producer)
    keep, mine, taken = [], [], []
    for e in commit.steps:
        done = state.step(e.step)
        if done is not None and done.entry == e and done.producer == commit.producer:
            mine.append(e.step)
        elif state.is_committed(e.step):
            taken.append(e.step)
        else:
            keep.append(e)
    stuck = [e.step for e in keep if e.step <= current.last_step]
    if stuck:
        raise CommitRefused(Refusal.NOT_ADVANCING, "", steps=stuck)
    return Rebased(commit=dataclasses.replace(commit, steps=tuple(keep)) if keep else None, mine=tuple(mine), taken=tuple(taken))


@settings(max_examples=200, deadline=None)
@given(listed_states(), pending_steps, st.booleans(), st.booleans())
def test_apply_and_rebase_of_a_commit_equal_the_per_step_rules(
    state: ManifestState, pending, increasing: bool, empty_objects: bool
) -> None:
    """Any commit (in order or not, steps listed, below the watermark, past the last listed one)
    is refused or applied, and rebased, as the per-step rules say."""
    if increasing:
        pending = sorted({s: t for s, t in pending}.items())
    entries = [entry(s, tag) for s, tag in pending]
    if empty_objects and entries:
        entries[-1] = StepEntry(entries[-1].step, ())
    change = Commit("a", 1, tuple(entries))
    assert _refusal(apply, state, change) == _refusal(_apply_per_step, state, change)
    assert _refusal(rebase, state, change) == _refusal(_rebase_per_step, state, change)
    # the commit of the newest steps (every one past the last listed): the append path
    top = max([state.watermark - 1, *(c.step for c in state.steps), state.producer("a").last_step]) + 1
    newest = Commit("a", 1, tuple(entry(top + i) for i in range(len(entries))))
    assert _refusal(apply, state, newest) == _refusal(_apply_per_step, state, newest)
    assert _refusal(rebase, state, newest) == _refusal(_rebase_per_step, state, newest)


# --- the record's text against one json.dumps of the whole document ---------------------------


def _change_reference(change) -> dict:
    if isinstance(change, Commit):
        steps = [
            {"step": e.step, "objects": [{"key": o.key, "size": o.size, "checksum": o.checksum} for o in e.objects]} for e in change.steps
        ]
        return {"kind": "commit", "producer": change.producer, "epoch": change.epoch, "steps": steps}
    if isinstance(change, Register):
        return {"kind": "register", "producer": change.producer}
    if isinstance(change, Mark):
        return {"kind": "mark", "mark": change.mark, "manifest_version": change.manifest_version, "step": change.step}
    if isinstance(change, Unmark):
        return {"kind": "unmark", "mark": change.mark}
    return {"kind": "retain", "watermark": change.watermark}


step_objects = st.builds(StepObject, st.text(min_size=1, max_size=8), st.integers(0, 2**40), st.text(min_size=1, max_size=8))
changes = st.one_of(
    st.builds(
        Commit,
        st.sampled_from(PRODUCERS),
        st.integers(1, 9),
        st.lists(st.builds(StepEntry, st.integers(0, 10**9), st.tuples(step_objects)), max_size=4).map(tuple),
    ),
    st.builds(Register, st.sampled_from(PRODUCERS)),
    st.builds(Retain, st.integers(1, 100)),
    st.builds(Mark, st.sampled_from(PRODUCERS), st.integers(0, 100), st.integers(0, 100)),
    st.builds(Unmark, st.sampled_from(PRODUCERS)),
)


@settings(max_examples=100, deadline=None)
@given(changes, st.floats(0, 2e9), histories(), st.booleans())
def test_a_record_is_the_json_of_its_whole_document(change, written_at_s: float, history, checkpoint: bool) -> None:
    """The record joins cached step texts, yet its bytes are a compact ASCII dump of its whole
    document: every value with sorted keys, the top level sorted but for "state", last."""
    state = history[0]
    record = VersionRecord(version=state.version, change=change, written_at_s=written_at_s, state=state if checkpoint else None)
    doc = {
        "change": _change_reference(change),
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": record.version,
        "written_at_s": written_at_s,
        "state": state_doc(state) if checkpoint else None,
    }

    def dump(value) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)

    want = ("{" + ",".join(f"{dump(key)}:{dump(value)}" for key, value in doc.items()) + "}").encode("ascii")
    assert encode_record(record) == want
    assert encode_record(record) == want  # again, from the cached step texts
    assert state_text(state) == dump(state_doc(state))


_ANY_TEXT = st.one_of(st.text(max_size=12), st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=12))
_NUMBER = st.one_of(st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=False, allow_infinity=False))


@settings(max_examples=400, deadline=None)
@given(
    objects=st.lists(st.tuples(_ANY_TEXT, _NUMBER, _ANY_TEXT), max_size=3),
    step=_NUMBER,
    producer=_ANY_TEXT,
    version=_NUMBER,
)
def test_step_texts_are_what_the_encoder_writes(objects: list, step: object, producer: str, version: object) -> None:
    """A step's texts, formatted directly when its strings need no escaping and its numbers are
    ints, are byte for byte the encoder's: on any strings (quotes, backslashes, control and
    non-ASCII characters) and numbers (bools and floats fall back to the encoder)."""
    entry = StepEntry(step, tuple(StepObject(key, size, checksum) for key, size, checksum in objects))  # type: ignore[arg-type]
    committed = CommittedStep(entry, producer, version)  # type: ignore[arg-type]
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    objects_doc = [{"key": k, "size": n, "checksum": c} for k, n, c in objects]
    assert entry.encoded == encoder.encode({"step": step, "objects": objects_doc})
    assert committed.text == encoder.encode({"step": step, "producer": producer, "version": version, "objects": objects_doc})
