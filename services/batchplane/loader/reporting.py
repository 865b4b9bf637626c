"""Bad and over-long samples of a window a loader read: counted in metrics and logged with the
source's file, row group and rows, once per row group (so a bad file does not flood the log).
Decides nothing: the stream has already marked them (length 0) or cut them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from batchplane.core.order import Window
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.source import ParquetSource, RowGroup
from batchplane.loader.transforms import BoundTransform, lengths_of

log = logging.getLogger(__name__)


class SampleReport:
    """Reports the samples of one source's windows that are not delivered whole.

    Args:
        name: The source's name.
        source: Its files (for the file and row group of a row).
        transform: Its transform (with the job's max_length and length_policy).
        metrics: The loader's metrics.
    """

    def __init__(self, name: str, source: ParquetSource, transform: BoundTransform, metrics: LoaderMetrics) -> None:
        self._name = name
        self._source = source
        self._transform = transform
        self._metrics = metrics

    def bad(self, window: Window, failed: set[int], ids: pa.ListArray, rows: np.ndarray) -> None:
        """Null (rejected by the transform) and empty token lists of the row groups that read
        fine (`failed` ones were reported when they failed)."""
        valid = ids.is_valid().to_numpy(zero_copy_only=False)
        for reason, mask in (("rejected", ~valid), ("empty", valid & (lengths_of(ids) == 0))):
            for rg, bad_rows in self._by_group(window, rows, mask, skip=failed):
                self._metrics.bad_samples.labels(self._name, reason).inc(len(bad_rows))
                log.warning(
                    "source %r: %s: skipping %d %s sample(s) at rows %s",
                    self._name,
                    self._source.describe(rg),
                    len(bad_rows),
                    reason,
                    _first(bad_rows),
                )

    def over_length(self, window: Window, rows: np.ndarray, over: np.ndarray) -> None:
        """The samples longer than batch.max_length that were truncated, or rejected (bad
        samples, reason too_long); split ones are delivered whole and not reported."""
        policy, limit = self._transform.length_policy, self._transform.max_length
        if policy == "split":
            return
        for rg, long_rows in self._by_group(window, rows, over):
            if policy == "truncate":
                self._metrics.truncated_samples.labels(self._name).inc(len(long_rows))
                log.info(
                    "source %r: %s: truncating %d sample(s) longer than batch.max_length = %d to their first %d tokens at rows %s",
                    self._name,
                    self._source.describe(rg),
                    len(long_rows),
                    limit,
                    limit,
                    _first(long_rows),
                )
            else:
                self._metrics.bad_samples.labels(self._name, "too_long").inc(len(long_rows))
                log.warning(
                    "source %r: %s: skipping %d sample(s) longer than batch.max_length = %d (batch.length_policy reject) at rows %s",
                    self._name,
                    self._source.describe(rg),
                    len(long_rows),
                    limit,
                    _first(long_rows),
                )

    def _by_group(
        self, window: Window, rows: np.ndarray, mask: np.ndarray, *, skip: set[int] = frozenset()
    ) -> Iterator[tuple[RowGroup, np.ndarray]]:
        """For each row group of `window` (but `skip`) holding samples of `mask` (`rows`: each
        sample's row in the source): the row group and those samples' rows in it, ascending."""
        if not mask.any():
            return
        for g in window.row_groups:
            if g in skip:
                continue
            rg = self._source.row_groups[g]
            in_group = (rows >= rg.first_row) & (rows < rg.first_row + rg.num_rows)
            found = np.sort(rows[mask & in_group]) - rg.first_row
            if len(found):
                yield rg, found


def _first(rows: np.ndarray) -> str:
    """The first ten rows, and an ellipsis when there are more."""
    return f"{rows[:10].tolist()}{' ...' if len(rows) > 10 else ''}"
