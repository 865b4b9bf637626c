"""Compact sets of non-negative integers, such as the sequence numbers consumed of a source.
Pure: no I/O.

An `IntervalSet` holds its integers as half-open ranges [lo, hi), sorted, disjoint and
non-adjacent (touching ranges are merged), and is immutable: every operation returns a new set.
Consumption mostly grows a contiguous cursor, so a source's set is usually one range and growing
it at its end replaces that range; membership is a binary search; union, difference and
intersection are linear merges.
"""

from __future__ import annotations

import bisect
import heapq
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

    __slots__ = ("_ranges", "_count", "_hash")

    def __init__(self, ranges: Iterable[Range] = ()) -> None:
        self._ranges = tuple(_normalized(sorted(_checked(pair) for pair in ranges)))
        self._count = sum(hi - lo for lo, hi in self._ranges)
        self._hash: int | None = None

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
        return _make(_normalized(sorted(pairs)))

    def to_list(self) -> list[list[int]]:
        """Returns the ranges as [[lo, hi], ...], for JSON."""
        return [[lo, hi] for lo, hi in self]

    # --- Building new sets -------------------------------------------------------------------

    def add(self, lo: int, hi: int) -> IntervalSet:
        """Returns this set plus the integers lo <= x < hi.

        Growing the set at its end (the cursor) touches only its last range.

        Raises:
            ValueError: lo or hi is not a non-negative integer, or lo > hi.
        """
        lo, hi = _checked((lo, hi))
        if lo == hi:
            return self
        if not self._ranges or lo > self._ranges[-1][1]:
            return _make((*self._ranges, (lo, hi)))
        last_lo, last_hi = self._ranges[-1]
        if lo >= last_lo:
            return self if hi <= last_hi else _make((*self._ranges[:-1], (last_lo, hi)))
        return self.union(_make(((lo, hi),)))

    def union(self, other: IntervalSet) -> IntervalSet:
        """Returns the integers in this set or in `other`."""
        if other.is_empty:
            return self
        if self.is_empty:
            return other
        return _make(_normalized(heapq.merge(self, other)))

    def difference(self, other: IntervalSet) -> IntervalSet:
        """Returns the integers in this set and not in `other`."""
        if other.is_empty or self.is_empty:
            return self
        return _make(_subtracted(self._ranges, other._ranges))

    def intersection(self, other: IntervalSet) -> IntervalSet:
        """Returns the integers in both this set and `other`."""
        return _make(_intersected(self._ranges, other._ranges))

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
        return not self._ranges

    @property
    def first(self) -> int:
        """The smallest integer in the set.

        Raises:
            ValueError: The set is empty.
        """
        self._check_not_empty("first")
        return self._ranges[0][0]

    @property
    def end(self) -> int:
        """One past the largest integer in the set (the cursor, when the set is one range).

        Raises:
            ValueError: The set is empty.
        """
        self._check_not_empty("end")
        return self._ranges[-1][1]

    @property
    def ranges(self) -> tuple[Range, ...]:
        """The ranges as ((lo, hi), ...), sorted."""
        return self._ranges

    def __iter__(self) -> Iterator[Range]:
        """Iterates over the ranges (not the integers), sorted."""
        return iter(self._ranges)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IntervalSet):
            return NotImplemented
        return self._ranges == other._ranges

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._ranges)
        return self._hash

    def __repr__(self) -> str:
        return f"IntervalSet({list(self)!r})"

    def __reduce__(self) -> tuple[type[IntervalSet], tuple[tuple[Range, ...]]]:
        return IntervalSet, (self.ranges,)

    # --- Internals ---------------------------------------------------------------------------

    def _range_at_or_before(self, x: int) -> Range | None:
        """Returns the range with the greatest lo <= x, or None."""
        i = bisect.bisect_right(self._ranges, x, key=_lo_of) - 1
        return self._ranges[i] if i >= 0 else None

    def _check_not_empty(self, what: str) -> None:
        if not self._ranges:
            raise ValueError(f"an empty interval set has no {what}")


def _make(ranges: Iterable[Range]) -> IntervalSet:
    """Builds a set from normalized ranges, without checks."""
    made = object.__new__(IntervalSet)
    made._ranges = tuple(ranges)
    made._count = sum(hi - lo for lo, hi in made._ranges)
    made._hash = None
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


def _intersected(a: tuple[Range, ...], b: tuple[Range, ...]) -> list[Range]:
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


def _subtracted(a: tuple[Range, ...], b: tuple[Range, ...]) -> list[Range]:
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
