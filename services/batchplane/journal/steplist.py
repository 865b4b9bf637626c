"""An immutable sequence of items sorted by an integer key, held as chunks that successive
versions share: the committed steps of a manifest state (`manifest.ManifestState.steps`).

Every manifest version makes a new state from the previous one. With the steps in one tuple,
each version copied all of them (and touched every step's reference count): at 200,000 steps
about 10 ms per version, paid by every reader for every version it applies. Here a version
that appends its steps copies the list of chunks (n / `CHUNK` references) and the last chunk;
one that inserts (a producer behind the others) rebuilds only the chunks from the first
insertion on; dropping a prefix (the retention watermark) keeps the chunks after it. Pure: no
I/O, no threads.

It is a `Sequence` (length, indexing, slicing, iteration) equal to any tuple or list of the same
items, so code that reads a state's steps sees no difference; `bisect_left` finds a key with two
searches in C (over the chunks' last keys, then within one chunk).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")

#: Items per chunk (the last may hold fewer): a version appending to a state copies about
#: n / CHUNK + CHUNK references instead of n.
CHUNK = 1024


class ChunkedList(Sequence[T], Generic[T]):
    """Items sorted by `key(item)` (an int, strictly increasing), in chunks of at most `CHUNK`.

    Args:
        items: The items, already sorted by key (not checked: the manifest's rules keep them so).
        key: The item's sort key.
    """

    __slots__ = ("_chunks", "_ends", "_lasts", "_key")

    def __init__(self, items: Iterable[T] = (), *, key: Callable[[T], int]) -> None:
        self._set(_cut(tuple(items)), key)

    @classmethod
    def _of(cls, chunks: tuple[tuple[T, ...], ...], key: Callable[[T], int]) -> ChunkedList[T]:
        out = cls.__new__(cls)
        out._set(tuple(c for c in chunks if c), key)
        return out

    def _set(self, chunks: tuple[tuple[T, ...], ...], key: Callable[[T], int]) -> None:
        self._chunks = chunks
        self._ends = list(itertools.accumulate(len(c) for c in chunks))  # end position of each chunk
        self._lasts = [key(c[-1]) for c in chunks]  # key of each chunk's last item
        self._key = key

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[T, ...]: ...

    def __getitem__(self, index: int | slice) -> T | tuple[T, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("ChunkedList index out of range")
        c = bisect.bisect_right(self._ends, index)
        return self._chunks[c][index - (self._ends[c - 1] if c else 0)]

    def __iter__(self) -> Iterator[T]:
        return itertools.chain.from_iterable(self._chunks)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ChunkedList, tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ChunkedList({list(self)!r})"

    def bisect_left(self, key: int, lo: int = 0) -> int:
        """The first position at or after `lo` whose item's key is >= `key` (len if none)."""
        c = bisect.bisect_left(self._lasts, key)
        if c == len(self._chunks):
            return max(lo, len(self))
        base = self._ends[c - 1] if c else 0
        at = base + bisect.bisect_left(self._chunks[c], key, key=self._key)
        return max(lo, at)

    def from_position(self, start: int) -> ChunkedList[T]:
        """The items from position `start` on (the chunks after it shared)."""
        if start <= 0:
            return self
        c = bisect.bisect_right(self._ends, start)
        if c == len(self._chunks):
            return ChunkedList._of((), self._key)
        cut = start - (self._ends[c - 1] if c else 0)
        return ChunkedList._of((self._chunks[c][cut:], *self._chunks[c + 1 :]), self._key)

    def merged(self, added: Sequence[T], positions: Sequence[int] | None) -> ChunkedList[T]:
        """These items with `added` (sorted, none of their keys here) inserted at `positions`
        (each `bisect_left` of its key; None: all after the last item)."""
        if not added:
            return self
        chunks = self._chunks
        if positions is None:  # appended: only the last chunk changes
            if chunks and len(chunks[-1]) < CHUNK:
                tail = chunks[-1] + tuple(added)
                return ChunkedList._of((*chunks[:-1], *_cut(tail)), self._key)
            return ChunkedList._of((*chunks, *_cut(tuple(added))), self._key)
        first = bisect.bisect_right(self._ends, positions[0])  # the chunk of the first insertion
        base = self._ends[first - 1] if first else 0
        rest = list(itertools.chain.from_iterable(chunks[first:]))
        out: list[Any] = []
        prev = 0
        for item, at in zip(added, positions):
            out += rest[prev : at - base]
            out.append(item)
            prev = at - base
        out += rest[prev:]
        return ChunkedList._of((*chunks[:first], *_cut(tuple(out))), self._key)


def _cut(items: tuple[T, ...]) -> tuple[tuple[T, ...], ...]:
    """`items` in chunks of `CHUNK`."""
    return tuple(items[i : i + CHUNK] for i in range(0, len(items), CHUNK))
