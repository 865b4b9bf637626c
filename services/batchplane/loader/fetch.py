"""Serving planned samples to constructors: which samples each constructor fetched for each
step (so a retried fetch is recognized and nothing is released twice), releasing them when the
constructor says it is done, and encoding them as an Arrow IPC payload.

A sample several constructors fetch (its bucket's ranks sit in several pods, e.g. one per
pipeline stage) comes with the number of copies; it is freed once that many have released it.

What the book keeps is bounded whatever is asked: it refers to windows weakly (a window the
stream frees, or one a fetch read outside the buffer, goes at once), keeps at most
`bounds.MAX_HELD_STEPS` steps per constructor (the lowest: those furthest ahead are released at
once, as if the constructor had released them), records no fetch of nothing, and refuses a
payload larger than the loader's buffer budget.

The payload (`payload_schema`): `source` int32, `seq` int64, `input_ids` list<int32>, then each
column the job declares (`batch.payload`) in declaration order, named as declared, of type
`payload.arrow_type(column)`, one row per requested sample, values normalized.

Copies. A token's bytes (and a payload column's) go from the Parquet page to the IPC buffer
gRPC sends from through these copies (decoding the page into an Arrow buffer not counted):

    before                                      after
    1. check_output: combine_chunks             -  (one chunk: used as it is)
    2. the window: concat_arrays of its row     -  (`rows.shuffle` gathers from the row groups'
       groups                                       arrays directly)
    3. the window: take(permutation)            1. the window: one gather (none when not
                                                   shuffled and one row group)
    4. the fetch: take(index) per window        2. the fetch: one gather into the payload's
    5. the fetch: concat_arrays of the windows     arrays (none when the fetch is a contiguous
                                                   run of one window: a slice of it)
    6. encode_payload: the IPC stream           3. encode_payload: the IPC stream

(Casts happen only where a transform returns another integer width; a window a fetch reads
outside the buffer is gathered once more, so that the fetch does not hold it whole.) So 6
copies became 3, and 1 or 2 where the samples are consecutive. Measured on a 2-core machine,
`FetchBook.fetch` + `encode_payload` of 256 samples of 2,000 tokens from shuffled windows of
1,024 (medians of 15, before -> after): a contiguous run 1.1-1.4 -> 0.15-0.19 ms; every 4th
sample of 2 windows 1.0-1.4 -> 0.44-0.46 ms; 256 random ones of 4 windows 1.0-1.4 -> 0.43-0.60 ms;
reading and shuffling the 2,048 samples' windows 61-114 -> 35-79 ms.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from batchplane.core.errors import InvalidArgument
from batchplane.core.payload import PayloadColumn, schema_fields
from batchplane.loader.bounds import MAX_HELD_STEPS, check_payload
from batchplane.loader.rows import gather, rows_nbytes
from batchplane.loader.reading import TOKEN_TYPE, BufferedWindow
from batchplane.loader.stream import SourceStream

#: The payload's columns before the declared ones (`payload_schema`).
PAYLOAD_SCHEMA = pa.schema([("source", pa.int32()), ("seq", pa.int64()), ("input_ids", TOKEN_TYPE)])

#: How long a fetch waits for windows the loader reads again (after a restart) before UNAVAILABLE.
REREAD_WAIT_S = 10.0

#: Payload bytes a sample takes besides its tokens: its source (int32), seq (int64) and list offset (int32).
SAMPLE_OVERHEAD_BYTES = 16

#: (source index, window, samples fetched from it)
Hold = tuple[int, "weakref.ref[BufferedWindow]", int]
#: (source index, window, seq, copies) of a sample several constructors fetch
Shared = tuple[int, "weakref.ref[BufferedWindow]", int, int]


class FetchBook:
    """What each constructor holds, per step, until it releases it.

    Args:
        streams: The loader's streams by source index.
        max_payload_bytes: The largest payload one fetch may take (default: the streams'
            `loaders.buffer_bytes`).
    """

    def __init__(self, streams: Mapping[int, SourceStream], *, max_payload_bytes: int | None = None) -> None:
        self._streams = streams
        #: The job's declared payload columns (every stream's transform carries them).
        self.payload: tuple[PayloadColumn, ...] = next((s.transform.payload for s in streams.values()), ())
        self.schema = payload_schema(self.payload)
        budgets = {id(s.budget): s.budget.limit for s in streams.values()}
        self.max_payload_bytes = max_payload_bytes if max_payload_bytes is not None else min(budgets.values(), default=0)
        self._held: dict[tuple[int, int], tuple[list[Hold], list[Shared]]] = {}
        self._copies_left: dict[tuple[int, int], int] = {}  # (source, seq) -> releases still due
        self._lock = threading.Lock()

    def fetch(
        self,
        *,
        constructor: int,
        step: int,
        sources: np.ndarray,
        seqs: np.ndarray,
        copies: np.ndarray | None = None,
        max_bytes: int | None = None,
    ) -> pa.RecordBatch:
        """The requested samples as one record batch (rows grouped by source and window).

        Args:
            copies: How many constructors fetch each sample (None: 1 each).
            max_bytes: The most payload bytes it may take, if less than `max_payload_bytes`
                (what a call's earlier steps left of it); refused before anything is recorded.

        Raises:
            InvalidArgument: a source this loader does not serve, or mismatched arrays.
            NotFound: a position past the end of its stream, or a bad sample.
            NotPlanned: a position the planner cannot have planned from this replica.
            ResourceExhausted: a payload larger than `max_payload_bytes` (or `max_bytes`).
            Unavailable: samples the loader is still reading again (retry).
        """
        if len(sources) != len(seqs):
            raise InvalidArgument(f"samples.source has {len(sources)} entries but samples.seq has {len(seqs)}")
        if len(seqs) and seqs.min() < 0:
            raise InvalidArgument(f"samples.seq must be >= 0, got {int(seqs.min())}")
        if copies is None or not len(copies):
            copies = np.ones(len(seqs), np.int32)
        if len(copies) != len(seqs) or np.any(copies < 1):
            raise InvalidArgument(f"copies must hold one value >= 1 per sample ({len(seqs)}), got {len(copies)} values")
        unknown = sorted(set(np.unique(sources).tolist()) - set(self._streams))
        if unknown:
            raise InvalidArgument(f"this loader serves sources {sorted(self._streams)}, not {unknown}")
        source_parts, seq_parts = [], []
        pieces: list[BufferedWindow] = []  # windows (or a transient window's rows) to gather from
        which_parts, index_parts = [], []
        holds: list[Hold] = []
        shared: list[Shared] = []
        payload = 0
        limit = self.max_payload_bytes if max_bytes is None else min(max_bytes, self.max_payload_bytes)
        for source in np.unique(sources):
            stream = self._streams[int(source)]
            mine = sources == source
            wanted, wanted_copies = seqs[mine], copies[mine]
            for window, in_window, index in stream.locate(wanted, wait_s=REREAD_WAIT_S):
                payload += 4 * int(window.lengths[index].astype(np.int64).sum()) + SAMPLE_OVERHEAD_BYTES * len(index)
                payload += sum(rows_nbytes(array, index) for array in window.columns.values())
                check_payload(payload, samples=len(seqs), limit=limit)
                stream.check_good(window, index)
                which_parts.append(np.full(len(index), len(pieces), np.int64))
                if window.transient:  # read for this fetch alone: keep only the rows asked for
                    pieces.append(_rows_of(window, index))
                    index_parts.append(np.arange(len(index)))
                else:
                    pieces.append(window)
                    index_parts.append(index)
                source_parts.append(np.full(int(in_window.sum()), source, np.int32))
                seq_parts.append(wanted[in_window])
                single = in_window & (wanted_copies == 1)
                ref = weakref.ref(window)
                holds.append((int(source), ref, int(single.sum())))
                for seq, n in zip(wanted[in_window & ~single].tolist(), wanted_copies[in_window & ~single].tolist()):
                    shared.append((int(source), ref, seq, n))
        evicted = []
        with self._lock:
            if holds and (constructor, step) not in self._held:  # a retry keeps the first record
                self._held[(constructor, step)] = (holds, shared)
                for source, _, seq, n in shared:
                    self._copies_left.setdefault((source, seq), n)
                mine = sorted(key for key in self._held if key[0] == constructor)
                evicted = [self._held.pop(key) for key in mine[MAX_HELD_STEPS:]]  # the furthest ahead
        self._free(evicted)
        if not holds:
            return pa.record_batch([pa.array([], f.type) for f in self.schema], schema=self.schema)
        which, index = np.concatenate(which_parts), np.concatenate(index_parts)
        arrays = [
            pa.array(np.concatenate(source_parts)),
            pa.array(np.concatenate(seq_parts)),
            gather([w.ids for w in pieces], which, index),
        ]
        arrays += [gather([w.columns[c.name] for w in pieces], which, index) for c in self.payload]
        return pa.record_batch(arrays, schema=self.schema)

    def release(self, *, constructor: int, below_step: int) -> int:
        """Frees what `constructor` fetched for steps below `below_step`; returns samples freed."""
        with self._lock:
            done = [key for key in self._held if key[0] == constructor and key[1] < below_step]
            records = [self._held.pop(key) for key in done]
        return self._free(records)

    @property
    def held_steps(self) -> int:
        """(constructor, step) fetches recorded and not released."""
        with self._lock:
            return len(self._held)

    def _free(self, records: list[tuple[list[Hold], list[Shared]]]) -> int:
        """Releases the holds of `records` (taken out of the book); returns samples freed."""
        with self._lock:
            holds = [h for singles, _ in records for h in singles]
            for _, shared in records:
                for source, ref, seq, _ in shared:
                    left = self._copies_left.get((source, seq), 1) - 1
                    if left > 0:
                        self._copies_left[(source, seq)] = left
                    else:
                        self._copies_left.pop((source, seq), None)
                        holds.append((source, ref, 1))
        freed = 0
        for source, ref, count in holds:
            window = ref()
            if count and window is not None:  # a window freed since is not affected
                self._streams[source].release(window, count)
            freed += count
        return freed


def payload_schema(payload: tuple[PayloadColumn, ...]) -> pa.Schema:
    """The schema of a FetchSamples payload for a job declaring `payload` (see the module
    docstring)."""
    return pa.schema(list(PAYLOAD_SCHEMA) + schema_fields(payload))


def _rows_of(window: BufferedWindow, index: np.ndarray) -> BufferedWindow:
    """Rows `index` of a window, copied out of it, so the window itself can be dropped."""
    take = pa.array(index)
    return BufferedWindow(
        seq_start=window.seq_start,
        ids=window.ids.take(take),
        rows=window.rows[index],
        lengths=window.lengths[index],
        reasons=window.reasons[index],
        features={},
        nbytes=0,
        unreleased=0,
        columns={name: array.take(take) for name, array in window.columns.items()},
    )


def encode_payload(batches: Sequence[pa.RecordBatch]) -> pa.Buffer:
    """Record batches of one schema (one per step a call fetches) as one Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return sink.getvalue()
