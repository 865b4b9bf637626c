"""The digests of planned samples (`core.digest`) in the planner's ledger: what a step's record
keeps of them (`record_digests`), what a start or a rewind reads back (`digests_of`), and how a
step planned again is held to them (`held_to`). Pure: no I/O, no grpc, no clocks.

A loader's summary gives each sample's digest; the planner puts it in the plans, and each
constructor refuses a sample that arrives with another content (its loader replica is fenced).
The ledger records every planned sample's digest beside its identity, so a step that is planned
again (a restarted planner, a trainer's rewind) is held to the digests it was first planned
with, not to whatever the replica that summarizes it now says: where the two differ, the plan
carries the recorded one (and the planner says so), so a replica whose summaries changed with
what it serves is caught too.

A record's "digests" field lies beside its "ranks" (per bucket, per microbatch, one entry per
sample): each digest as 16 lowercase hex digits of its 64 bits (unsigned), so no JSON reader
rounds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from batchplane.core.digest import DTYPE
from batchplane.planner.plan import SampleTable, StepPlan

#: A sample's identity as a record holds it: (source index, row, epoch).
Identity = tuple[int, int, int]

_MASK = (1 << 64) - 1


def to_hex(digest: int) -> str:
    """A digest as a record holds it: 16 hex digits of its 64 bits."""
    return f"{int(digest) & _MASK:016x}"


def from_hex(text: str) -> int:
    """A recorded digest as the int64 it is (`core.digest.DTYPE`).

    Raises:
        ValueError: not 16 hex digits.
    """
    if len(text) != 16:
        raise ValueError(f"a digest has 16 hex digits, got {text!r}")
    value = int(text, 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def record_digests(plan: StepPlan) -> list[list[list[str]]] | None:
    """A step record's "digests": per bucket, per microbatch, the digest of each sample, in the
    order of its "ranks"; None when the plan carries none (every digest 0: samples no loader
    summarized, as in simulations)."""
    digests = plan.samples.digest
    if not len(digests) or not digests.any():
        return None
    return [[[to_hex(d) for d in digests[np.asarray(mb, np.int64)].tolist()] for mb in rank] for rank in plan.microbatches]


def digests_of(record: Mapping[str, Any], source_names: Sequence[str], *, skip: Collection[str] = ()) -> dict[Identity, int]:
    """The digest of each sample a step's record holds, by identity; none where the record has
    no digests (written before they were recorded, or thinned), and none of the sources `skip`
    names (sources that start over: their rows are other data now).

    Raises:
        ValueError: a record whose digests do not lie beside its ranks.
    """
    digests, ranks = record.get("digests"), record.get("ranks")
    if digests is None or ranks is None:
        return {}
    skipped = {source_names.index(name) for name in skip if name in source_names}
    out: dict[Identity, int] = {}
    if len(digests) != len(ranks):
        raise ValueError(f"step {record.get('step')}: digests of {len(digests)} buckets beside {len(ranks)}")
    for rank_ids, rank_digests in zip(ranks, digests):
        for mb_ids, mb_digests in zip(rank_ids, rank_digests, strict=True):
            for (source, row, epoch), text in zip(mb_ids, mb_digests, strict=True):
                if source not in skipped:
                    out[(int(source), int(row), int(epoch))] = from_hex(text)
    return out


def held_to(table: SampleTable, recorded: Mapping[Identity, int]) -> tuple[SampleTable, np.ndarray]:
    """`table` with each good sample's digest the one `recorded` holds for its identity, where
    it holds one, and the indices of the samples whose digest that changed (their loader
    summarized another content than the ledger recorded)."""
    if not recorded or not len(table):
        return table, np.zeros(0, np.int64)
    digest = np.array(table.digest, DTYPE)
    keys = zip(table.source.tolist(), table.row.tolist(), table.epoch.tolist())
    for i, key in enumerate(keys):
        held = recorded.get(key)
        if held is not None and digest[i] != 0:
            digest[i] = held
    changed = np.flatnonzero(digest != table.digest)
    return (dataclasses.replace(table, digest=digest) if len(changed) else table), changed
