"""Whether what a loader sent is what the planner planned: each received sample's digest
(`core.digest`, over exactly the bytes that arrived) against the one the plan carries for it
(`SampleSet.digest`, from the loader's summary, held in the planner's ledger). Pure: no grpc,
no I/O; the fetcher calls it on every table a loader served, before anything is built from it.

A sample that differs is never built into a batch: the fetch fails with `AlteredSamples` (an
Unavailable, so the step is built again from a fresh plan); the fetcher counts it, logs it and
reports the replica to the planner with its next plan request (`GetPlanRequest.altered`), which
fences it and names another replica of the group in its place. That replica reads the same rows
and sends the content the plan's digests name.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from batchplane.constructor.responses import Wanted
from batchplane.core.digest import mismatched, sample_digests
from batchplane.core.errors import Unavailable
from batchplane.core.payload import PayloadColumn


class AlteredSamples(Unavailable):
    """A loader replica sent samples whose content differs from the plan's digests.

    Attributes:
        address: The replica's address.
        step: The step the samples are for.
        sources: int32 [k], the altered samples' sources.
        seqs: int64 [k], their positions.
    """

    def __init__(self, address: str, step: int, sources: np.ndarray, seqs: np.ndarray) -> None:
        self.address, self.step, self.sources, self.seqs = address, step, sources, seqs
        super().__init__(
            f"the loader at {address} sent {len(seqs)} sample(s) of step {step} whose content differs from the plan's digests "
            f"(first: source {int(sources[0])} position {int(seqs[0])}); refused, fetching them again from a fresh plan"
        )


def check_digests(table: pa.Table, wanted: Wanted, *, step: int, address: str, columns: Sequence[PayloadColumn]) -> None:
    """Raises AlteredSamples unless every sample of `table` (a loader's payload of exactly the
    samples `wanted`, in any order: `responses.receive_samples` checked that) digests to what
    the plan says; nothing is checked where the plan carries no digests.

    Args:
        columns: The job's declared payload columns (`batch.payload`), which the digest covers.
    """
    if wanted.digests is None or not table.num_rows:
        return
    ids = table.column("input_ids").combine_chunks()
    got = sample_digests(ids, {c.name: table.column(c.name).combine_chunks() for c in columns}, columns)
    theirs = np.lexsort((table.column("seq").to_numpy(), table.column("source").to_numpy()))
    mine = np.lexsort((wanted.seqs, wanted.sources))
    bad = mine[mismatched(got[theirs], wanted.digests[mine])]
    if len(bad):
        raise AlteredSamples(address, step, wanted.sources[bad], wanted.seqs[bad])
