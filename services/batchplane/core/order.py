"""The order in which a source's samples are consumed: a seeded, windowed block shuffle. Pure;
no I/O.

Each epoch permutes the source's row groups, cuts the permuted list into windows of
`window_row_groups` row groups and permutes the rows inside each window. A window is the unit
a loader reads and frees, so memory stays bounded by a few windows, however large the source,
while samples of several row groups (often several files) are mixed. The order is a function
of (seed, source name, epoch) only, so every process that knows the configuration computes the
same stream, and `seq = epoch * num_rows + position` names one row forever.

Here "epoch" is a pass over the source. A source with `repeat: r` (see
`batchplane.core.config.SourceSettings`) makes r passes per job epoch, so pass p belongs to job
epoch p // r (`job_epoch`); each pass has its own order and its own seqs, so (source, seq)
stays a sample's identity and every row is taken exactly r times per job epoch.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import threading
from collections.abc import Sequence

import numpy as np


def stable_key(name: str) -> int:
    """A 64-bit integer from a name, equal in every process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def job_epoch(seq: int, *, num_rows: int, repeat: int = 1) -> int:
    """The job epoch of stream position `seq` of a source of `num_rows` rows making `repeat`
    passes per job epoch."""
    return seq // num_rows // repeat


@dataclasses.dataclass(frozen=True)
class Window:
    """A run of positions of one epoch, backed by a few row groups.

    Attributes:
        index: The window's index within its epoch.
        row_groups: Row groups to read, in this order, and concatenate.
        start: The window's first position within the epoch.
        size: Rows in the window.
    """

    index: int
    row_groups: tuple[int, ...]
    start: int
    size: int


class SampleOrder:
    """The consumption order of one source.

    Args:
        row_group_sizes: Rows of each row group, in file order.
        seed: The job's seed.
        source_name: The source's name (part of the seed, so sources shuffle independently).
        window_row_groups: Row groups shuffled together.
        shuffle: False keeps file order (windows in order, rows in order).
    """

    def __init__(
        self,
        row_group_sizes: Sequence[int],
        *,
        seed: int,
        source_name: str,
        window_row_groups: int,
        shuffle: bool = True,
    ) -> None:
        if window_row_groups < 1:
            raise ValueError(f"window_row_groups must be >= 1, got {window_row_groups}")
        self.row_group_sizes = np.asarray(row_group_sizes, dtype=np.int64)
        self.row_group_starts = np.concatenate([[0], np.cumsum(self.row_group_sizes)])[:-1]
        self.num_rows = int(self.row_group_sizes.sum())
        self.seed = seed
        self.key = stable_key(source_name)
        self.window_row_groups = window_row_groups
        self.shuffle = shuffle
        self._windows: dict[int, tuple[Window, ...]] = {}  # the latest epochs' windows
        self._starts: dict[int, list[int]] = {}  # and their first positions, for `window_at`
        self._lock = threading.Lock()

    def _rng(self, *parts: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.key, *parts])))

    def windows(self, epoch: int) -> tuple[Window, ...]:
        """The windows of `epoch`, in consumption order (kept for the two latest epochs)."""
        return self._epoch(epoch)[0]

    def _epoch(self, epoch: int) -> tuple[tuple[Window, ...], list[int]]:
        """The windows of `epoch` and their first positions (ascending), made once per epoch."""
        with self._lock:
            if epoch not in self._windows:
                if len(self._windows) >= 2:
                    oldest = min(self._windows)
                    del self._windows[oldest], self._starts[oldest]
                windows = self._make_windows(epoch)
                self._windows[epoch] = windows
                self._starts[epoch] = [w.start for w in windows]
            return self._windows[epoch], self._starts[epoch]

    def _make_windows(self, epoch: int) -> tuple[Window, ...]:
        groups = np.arange(len(self.row_group_sizes))
        if self.shuffle:
            groups = self._rng(epoch).permutation(groups)
        windows: list[Window] = []
        start = 0
        for i in range(0, len(groups), self.window_row_groups):
            chosen = tuple(int(g) for g in groups[i : i + self.window_row_groups])
            size = int(self.row_group_sizes[list(chosen)].sum())
            windows.append(Window(index=len(windows), row_groups=chosen, start=start, size=size))
            start += size
        return tuple(windows)

    def window_at(self, epoch: int, position: int) -> Window:
        """The window of `epoch` holding `position`."""
        if not 0 <= position < self.num_rows:
            raise ValueError(f"position {position} outside [0, {self.num_rows})")
        windows, starts = self._epoch(epoch)
        return windows[bisect.bisect_right(starts, position) - 1]

    def permutation(self, epoch: int, window: Window) -> np.ndarray:
        """int64 [window.size]: position window.start + j holds the row at index perm[j] of the
        window's row groups concatenated in `window.row_groups` order."""
        if not self.shuffle:
            return np.arange(window.size, dtype=np.int64)
        return self._rng(epoch, 1 + window.index).permutation(window.size).astype(np.int64)

    def rows(self, window: Window) -> np.ndarray:
        """int64 [window.size]: source row of each row of the window's concatenated row groups."""
        return np.concatenate([np.arange(self.row_group_sizes[g], dtype=np.int64) + self.row_group_starts[g] for g in window.row_groups])

    def window_rows(self, epoch: int, window: Window) -> np.ndarray:
        """int64 [window.size]: the source row at each position of the window, in order."""
        return self.rows(window)[self.permutation(epoch, window)]
