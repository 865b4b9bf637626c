"""Secondary graphs' subbatches: which samples a constructor fetches when a secondary graph
delivers payload columns (`DGraph.deliver`), and how a rank's subbatch is laid out. Pure numpy:
no grpc, no I/O; the pipeline feeds it decoded plans (`responses.plan_subplans`) and fetched
views (`responses.sample_columns`).

Fetching. A constructor fetches the samples of the buckets its ranks get tensors of, and every
sample of every delivering part of the plan (the parts of all buckets its ranks consume, e.g.
the images each of its ranks encodes, whichever replica trains their samples): the union, each
(source, seq) once (`fetch_list`), with how many constructors fetch it (`RankPlan.copies` /
`SubPlanPart.copies`, else the bucket's `fetchers`) and its holder (`loaders`), which the planner
counted the same way (`core.delivery.DeliveryRules.sample_fetchers`); a sample both lists name
must agree on its length, copies and holder.

Layout (`lay_out_subbatches`). A rank's subbatch of a graph holds, for the part's samples in the
part's order: sample_source int32, sample_row int64, sample_epoch int32 and `<metadata>` int64
([n] each), then each column the graph delivers, in the order it names them, of its declared
dtype: a "sample" column as <name> [n, *shape]; a "blob" column as <name> [Σ rows, *shape] with
<name>_offsets int32 [n + 1] (sample b's rows are offsets[b]:offsets[b + 1]). Each is copied once,
from the fetched payload straight into its place. Delivered columns are left out of the primary
microbatches (`primary_payload`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from batchplane.constructor.assemble import MicrobatchLayout, Pieces, TensorLayout, lay_out, whole_columns
from batchplane.constructor.bounds import MalformedResponse
from batchplane.core.payload import PayloadColumn

#: A fetched sample's key: (source, seq).
Key = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class SubPart:
    """A secondary graph's samples for one bucket of its axis (a decoded SubPlanPart).

    Attributes:
        source, seq, row, epoch, length: Each sample's identity and planned length ([n]).
        values: int64 [n], each sample's `metadata` value.
        columns: Payload columns it delivers (empty: identities only).
        loaders: int32 [n] with columns: each sample's holder in `loader_addresses`.
        copies: int32 [n] with columns: constructors fetching each sample.
        digest: int64 [n]: what each sample's content digests to (`core.digest`; None: not checked).
    """

    name: str
    axis: str
    metadata: str
    bucket: int
    source: np.ndarray
    seq: np.ndarray
    row: np.ndarray
    epoch: np.ndarray
    length: np.ndarray
    values: np.ndarray
    columns: tuple[str, ...] = ()
    loaders: np.ndarray | None = None
    copies: np.ndarray | None = None
    digest: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class SubBatch:
    """A secondary graph's per-sample data for one rank, laid out after its batch's payload."""

    name: str
    metadata: str
    tensors: tuple[TensorLayout, ...]


@dataclasses.dataclass(frozen=True)
class FetchGroup:
    """Samples to fetch with their planned lengths, copies, holders and digests ([n] each;
    `digest` None: not checked)."""

    source: np.ndarray
    seq: np.ndarray
    length: np.ndarray
    copies: np.ndarray
    holders: np.ndarray
    digest: np.ndarray | None = None


def fetch_list(groups: Sequence[FetchGroup], *, address: str) -> FetchGroup:
    """The union of `groups`, each (source, seq) once, in order of first appearance.

    Args:
        address: The planner's address, for the error.
    The union has digests only where every group has them.

    Raises:
        MalformedResponse: a sample listed with different lengths, copies, holders or digests.
    """
    if not groups:
        empty = np.zeros(0, np.int32)
        return FetchGroup(empty, np.zeros(0, np.int64), empty, empty, empty)
    source = np.concatenate([g.source for g in groups]).astype(np.int32, copy=False)
    seq = np.concatenate([g.seq for g in groups]).astype(np.int64, copy=False)
    length = np.concatenate([g.length for g in groups]).astype(np.int32, copy=False)
    copies = np.concatenate([g.copies for g in groups]).astype(np.int32, copy=False)
    holders = np.concatenate([g.holders for g in groups]).astype(np.int32, copy=False)
    digest = None if any(g.digest is None for g in groups) else np.concatenate([g.digest for g in groups if g.digest is not None])
    order = np.lexsort((np.arange(len(seq)), seq, source))  # stable: a key's first listing first
    s, q = source[order], seq[order]
    first = np.ones(len(order), bool)
    first[1:] = (s[1:] != s[:-1]) | (q[1:] != q[:-1])
    lead = order[np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))]  # each listing's first listing
    for name, a in (("lengths", length), ("copies", copies), ("loaders", holders), *([("digests", digest)] if digest is not None else [])):
        bad = np.flatnonzero(a[order] != a[lead])
        if len(bad):
            i = int(order[bad[0]])
            raise MalformedResponse(
                "planner", address, f"sample (source {int(source[i])}, seq {int(seq[i])}) is listed with different {name}"
            )
    keep = np.sort(order[first])
    return FetchGroup(source[keep], seq[keep], length[keep], copies[keep], holders[keep], None if digest is None else digest[keep])


def part_group(part: SubPart) -> FetchGroup:
    """What a delivering part adds to the fetch."""
    if part.loaders is None or part.copies is None:
        raise ValueError(f"part {part.name!r} bucket {part.bucket} delivers no columns")
    return FetchGroup(part.source, part.seq, part.length, part.copies, part.loaders, part.digest)


def delivered_columns(parts: Sequence[SubPart]) -> frozenset[str]:
    """The payload columns the plan's secondary graphs deliver."""
    return frozenset(c for p in parts for c in p.columns)


def primary_payload(payload: Sequence[PayloadColumn], parts: Sequence[SubPart]) -> tuple[PayloadColumn, ...]:
    """The declared columns the primary microbatches carry: all but the delivered ones."""
    delivered = delivered_columns(parts)
    return tuple(c for c in payload if c.name not in delivered)


def subbatch_tensors(
    part: SubPart, columns: Mapping[str, Mapping[Key, np.ndarray]], payload: Sequence[PayloadColumn]
) -> dict[str, np.ndarray | Pieces]:
    """One part's tensors in layout order (see the module docstring).

    Args:
        columns: Per declared column, each fetched sample's view (`responses.sample_columns`).
        payload: The job's declared columns.
    Raises:
        KeyError: a delivered sample that was not fetched.
    """
    out: dict[str, np.ndarray | Pieces] = {
        "sample_source": part.source.astype(np.int32, copy=False),
        "sample_row": part.row.astype(np.int64, copy=False),
        "sample_epoch": part.epoch.astype(np.int32, copy=False),
        part.metadata: part.values.astype(np.int64, copy=False),
    }
    if not part.columns:
        return out
    declared = {c.name: c for c in payload}
    delivered = [declared[name] for name in part.columns]
    keys = list(zip(part.source.tolist(), part.seq.tolist()))
    views = {c.name: [columns[c.name][key] for key in keys] for c in delivered}
    out.update(whole_columns(views, delivered, 0, len(keys)))
    return out


def lay_out_subbatches(
    parts: Sequence[SubPart],
    columns: Mapping[str, Mapping[Key, np.ndarray]],
    payload: Sequence[PayloadColumn],
    *,
    step: int,
    rank: int,
    base: int,
) -> tuple[tuple[SubBatch, ...], bytearray]:
    """One rank's subbatches and their payload, laid out to follow a batch payload of `base`
    bytes (a multiple of 64).

    Args:
        parts: The parts of the buckets the rank consumes.
        columns: Per declared column, each fetched sample's view.
        payload: The job's declared columns.
    """
    laid = lay_out(
        [(subbatch_tensors(p, columns, payload), MicrobatchLayout((), 0, 0, False)) for p in parts],
        step=step,
        rank=rank,
        global_loss_tokens=0,
    )
    subbatches = tuple(
        SubBatch(part.name, part.metadata, tuple(dataclasses.replace(t, offset=base + t.offset) for t in layout.tensors))
        for part, layout in zip(parts, laid.microbatches)
    )
    return subbatches, laid.payload
