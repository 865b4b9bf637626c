"""The buffered-window rules of a loader's stream (`batchplane.loader.windows.WindowBook`), driven
without threads or files: a window is freed exactly when the module's rules say, the buffer
passes its budget only for windows somebody waits for, new routes drop other replicas' windows
and they are never read, a restore reads what constructors may still fetch, releases never go
negative. The restart and reroute cases of tests/integration/test_loader_recovery.py,
test_loader_replicas.py and test_shadow_loaders.py are unit cases here (each names its test)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.errors import NotFound
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Routing, WindowSpan, window_of, window_span
from batchplane.loader.bounds import NotPlanned
from batchplane.loader.windows import HeldWindow, Progress, WindowBook

ROWS, GROUP = 120, 10  # windows of one row group: 12 windows an epoch (as test_loader_recovery.py)
BYTES_PER_SAMPLE = 100


class Read:
    """What the driver reads for a window (its rows, here only its span)."""

    def __init__(self, span: WindowSpan) -> None:
        self.span = span


def make(*, replica: str = "0", read_ahead: int = 20, epochs: int | None = 1, window_row_groups: int = 1) -> WindowBook[Read]:
    order = SampleOrder([GROUP] * (ROWS // GROUP), seed=1, source_name="a", window_row_groups=window_row_groups, shuffle=True)
    return WindowBook(order, replica=replica, end_seq=None if epochs is None else epochs * ROWS, read_ahead_samples=read_ahead)


def store(book: WindowBook[Read], span: WindowSpan, *, good: int | None = None) -> HeldWindow[Read] | None:
    """Window `span` read, `good` of its samples good (default: all)."""
    size = span.end - span.start
    return book.stored(span, Read(span), nbytes=size * BYTES_PER_SAMPLE, unreleased=size if good is None else good).kept


def read_all(book: WindowBook[Read], *, over_budget: bool = False) -> list[int]:
    """Runs the reader until it has nothing to read; returns the windows it read."""
    read = []
    while (span := book.next_read(over_budget=over_budget)) is not None:
        read.append(span.number)
        store(book, span)
    return read


def ask(book: WindowBook[Read], start: int, end: int, routes: Routing | None = None, **progress: int) -> None:
    """Summaries of positions [start, end), pulled as the planner does, the reader reading what
    it waits for; `progress`: planned_seq, planned_steps, delivered_below."""
    progress.setdefault("planned_seq", start)
    while start < end:
        book.summary_asked(start, routes=routes, progress=Progress(**progress))
        read_all(book)
        _, start = book.summarize(start, end - start)


def held(book: WindowBook[Read]) -> list[int]:
    return [w.seq_start for w in book]


def numbers(book: WindowBook[Read]) -> list[int]:
    return [w.span.number for w in book]


def fetch(book: WindowBook[Read], seqs: list[int]) -> list[Read]:
    """The windows a fetch of `seqs` takes from (reading into the buffer what it misses)."""
    positions = np.array(seqs, np.int64)
    book.check_fetch(positions, source="a")
    while not (mask := book.held(positions)).all():
        reads = book.plan_fetch(positions[~mask], used=0, limit=1 << 30)
        assert reads.waits, "under budget a fetch waits for the reader"
        assert read_all(book, over_budget=True), "the reader reads what the fetch waits for"
    return [data for data, _, _ in book.located(positions, mask)]


def free_by_rule(book: WindowBook[Read], w: HeldWindow[Read]) -> bool:
    """The module's freeing rule."""
    return w.last_step is not None and w.seq_end <= book.planned_seq and (w.unreleased == 0 or w.last_step < book.delivered_below)


# ---- the cases integration tests found ------------------------------------------------------


def test_windows_wait_for_the_steps_that_planned_from_them() -> None:
    """test_loader_recovery.py::test_windows_wait_for_the_steps_that_planned_from_them."""
    book = make()
    ask(book, 0, 30)
    ask(book, 30, 40, planned_seq=30, planned_steps=3, delivered_below=2)
    assert {0, 10, 20} <= set(held(book)), "step 2 planned from them and not every rank was handed it"
    ask(book, 40, 50, planned_seq=30, planned_steps=3, delivered_below=3)
    assert not {0, 10, 20} & set(held(book))


def test_a_window_dropped_is_read_again_for_a_fetch_and_kept_as_seen() -> None:
    """test_loader_recovery.py::test_a_window_dropped_is_read_again_with_the_same_samples."""
    book = make()
    ask(book, 0, 40)
    ask(book, 40, 50, planned_seq=40, planned_steps=4, delivered_below=4)
    assert not {0, 10} & set(held(book))
    got = fetch(book, [3, 14])
    assert sorted(r.span.start for r in got) == [0, 10]
    assert all(w.summarized for w in book if w.seq_start in (0, 10)), "read for somebody waiting: kept whatever the routes say"


def test_a_restarted_replica_reads_at_once_what_constructors_may_still_fetch() -> None:
    """test_loader_recovery.py::test_a_restarted_replica_reads_at_once_what_constructors_may_still_fetch."""
    book = make()
    replay, removed = book.restore(20, through_seq=60, routes=None, progress=Progress(50, 5, 2))
    assert replay == 40 and removed == []
    assert read_all(book, over_budget=True) == [2, 3, 4, 5], "read whatever the budget"
    assert [r.span.start for r in fetch(book, list(range(20, 50)))] == [20, 30, 40]
    with pytest.raises(NotFound, match="past the end of the stream"):
        book.check_fetch(np.array([ROWS], np.int64), source="a")


def test_a_replica_reads_again_only_its_own_windows() -> None:
    """test_loader_recovery.py::test_a_replica_reads_again_only_its_own_windows."""
    book = make(replica="r1", read_ahead=0)
    routes = Routing.of(["r0", "r1"])  # r1 owns the odd windows
    replay, _ = book.restore(0, through_seq=60, routes=routes, progress=Progress(60, 6, 0))
    assert replay == 30
    read_all(book)
    fetch(book, [10, 30, 50])
    assert held(book) == [10, 30, 50]


def test_a_joining_replica_takes_the_unasked_windows_and_the_original_drops_its_read_ahead() -> None:
    """test_loader_replicas.py::test_a_replica_joins_and_the_original_leaves_mid_epoch_and_nothing_is_lost:
    the join switches the routes from the first window nobody was asked about; the original
    drops what it read ahead there that is now the joiner's, reads only its own windows from
    then on, and once it has served them it is drained (it may leave)."""
    original, joiner = make(replica="r0", read_ahead=40), make(replica="r1", read_ahead=40)
    ask(original, 0, 20, routes=Routing.of(["r0"]))
    assert numbers(original) == [0, 1, 2, 3], "read ahead 40 samples past the cursor at 0"
    routes = Routing.of(["r0"]).switch(2, ["r0", "r1"])  # r1 gets windows 3, 5, 7, ...
    ask(original, 20, 30, routes=routes, planned_seq=20, planned_steps=2)
    assert numbers(original) == [0, 1, 2, 4], "window 3 dropped (never summarized), 4 read instead"
    assert read_all(original) == []
    ask(joiner, 30, 40, routes=routes, planned_seq=20, planned_steps=2)
    assert numbers(joiner) == [3, 5], "the joiner reads its own windows only"
    # The original leaves: it serves the windows it owns below the frontier, then is drained.
    assert not original.drained(40), "windows 0 to 2 are held, seen, but not released"
    for w in list(original):
        original.release(w.data, w.unreleased)
    assert original.drained(40), "every window it owns below 40 was read, seen and released"
    assert numbers(original) == [2, 4], "window 2 waits until every position in it is planned"
    ask(original, 40, 50, routes=routes, planned_seq=40, planned_steps=4)
    assert numbers(original) == [4, 6], "window 2 freed; window 6, its own, read ahead"


def test_a_sibling_adopts_a_killed_replicas_windows_and_reads_them_again_for_fetches() -> None:
    """test_loader_replicas.py::test_a_replica_killed_without_a_shadow_is_adopted_by_its_sibling:
    the planner routes every window from its frontier to the survivor; a fetch of the dead
    replica's earlier windows reads them again and keeps them whatever the routes say."""
    survivor = make(replica="r0", read_ahead=0)
    two = Routing.of(["r0", "r1"])
    ask(survivor, 0, 10, routes=two)
    ask(survivor, 20, 30, routes=two, planned_seq=20, planned_steps=2)
    adopted = two.switch(4, ["r0"])
    ask(survivor, 40, 50, routes=adopted, planned_seq=40, planned_steps=4)
    ask(survivor, 50, 60, routes=adopted, planned_seq=40, planned_steps=4)
    assert 5 in numbers(survivor), "window 5, r1's before, is the survivor's now"
    # Window 1 and 3 were r1's: fetches of samples planned from them are within the frontier.
    got = fetch(survivor, [12, 35])
    assert sorted(r.span.number for r in got) == [1, 3]
    assert {1, 3} <= set(numbers(survivor))
    assert read_all(survivor) == [], "nothing else is read"


def test_a_shadow_holds_what_its_replica_holds() -> None:
    """test_shadow_loaders.py::test_a_killed_loader_is_replaced_by_its_shadow_and_nothing_changes_for_the_trainers:
    a shadow takes the same progress from follows and reads the same windows, so once promoted
    it serves fetches without reading anything again."""
    replica, shadow = make(read_ahead=20), make(read_ahead=20)
    for start, planned, steps, delivered in ((0, 0, 0, 0), (10, 10, 1, 0), (20, 20, 2, 1), (40, 30, 3, 2)):
        progress = Progress(planned, steps, delivered)
        replica.summary_asked(start, routes=None, progress=progress)
        read_all(replica)
        pieces, _ = replica.summarize(start, 10)
        shadow.followed(start, count=sum(hi - lo for _, lo, hi in pieces), routes=None, progress=progress)
        read_all(shadow)
        _, seq = shadow.summarize(start, 10)  # what the promoted shadow answers
        assert held(shadow) == held(replica)
    before = held(shadow)
    fetch(shadow, [20, 25, 35])
    assert held(shadow) == before, "nothing read again"


# ---- properties ------------------------------------------------------------------------------

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("summary"), st.integers(1, 30)),
        st.tuples(st.just("plan"), st.integers(0, 25)),
        st.tuples(st.just("deliver"), st.integers(1, 2)),
        st.tuples(st.just("read"), st.booleans()),
        st.tuples(st.just("fetch"), st.integers(0, 10**6)),
        st.tuples(st.just("release"), st.integers(0, 10**6), st.integers(0, 12)),
        st.tuples(st.just("reroute"), st.sampled_from([("0",), ("0", "1"), ("1", "0", "2"), ("1",)])),
    ),
    max_size=60,
)


class Planner:
    """A planner and its constructors as the stream sees them, feeding a book events and
    checking its rules after each."""

    def __init__(self, book: WindowBook[Read], *, limit: int) -> None:
        self.book = book
        self.limit = limit
        self.known = 0  # positions summarized
        self.progress = Progress()
        self.routes = Routing.of(["0"])
        self.asked: set[int] = set()  # windows somebody asked the reader for

    @property
    def used(self) -> int:
        return sum(w.nbytes for w in self.book)

    def ask(self) -> list[HeldWindow[Read]]:
        """A summary request from the planner's position."""
        if not self.book.is_end(self.known) and not self.book.holds(self.known):
            self.asked.add(window_of(self.book.order, self.known).number)
        return self.book.summary_asked(self.known, routes=self.routes, progress=self.progress)

    def apply(self, event: tuple) -> list[HeldWindow[Read]]:
        book, kind = self.book, event[0]
        if kind == "summary":
            removed = self.ask()
            _, self.known = book.summarize(self.known, event[1])
            return removed
        if kind == "plan":
            planned = min(self.known, self.progress.planned_seq + event[1])
            self.progress = Progress(planned, self.progress.planned_steps + 1, self.progress.delivered_below)
            return self.ask()
        if kind == "deliver":
            delivered = min(self.progress.planned_steps, self.progress.delivered_below + event[1])
            self.progress = Progress(self.progress.planned_seq, self.progress.planned_steps, delivered)
            return self.ask()
        if kind == "read":
            over = self.used >= self.limit
            span = book.next_read(over_budget=over)
            if span is None:
                return []
            if over:
                assert span.number in self.asked, "over budget the reader reads only windows somebody waits for"
            if span.number not in self.asked:
                assert book.owns(span.number), "a window of another replica is read only for somebody waiting"
                assert span.start < book.planned_seq + book.read_ahead_samples, "read ahead only so far"
            good = (span.end - span.start) // 2 if event[1] else None
            stored = book.stored(
                span,
                Read(span),
                nbytes=(span.end - span.start) * BYTES_PER_SAMPLE,
                unreleased=(span.end - span.start) if good is None else good,
            )
            if stored.kept is not None and not stored.kept.summarized:
                assert book.owns(span.number)
            return stored.removed
        if kind == "fetch":
            if self.progress.planned_seq == 0:
                return []
            seq = event[1] % self.progress.planned_seq
            positions = np.array([seq], np.int64)
            book.check_fetch(positions, source="a")  # planned: within the frontier
            if not book.holds(seq):
                reads = book.plan_fetch(positions, used=self.used, limit=self.limit)
                if reads.want is not None:
                    self.asked.add(reads.want)
            return []
        if kind == "release":
            windows = list(book)
            if not windows:
                return []
            w = windows[event[1] % len(windows)]
            before = w.unreleased
            removed = book.release(w.data, event[2])
            assert w.unreleased == max(0, before - event[2])
            return removed
        self.routes = self.routes.switch(window_of(book.order, self.known).number, event[1])
        return []  # taken with the next summary request

    def check(self, removed: list[HeldWindow[Read]]) -> None:
        book = self.book
        for w in removed:
            dropped = not w.summarized and not book.owns(w.span.number)
            assert free_by_rule(book, w) or dropped, f"window {w.span.number} removed against the rules"
            assert w not in list(book)
        for w in book:
            assert not free_by_rule(book, w), f"window {w.span.number} should have been freed"
            assert w.unreleased >= 0
            assert w.summarized or book.owns(w.span.number), "another replica's window read ahead is dropped"
        starts = held(book)
        assert starts == sorted(set(starts)), "held once each, in stream order"


@settings(max_examples=300, deadline=None)
@given(events=EVENTS, limit=st.integers(0, 6000), read_ahead=st.integers(0, 40), epochs=st.sampled_from([1, 2, None]))
def test_the_rules_hold_whatever_happens(events, limit, read_ahead, epochs) -> None:
    book = make(read_ahead=read_ahead, epochs=epochs)
    planner = Planner(book, limit=limit)
    for event in events:
        planner.check(planner.apply(event))


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(0, 6000), read_ahead=st.integers(0, 120), cursor=st.integers(0, ROWS))
def test_reading_ahead_passes_the_budget_by_one_window_at_most(limit, read_ahead, cursor) -> None:
    book = make(read_ahead=read_ahead)
    book.summary_asked(cursor, routes=None, progress=Progress(cursor, 1, 0))
    while (span := book.next_read(over_budget=sum(w.nbytes for w in book) >= limit)) is not None:
        store(book, span)
        used = sum(w.nbytes for w in book)
        waited = span.start <= cursor < span.end
        assert waited or used < limit + (span.end - span.start) * BYTES_PER_SAMPLE
    if cursor < ROWS:
        assert book.holds(cursor), "the window the planner waits on is read whatever the budget"


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.lists(st.sampled_from("abcd"), min_size=1, max_size=4, unique=True),
    me=st.sampled_from("abcd"),
    switch_at=st.integers(0, 11),
    cursor=st.integers(0, ROWS - 1),
)
def test_new_routes_drop_other_replicas_windows_and_they_are_never_read(replicas, me, switch_at, cursor) -> None:
    book = make(replica=me, read_ahead=ROWS)
    before = Routing.of([me])
    book.summary_asked(cursor, routes=before, progress=Progress(cursor, 1, 0))
    read_all(book)
    held_before = numbers(book)
    seen = {w.span.number for w in book if w.summarized}
    assert seen == {window_of(book.order, cursor).number}, "the window the planner waited on"
    routes = before.switch(switch_at, replicas)
    removed = book.summary_asked(cursor, routes=routes, progress=Progress(cursor, 1, 0))
    assert sorted(w.span.number for w in removed) == [n for n in held_before if n not in seen and routes.owner(n) != me]
    read = read_all(book)
    assert all(routes.owner(n) == me for n in read), "another replica's window is never read"
    assert all(routes.owner(n) == me or n in seen for n in numbers(book))


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True),
    me=st.sampled_from("abc"),
    start=st.integers(0, 2 * ROWS - 1),
    length=st.integers(0, 2 * ROWS),
)
def test_a_restore_reads_this_replicas_windows_constructors_may_still_fetch(replicas, me, start, length) -> None:
    book = make(replica=me, epochs=2)
    routes = Routing.of(replicas)
    through = start + length
    replay, _ = book.restore(start, through_seq=through, routes=routes, progress=Progress(start, 3, 1))
    read = read_all(book, over_budget=True)  # nothing read ahead: only the replay
    expected = []
    span = window_of(book.order, start)
    while span.start < min(through, 2 * ROWS):
        if routes.owner(span.number) == me:
            expected.append(span.number)
        span = window_span(book.order, span.number + 1) if span.end < 2 * ROWS else WindowSpan(-1, 2 * ROWS, 2 * ROWS)
    assert read == expected
    assert replay == sum(window_span(book.order, n).end - window_span(book.order, n).start for n in expected)
    if expected:  # what the planner asked about is within the frontier
        book.check_fetch(np.array([window_span(book.order, expected[-1]).start], np.int64), source="a")


@settings(max_examples=200, deadline=None)
@given(good=st.integers(0, GROUP), releases=st.lists(st.integers(0, GROUP), max_size=6), planned=st.booleans())
def test_releases_never_go_negative_and_a_stale_one_is_ignored(good, releases, planned) -> None:
    book = make(read_ahead=0)
    progress = Progress(10 if planned else 0, 1, 0)
    book.summary_asked(0, routes=None, progress=progress)
    span = book.next_read(over_budget=True)
    assert span is not None and span.number == 0
    first = store(book, span, good=good)
    assert first is not None and first.last_step is None, "waited for: fully planned at the next summary request"
    removed = book.summary_asked(0, routes=None, progress=progress)
    assert (first in removed) == (planned and good == 0)
    left = good
    for n in releases:
        if first not in list(book):
            break
        removed = book.release(first.data, n)
        left = max(0, left - n)
        assert first.unreleased == left
        assert (first in removed) == (planned and left == 0), "freed once fully planned and released"
    if first in list(book):
        return
    assert book.release(first.data, 1) == [] and first.unreleased == 0, "a release of a freed window is ignored"
    fetch(book, [0])  # read again
    again = next(w for w in book if w.span.number == 0)
    assert again is not first
    book.release(first.data, GROUP)
    assert again.unreleased == GROUP, "a release of the earlier read does not count for the new one"


def test_a_fetch_past_the_frontier_is_refused_before_anything_is_read() -> None:
    book = make(replica="r0", read_ahead=0)
    book.summary_asked(0, routes=Routing.of(["r0", "r1"]), progress=Progress())
    with pytest.raises(NotPlanned):
        book.check_fetch(np.array([25], np.int64), source="a")  # window 2: r0's, never asked about
    assert read_all(book) == [0]


def test_a_summary_that_runs_over_several_windows_lets_fetches_reach_all_it_returned() -> None:
    """test_hostile_loader (a fetch of positions never asked about): a summary asked from one
    window returned the next ones too (already read ahead), and a fetch of a position it returned
    was refused as never asked about."""
    book = make(read_ahead=40)
    book.summary_asked(0, routes=None, progress=Progress(0))
    read_all(book)
    _, end = book.summarize(0, 30)
    assert end == 30, "the read-ahead held three windows"
    book.check_fetch(np.array([29], np.int64), source="a")
    with pytest.raises(NotPlanned, match="positions \\[30\\] lie at or past 30"):
        book.check_fetch(np.array([30], np.int64), source="a")
