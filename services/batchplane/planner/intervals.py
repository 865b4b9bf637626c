"""Compact sets of non-negative integers, such as the sequence numbers consumed of a source.
Pure: no I/O.

An `IntervalSet` holds its integers as half-open ranges [lo, hi), sorted, disjoint and
non-adjacent (touching ranges are merged), and is immutable: every operation returns a new set.
Consumption mostly grows a contiguous cursor, so growing a set at its end costs O(1) amortized
(see `IntervalSet.add`); membership is a binary search; union, difference and intersection are
linear merges.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections.abc import Iterable, Iterator
from typing import Any

Range = tuple[int, int]

_lo_of = operator.itemgetter(0)


class IntervalSet:
    """An immutable set of non-negative integers, held as normalized half-open ranges.

    Args:
        ranges: (lo, hi) pairs, each meaning the integers lo <= x < hi, in any order; they may
            overlap or touch, and empty pairs (lo == hi) add nothing.

    Raises:
        ValueError: A pair is not two integers, has a negative bound, or has lo > hi; the
            message names the pair.
    """

    # The set's ranges are _head[:_n] followed by _last (None when the set is empty); _count is
    # the number of integers. _head is append-only and shared with the sets this one was made
    # from and makes: a set reads only its first _n entries and appends in place only when
    # nobody has appended there yet, so growing at the end copies nothing.
    __slots__ = ("_head", "_n", "_last", "_count", "_hash")

    def __init__(self, ranges: Iterable[Range] = ()) -> None:
        self._set(_normalized(sorted(_checked(pair) for pair in ranges)))

    @classmethod
    def empty(cls) -> IntervalSet:
        """Returns the empty set."""
        return cls()

    @classmethod
    def from_list(cls, data: Any) -> IntervalSet:
        """Reads the JSON form written by `to_list`.

        Args:
            data: A list of [lo, hi] pairs, in any order (normalized like the constructor's).

        Returns:
            The set.

        Raises:
            ValueError: `data` is not a list, or an entry is not a valid [lo, hi] pair; the
                message names the entry and its index.
        """
        if not isinstance(data, (list, tuple)):
            raise ValueError(f"an interval set must be a list of [lo, hi] pairs, got {type(data).__name__}")
        pairs = []
        for i, entry in enumerate(data):
            if not isinstance(entry, (list, tuple)):
                raise ValueError(f"interval set entry {i}: expected a [lo, hi] pair, got {entry!r}")
            try:
                pairs.append(_checked(entry))
            except ValueError as e:
                raise ValueError(f"interval set entry {i}: {e}") from None
        return _from_normalized(_normalized(sorted(pairs)))

    def to_list(self) -> list[list[int]]:
        """Returns the ranges as [[lo, hi], ...], for JSON."""
        return [[lo, hi] for lo, hi in self]

    # --- Building new sets -------------------------------------------------------------------

    def add(self, lo: int, hi: int) -> IntervalSet:
        """Returns this set plus the integers lo <= x < hi.

        O(1) amortized when the range starts at or after the start of the set's last range
        (the cursor grows); O(n) otherwise.

        Raises:
            ValueError: lo or hi is not a non-negative integer, or lo > hi.
        """
        lo, hi = _checked((lo, hi))
        last = self._last
        if lo == hi:
            return self
        if last is None:
            return _make([], 0, (lo, hi), hi - lo)
        last_lo, last_hi = last
        if lo > last_hi:
            return self._append((lo, hi))
        if lo >= last_lo:
            if hi <= last_hi:
                return self
            return _make(self._head, self._n, (last_lo, hi), self._count + hi - last_hi)
        return self.union(_make([], 0, (lo, hi), hi - lo))

    def union(self, other: IntervalSet) -> IntervalSet:
        """Returns the integers in this set or in `other`."""
        if other.is_empty:
            return self
        if self.is_empty:
            return other
        return _from_normalized(_normalized(heapq.merge(self, other)))

    def difference(self, other: IntervalSet) -> IntervalSet:
        """Returns the integers in this set and not in `other`."""
        if other.is_empty or self.is_empty:
            return self
        return _from_normalized(_subtracted(self._list(), other._list()))

    def intersection(self, other: IntervalSet) -> IntervalSet:
        """Returns the integers in both this set and `other`."""
        return _from_normalized(_intersected(self._list(), other._list()))

    # --- Questions ---------------------------------------------------------------------------

    def __contains__(self, x: object) -> bool:
        try:
            x = operator.index(x)  # type: ignore[arg-type]
        except TypeError:
            return False
        found = self._range_at_or_before(x)
        return found is not None and x < found[1]

    def overlaps(self, lo: int, hi: int) -> bool:
        """Says whether any integer lo <= x < hi is in the set.

        Raises:
            ValueError: lo or hi is not a non-negative integer, or lo > hi.
        """
        lo, hi = _checked((lo, hi))
        if lo == hi:
            return False
        found = self._range_at_or_before(hi - 1)
        return found is not None and found[1] > lo

    @property
    def count(self) -> int:
        """The number of integers in the set."""
        return self._count

    def __len__(self) -> int:
        return self._count

    @property
    def is_empty(self) -> bool:
        return self._last is None

    @property
    def first(self) -> int:
        """The smallest integer in the set.

        Raises:
            ValueError: The set is empty.
        """
        self._check_not_empty("first")
        return self._head[0][0] if self._n else self._last[0]  # type: ignore[index]

    @property
    def end(self) -> int:
        """One past the largest integer in the set (the cursor, when the set is one range).

        Raises:
            ValueError: The set is empty.
        """
        self._check_not_empty("end")
        return self._last[1]  # type: ignore[index]

    @property
    def ranges(self) -> tuple[Range, ...]:
        """The ranges as ((lo, hi), ...), sorted."""
        return tuple(self)

    def __iter__(self) -> Iterator[Range]:
        """Iterates over the ranges (not the integers), sorted."""
        if self._last is None:
            return iter(())
        return itertools.chain(itertools.islice(self._head, self._n), (self._last,))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IntervalSet):
            return NotImplemented
        same_shape = (self._count, self._n, self._last) == (other._count, other._n, other._last)
        return same_shape and all(a == b for a, b in zip(itertools.islice(self._head, self._n), other._head))

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self.ranges)
        return self._hash

    def __repr__(self) -> str:
        return f"IntervalSet({list(self)!r})"

    def __reduce__(self) -> tuple[type[IntervalSet], tuple[tuple[Range, ...]]]:
        return IntervalSet, (self.ranges,)

    # --- Internals ---------------------------------------------------------------------------

    def _set(self, ranges: list[Range]) -> None:
        """Fills the slots from normalized ranges, which the set then owns."""
        if ranges:
            self._head, self._n, self._last = ranges, len(ranges) - 1, ranges[-1]
        else:
            self._head, self._n, self._last = ranges, 0, None
        self._count = sum(hi - lo for lo, hi in ranges)
        self._hash: int | None = None

    def _list(self) -> list[Range]:
        return list(self)

    def _append(self, new: Range) -> IntervalSet:
        """Returns this set plus `new`, a range past its end that does not touch it."""
        head, n, last = self._head, self._n, self._last
        if len(head) == n:
            head.append(last)  # nobody has grown `head` past our part: share it
        if head[n] != last:  # somebody grew it differently first: copy our part
            head = head[:n] + [last]
        return _make(head, n + 1, new, self._count + new[1] - new[0])

    def _range_at_or_before(self, x: int) -> Range | None:
        """Returns the range with the greatest lo <= x, or None."""
        last = self._last
        if last is None:
            return None
        if x >= last[0]:
            return last
        i = bisect.bisect_right(self._head, x, 0, self._n, key=_lo_of) - 1
        return self._head[i] if i >= 0 else None

    def _check_not_empty(self, what: str) -> None:
        if self._last is None:
            raise ValueError(f"an empty interval set has no {what}")


def _make(head: list[Range], n: int, last: Range, count: int) -> IntervalSet:
    """Builds a set from its slots, without checks."""
    made = object.__new__(IntervalSet)
    made._head, made._n, made._last, made._count, made._hash = head, n, last, count, None
    return made


def _from_normalized(ranges: list[Range]) -> IntervalSet:
    made = object.__new__(IntervalSet)
    made._set(ranges)
    return made


def _checked(pair: Any) -> Range:
    """Returns `pair` as (lo, hi) with 0 <= lo <= hi, or raises ValueError naming it."""
    try:
        lo, hi = pair
    except (TypeError, ValueError):
        raise ValueError(f"bad range {pair!r}: expected a (lo, hi) pair") from None
    try:
        lo, hi = _integer(lo), _integer(hi)
    except TypeError:
        raise ValueError(f"bad range {pair!r}: bounds must be integers") from None
    if lo < 0:
        raise ValueError(f"bad range {pair!r}: bounds must be >= 0")
    if lo > hi:
        raise ValueError(f"bad range {pair!r}: lo must be <= hi")
    return lo, hi


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a bound")
    return operator.index(value)


def _normalized(ranges: Iterable[Range]) -> list[Range]:
    """Merges ranges sorted by lo into sorted, disjoint, non-adjacent, non-empty ones."""
    out: list[Range] = []
    for lo, hi in ranges:
        if lo == hi:
            continue
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _intersected(a: list[Range], b: list[Range]) -> list[Range]:
    """The intersection of two normalized range lists, normalized."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtracted(a: list[Range], b: list[Range]) -> list[Range]:
    """The ranges of `a` without those of `b` (both normalized), normalized."""
    out = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > lo:
                out.append((lo, b[k][0]))
            lo = max(lo, b[k][1])
            k += 1
        if lo < hi:
            out.append((lo, hi))
    return out
