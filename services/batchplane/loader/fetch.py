"""Serving planned samples to constructors: which samples each constructor fetched for each
step (so a retried fetch is recognized and nothing is released twice), releasing them when the
constructor says it is done, and encoding them as an Arrow IPC payload.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from batchplane.core.errors import InvalidArgument
from batchplane.loader.stream import TOKEN_TYPE, SourceStream

PAYLOAD_SCHEMA = pa.schema([("source", pa.int32()), ("seq", pa.int64()), ("input_ids", TOKEN_TYPE)])

#: (source index, window seq_start, samples fetched from it)
Hold = tuple[int, int, int]


class FetchBook:
    """What each constructor holds, per step, until it releases it.

    Args:
        streams: The loader's streams by source index.
    """

    def __init__(self, streams: Mapping[int, SourceStream]) -> None:
        self._streams = streams
        self._held: dict[tuple[int, int], list[Hold]] = {}
        self._lock = threading.Lock()

    def fetch(self, *, constructor: int, step: int, sources: np.ndarray, seqs: np.ndarray) -> pa.RecordBatch:
        """The requested samples as one record batch (rows grouped by source and window).

        Raises:
            InvalidArgument: a source this loader does not serve, or mismatched arrays.
            NotFound: a sample that is not buffered.
        """
        if len(sources) != len(seqs):
            raise InvalidArgument(f"samples.source has {len(sources)} entries but samples.seq has {len(seqs)}")
        unknown = sorted(set(np.unique(sources).tolist()) - set(self._streams))
        if unknown:
            raise InvalidArgument(f"this loader serves sources {sorted(self._streams)}, not {unknown}")
        columns: dict[str, list] = {"source": [], "seq": [], "input_ids": []}
        holds: list[Hold] = []
        for source in np.unique(sources):
            stream = self._streams[int(source)]
            wanted = seqs[sources == source]
            starts, index = stream.locate(wanted)
            for start in np.unique(starts):
                in_window = starts == start
                ids, _ = stream.take(int(start), index[in_window])
                columns["source"].append(np.full(int(in_window.sum()), source, np.int32))
                columns["seq"].append(wanted[in_window])
                columns["input_ids"].append(ids)
                holds.append((int(source), int(start), int(in_window.sum())))
        with self._lock:
            self._held.setdefault((constructor, step), holds)  # a retry keeps the first record
        if not holds:
            return pa.RecordBatch.from_pylist([], schema=PAYLOAD_SCHEMA)
        return pa.record_batch(
            [
                pa.array(np.concatenate(columns["source"])),
                pa.array(np.concatenate(columns["seq"])),
                pa.concat_arrays(columns["input_ids"]),
            ],
            schema=PAYLOAD_SCHEMA,
        )

    def release(self, *, constructor: int, below_step: int) -> int:
        """Frees what `constructor` fetched for steps below `below_step`; returns samples freed."""
        with self._lock:
            done = [key for key in self._held if key[0] == constructor and key[1] < below_step]
            holds = [h for key in done for h in self._held.pop(key)]
        for source, start, count in holds:
            self._streams[source].release(start, count)
        return sum(count for _, _, count in holds)


def encode_payload(batch: pa.RecordBatch) -> pa.Buffer:
    """One record batch as an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()
