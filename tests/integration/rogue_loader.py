"""A loader replica gone rogue, for test_rogue_loader.py: the real loader (`python -m
batchplane.loader`, the same flags), except that every sample it serves to a constructor has 1
added to each of its token ids, while its summaries to the planner stay honest (a compromised
replica feeding other tokens for the right positions)."""

from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.compute as pc

from batchplane.loader import fetch
from batchplane.loader.__main__ import main

honest = fetch.FetchBook.fetch


def altered(self: fetch.FetchBook, **kwargs) -> pa.RecordBatch:
    batch = honest(self, **kwargs)
    ids = batch.column("input_ids")
    shifted = pa.ListArray.from_arrays(ids.offsets, pc.add(ids.values, pa.scalar(1, pa.int32())))
    return pa.record_batch([*batch.columns[:2], shifted, *batch.columns[3:]], schema=batch.schema)


fetch.FetchBook.fetch = altered  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
