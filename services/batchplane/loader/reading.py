"""Reading one window of a source in a loader: its row groups from Parquet, through the
sample transform, shuffled, each bad sample marked with its reason; the stream
(`stream.SourceStream`) decides which windows to read and when.

Bad data is skipped, never silently: a row group that cannot be read or decoded, or whose
transform fails, becomes a run of bad samples (length 0); so do null or empty token lists. Bad
samples keep their positions (the plan does not depend on them, I4), carry the reason in the
summaries (`core.bad`: the ledger records it), are counted in metrics and logged with file, row
group and rows. So is a sample longer than `batch.max_length` under
`batch.length_policy` "reject" (reason too_long); under "truncate" it is cut to its first
max_length tokens before anyone sees it, counted and logged once per row group.

Each good sample's digest (`core.digest`) is computed here, once, over what the loader will
serve of it; summaries carry it to the planner (`summary_of`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from batchplane.core import bad
from batchplane.core.digest import DTYPE as DIGEST_DTYPE, sample_digests
from batchplane.core.order import SampleOrder
from batchplane.loader.metrics import LoaderMetrics
from batchplane.loader.reporting import SampleReport
from batchplane.loader.rows import shuffle
from batchplane.loader.source import ParquetSource
from batchplane.loader.transforms import BoundTransform, TransformError, TransformOutput, lengths_of

log = logging.getLogger(__name__)

TOKEN_TYPE = pa.list_(pa.int32())


@dataclasses.dataclass
class BufferedWindow:
    """A window read, transformed and shuffled: position seq_start + j holds ids[j] and row j of
    each declared payload column."""

    seq_start: int
    ids: pa.ListArray
    rows: np.ndarray
    lengths: np.ndarray
    #: uint8 [n]: why each bad sample (length 0) is bad (`core.bad` codes); 0 for good ones.
    reasons: np.ndarray
    features: dict[str, np.ndarray]
    nbytes: int
    #: Good samples at or after the stream's start when read: those constructors release (the
    #: stream's `windows.WindowBook` counts them down).
    unreleased: int
    #: The job's declared payload columns (`batch.payload`) by name, normalized, shuffled like
    #: `ids`; a bad sample's are their empty values.
    columns: dict[str, pa.Array] = dataclasses.field(default_factory=dict)
    #: Read by a fetch outside the buffer (`locate`): dropped once the fetch has taken from it.
    transient: bool = False
    #: int64 [n]: each sample's digest (`core.digest`), 0 for a bad one.
    digests: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, DIGEST_DTYPE))

    @property
    def seq_end(self) -> int:
        return self.seq_start + len(self.rows)


class WindowReader:
    """Reads the windows of one source.

    Args:
        source: Its open files.
        order: Its consumption order.
        transform: Its sample transform.
        metrics: The loader's metrics.
    """

    def __init__(self, source: ParquetSource, order: SampleOrder, transform: BoundTransform, metrics: LoaderMetrics) -> None:
        self.source = source
        self.order = order
        self.transform = transform
        self.name = source.name
        self.num_rows = order.num_rows
        self._metrics = metrics
        self._report = SampleReport(source.name, source, transform, metrics)
        #: The transform's features, set by the first good row group.
        self.feature_names: tuple[str, ...] | None = None

    def read(self, seq: int, *, start_seq: int | None) -> BufferedWindow:
        """The window holding position `seq`, read, transformed and shuffled, for a stream
        starting at `start_seq` (None: not yet known, 0)."""
        epoch, position = divmod(seq, self.num_rows)
        window = self.order.window_at(epoch, position)
        parts: list[TransformOutput] = []
        reason_parts, failed = [], set()
        for g in window.row_groups:
            got = self._read_row_group(g)
            n = self.source.row_groups[g].num_rows
            if isinstance(got, int):  # a reason code: the row group is a run of bad samples
                failed.add(g)
                reason_parts.append(np.full(n, got, bad.DTYPE))
                got = self.transform.failed(n)
            else:
                reason_parts.append(np.zeros(n, bad.DTYPE))
            parts.append(got)
        perm = self.order.permutation(epoch, window)
        ids = shuffle([p.ids for p in parts], perm)
        columns = {c.name: shuffle([p.columns[c.name] for p in parts], perm) for c in self.transform.payload}
        reasons = np.concatenate(reason_parts)[perm] if reason_parts else np.zeros(0, bad.DTYPE)
        features = {
            name: np.concatenate([p.features.get(name, np.zeros(len(p.ids))) for p in parts])[perm] for name in self.feature_names or ()
        }
        rows = self.order.window_rows(epoch, window)
        self._report.bad(window, failed, ids, rows)
        reasons = _bad_reasons(ids, reasons)
        ids, over = self.transform.limit(ids)  # batch.max_length: truncate or reject
        self._report.over_length(window, rows, over)
        lengths = lengths_of(ids)
        columns = self.transform.limit_columns(columns, over=over, lengths=lengths)
        reasons[over & (lengths == 0) & (reasons == 0)] = bad.TOO_LONG  # rejected by limit (a cut one keeps tokens)
        digests = sample_digests(ids, columns, self.transform.payload, good=lengths > 0)  # of what fetches serve
        seq_start = epoch * self.num_rows + window.start
        # Positions before the stream's start were consumed before it (a resumed job): never
        # fetched, so not counted; a window wholly before it is one read again for a fetch.
        start = start_seq or 0
        first_counted = max(0, start - seq_start) if start < seq_start + len(rows) else 0
        self._metrics.samples_read.labels(self.name).inc(len(rows))
        return BufferedWindow(
            seq_start=seq_start,
            ids=ids,
            rows=rows,
            lengths=lengths,
            reasons=reasons,
            features=features,
            nbytes=ids.nbytes
            + rows.nbytes
            + lengths.nbytes
            + reasons.nbytes
            + digests.nbytes
            + sum(f.nbytes for f in features.values())
            + sum(c.nbytes for c in columns.values()),
            unreleased=int(np.count_nonzero(lengths[first_counted:] > 0)),
            columns=columns,
            digests=digests,
        )

    def _read_row_group(self, g: int) -> TransformOutput | int:
        """The transformed token lists, features and payload columns of row group g; when it cannot be read or
        transformed, the reason code of its samples instead (`bad.UNREADABLE`, `bad.TRANSFORM`;
        logged and counted here)."""
        row_group = self.source.row_groups[g]
        where = self.source.describe(row_group)
        try:
            table = self.source.read(row_group, self.transform.columns)
        except (OSError, pa.ArrowException) as exc:
            log.error("source %r: %s is unreadable, skipping its %d rows: %s", self.name, where, row_group.num_rows, exc)
            self._metrics.corrupt_row_groups.labels(self.name).inc()
            self._metrics.bad_samples.labels(self.name, "unreadable").inc(row_group.num_rows)
            return bad.UNREADABLE
        try:
            out = self.transform.apply(table)
            out = dataclasses.replace(out, ids=out.ids.cast(TOKEN_TYPE))
            features = out.features
            if self.feature_names is None:
                self.feature_names = tuple(sorted(features))
            elif set(features) != set(self.feature_names):
                raise TransformError(f"returned features {sorted(features)}, earlier row groups {list(self.feature_names)}")
        except Exception as exc:  # noqa: BLE001 - user code: any failure skips the row group
            log.error("source %r: transform failed on %s, skipping its %d rows: %s", self.name, where, row_group.num_rows, exc)
            self._metrics.bad_samples.labels(self.name, "transform").inc(row_group.num_rows)
            return bad.TRANSFORM
        return out


def _bad_reasons(ids: pa.ListArray, groups: np.ndarray) -> np.ndarray:
    """uint8 [n]: the `core.bad` reason of each sample of transformed token lists `ids`:
    `groups`' code where it has one (a row group that could not be read or transformed), else
    REJECTED for a null list, EMPTY for an empty one, 0 for the others."""
    valid = ids.is_valid().to_numpy(zero_copy_only=False)
    reasons = groups.astype(bad.DTYPE, copy=True)
    free = reasons == 0
    reasons[free & ~valid] = bad.REJECTED
    reasons[free & valid & (lengths_of(ids) == 0)] = bad.EMPTY
    return reasons


class Summary(NamedTuple):
    """What a summary request is answered: consecutive positions' rows (int64), lengths (int32),
    bad samples' reasons (uint8 `core.bad` codes, 0 for good ones), features by name (float64),
    whether the stream ends after them, and digests (int64 `core.digest`, 0 for bad samples)."""

    rows: np.ndarray
    lengths: np.ndarray
    reasons: np.ndarray
    features: dict[str, np.ndarray]
    end_of_stream: bool
    digests: np.ndarray


def summary_of(pieces: Sequence[tuple[BufferedWindow, int, int]], names: Sequence[str], *, end_of_stream: bool) -> Summary:
    """The summary of windows' positions (window, first, end index) one after another;
    `names`: the transform's features (0 where a window lacks one)."""
    rows = [w.rows[lo:hi] for w, lo, hi in pieces]
    features = {name: [w.features[name][lo:hi] if name in w.features else np.zeros(hi - lo) for w, lo, hi in pieces] for name in names}
    return Summary(
        np.concatenate(rows) if rows else np.zeros(0, np.int64),
        np.concatenate([w.lengths[lo:hi] for w, lo, hi in pieces]) if pieces else np.zeros(0, np.int32),
        np.concatenate([w.reasons[lo:hi] for w, lo, hi in pieces]) if pieces else np.zeros(0, bad.DTYPE),
        {name: np.concatenate(parts) if parts else np.zeros(0) for name, parts in features.items()},
        end_of_stream,
        np.concatenate([w.digests[lo:hi] for w, lo, hi in pieces]) if pieces else np.zeros(0, DIGEST_DTYPE),
    )
