"""Failure-transparent substitution: a bad sample among those the mixture allocated to a window
(a row group that cannot be read, a failed transform, an empty or rejected token list) is
replaced by the next good sample of the same source after the window, so every step keeps its
number of samples and every source its share, and nothing is consumed twice.

The substitutes are taken in stream order right after the window's range: the i-th bad sample
of a source (in seq order) is replaced by the i-th good sample after the range, and bad samples
met on the way are consumed as bad too (they count against the step whose substitute was being
sought). A source's consumption thus stays one contiguous range per window, which the mixture's
cursors, the ledger's interval sets and a resume represent exactly; the window's grouping (token
budgets) or balancing (fixed batches) then places each substitute by its own length and cost.
The search is bounded (`MAX_SEARCH` samples past the window per source); a bad sample left
without a substitute (the bound, or the stream's end) leaves its step one sample short, as
policy "skip" does.

Pure: a function of the window's samples and the samples after it; `substitute` asks for the
latter through a callback (the plan book waits for the loaders' summaries there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from batchplane.core.config import BadSampleSettings
from batchplane.core.errors import FailedPrecondition
from batchplane.planner.plan import SampleTable
from batchplane.planner.mixture import Allocation
from batchplane.planner.window import Window

#: Samples past a window's range searched for substitutes, per source and window.
MAX_SEARCH = 256


@dataclasses.dataclass(frozen=True)
class Match:
    """The substitutes of one source's bad samples in a window.

    Attributes:
        pairs: (bad seq, substitute seq or -1 when none, window step of the bad one), in the
            bad samples' seq order.
        consumed: Samples after the window's range taken (substitutes and the bad samples met
            on the way): the source's cursor moves on by this many.
        homes: int64 [consumed]: the window step each of them counts against.
        done: True when every bad sample has a substitute or none can be found (the search
            bound, or the stream's end); False when more samples after the range are needed.
    """

    pairs: tuple[tuple[int, int, int], ...]
    consumed: int
    homes: np.ndarray
    done: bool
    #: The seq right after the window's range (where `consumed` starts).
    start: int = 0


def match(
    bad_seqs: np.ndarray,
    bad_homes: np.ndarray,
    after_lengths: np.ndarray,
    *,
    after_start: int,
    stream_end: int | None,
    max_search: int = MAX_SEARCH,
) -> Match:
    """Finds the substitutes of one source's bad samples among the samples after the window.

    Args:
        bad_seqs: int64 seqs of the source's bad samples in the window, ascending.
        bad_homes: int64 window step of each.
        after_lengths: Lengths of the samples from `after_start` on, as far as known (0: bad).
        after_start: The seq right after the window's range.
        stream_end: The seq where the source's stream ends; None: endless or not known yet.
        max_search: Most samples after the range searched.
    Returns:
        The match. With `done` False, call again with more of `after_lengths`; the result for
        a longer `after_lengths` never differs in what it had matched.
    """
    limit = max_search if stream_end is None else min(max_search, max(stream_end - after_start, 0))
    lengths = np.asarray(after_lengths)[:limit]
    pairs: list[tuple[int, int, int]] = []
    homes: list[int] = []
    waiting = list(zip(np.asarray(bad_seqs).tolist(), np.asarray(bad_homes).tolist()))
    j = 0
    while len(pairs) < len(waiting) and j < len(lengths):
        bad, home = waiting[len(pairs)]
        homes.append(home)
        if lengths[j] > 0:
            pairs.append((bad, after_start + j, home))
        j += 1
    searched_out = j >= limit
    done = len(pairs) == len(waiting) or searched_out
    if done and len(pairs) < len(waiting):
        pairs += [(bad, -1, home) for bad, home in waiting[len(pairs) :]]
    return Match(tuple(pairs), j, np.array(homes, np.int64), done, after_start)


@dataclasses.dataclass(frozen=True)
class Substituted:
    """A window with its bad samples substituted.

    Attributes:
        window: The window, its end moved past the samples taken after its range.
        table: Its samples, those taken after the range appended.
        home: int64 per sample of `table`: the window step it counts against.
        matches: Per source index with bad samples, its match.
    """

    window: Window
    table: SampleTable
    home: np.ndarray
    matches: dict[int, Match]


#: fetch(source, first seq, count) -> the samples of those seqs in seq order, or None when the
#: caller was interrupted while waiting for them.
Fetch = Callable[[int, int, int], "SampleTable | None"]


def substitute(
    window: Window, last: Allocation, table: SampleTable, home: np.ndarray, *, stream_ends: Sequence[int | None], fetch: Fetch
) -> Substituted | None:
    """Substitutes the bad samples of a window (see the module docstring).

    Args:
        window: The window; its end is the mixture's end of its range, or, for a window planned
            again (a resume), the recorded end past its substitutes, which `table` then holds.
        last: The mixture's allocation of the window's last step (where its range ends).
        table: The window's samples (its whole range).
        home: int64 per sample: the window step the mixture allocated it to.
        stream_ends: Per source, where its stream ends (None: endless).
        fetch: Gets samples after the range; called only when `table` does not hold them.
    Returns:
        The window, samples and steps with the substitutes; None when `fetch` was interrupted.
    """
    alloc_end = [start + count for start, count in zip(last.starts, last.counts)]
    cursors = list(window.end.cursors)
    matches: dict[int, Match] = {}
    extra = []
    for k in range(len(alloc_end)):
        bad_seqs, bad_homes = bad_of(table, home, k, alloc_end[k])
        if not len(bad_seqs):
            continue
        end = stream_ends[k]
        if cursors[k] > alloc_end[k]:  # planned again: the samples after the range are in the table
            mine = np.flatnonzero((table.source == k) & (table.seq >= alloc_end[k]))
            mine = mine[np.argsort(table.seq[mine], kind="stable")]
            m = match(bad_seqs, bad_homes, table.length[mine], after_start=alloc_end[k], stream_end=alloc_end[k] + len(mine))
            home = home.copy()
            home[mine[: m.consumed]] = m.homes
        else:
            room = MAX_SEARCH if end is None else min(MAX_SEARCH, end - alloc_end[k])
            for count in dict.fromkeys((min(4 * len(bad_seqs) + 16, room), room)):  # a little first, then the bound
                got = fetch(k, alloc_end[k], count)
                if got is None:
                    return None
                m = match(bad_seqs, bad_homes, got.length, after_start=alloc_end[k], stream_end=end)
                if m.done:
                    break
            extra.append(got.take(np.arange(m.consumed)))
            home = np.concatenate([home, m.homes])
            cursors[k] = alloc_end[k] + m.consumed
        matches[k] = m
    table = SampleTable.concat([table, *extra]) if extra else table
    moved = dataclasses.replace(window, end=dataclasses.replace(window.end, cursors=tuple(cursors)))
    return Substituted(moved, table, home, matches)


def check_policy(policy: BadSampleSettings, done: Substituted, names: Sequence[str]) -> None:
    """Refuses a window with more bad samples than policy "fail" tolerates.

    Raises:
        FailedPrecondition: names the setting, the window, the sources and their positions.
    """
    bad = int(np.count_nonzero(done.table.length <= 0))
    if policy.policy != "fail" or bad <= policy.max_per_window:
        return
    w = done.window
    where = "; ".join(f"{names[k]!r} positions {[b for b, _, _ in m.pairs][:10]}" for k, m in done.matches.items())
    raise FailedPrecondition(
        f"batch.bad_samples.policy is 'fail' and the planning window of steps {w.first}..{w.first + w.steps - 1} holds {bad} bad "
        f"samples, more than batch.bad_samples.max_per_window = {policy.max_per_window}: {where} (the loaders' logs name their "
        f"files and row groups)"
    )


def bad_of(table: SampleTable, home: np.ndarray, source: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The seqs (ascending) and window steps of `source`'s bad samples in a window's table
    below seq `end` (the mixture's end of the window's range)."""
    mine = np.flatnonzero((table.source == source) & (table.seq < end) & (table.length <= 0))
    order = mine[np.argsort(table.seq[mine], kind="stable")]
    return table.seq[order].astype(np.int64), home[order].astype(np.int64)


def entries(
    matches: Mapping[int, Match], table: SampleTable, reasons: Mapping[int, Mapping[int, str]], names: Sequence[str]
) -> dict[int, list[dict]]:
    """The ledger's record of the substitutions, by window step: for each bad sample its source,
    [row, epoch], the [row, epoch] of its substitute (None without one) and why it was bad; then
    the bad samples met after the window while seeking substitutes, marked "passed_over" (they
    are consumed as bad, and their step is not short for them).

    Args:
        matches: Per source index, its match.
        table: The window's samples, substitutes included.
        reasons: Per source index, per bad seq, the reason's name.
        names: Source names.
    """
    where = {(int(k), int(s)): (int(r), int(e)) for k, s, r, e in zip(table.source, table.seq, table.row, table.epoch)}
    out: dict[int, list[dict]] = {}
    subs = {k: {sub for _, sub, _ in m.pairs} for k, m in matches.items()}
    for k, m in sorted(matches.items()):
        for bad, sub, home in m.pairs:
            out.setdefault(home, []).append(
                {
                    "source": names[k],
                    "bad": list(where[(k, bad)]),
                    "by": list(where[(k, sub)]) if sub >= 0 else None,
                    "reason": reasons.get(k, {}).get(bad, "unknown"),
                }
            )
        for j, home in enumerate(m.homes.tolist()):
            seq = m.start + j
            if seq not in subs.get(k, ()):
                out.setdefault(home, []).append(
                    {
                        "source": names[k],
                        "bad": list(where[(k, seq)]),
                        "by": None,
                        "reason": reasons.get(k, {}).get(seq, "unknown"),
                        "passed_over": True,
                    }
                )
    return out
