"""One step's deliveries, built from its decoded plan and the samples fetched for it: a pure
function (`build_step`), with what to fetch for it (`to_fetch`). No grpc, no I/O: the pipeline
decodes the plan (`responses.step_plan`), fetches, and calls these.

A constructor serves some ranks of the job's mesh; each consumes one bucket of the plan's axis
and gets a variant of its bucket's microbatches (`core.delivery.DeliveryRules`). Each bucket a
rank gets tensors of is assembled once from its fetched samples (`assemble.assemble`, then the
strategy's constructor hook); a bucket only metadata-only ranks consume (TP peers the trainer
broadcasts to, middle stages that need nothing) is built from the plan's lengths alone
(`assemble.metadata_only`). Then each variant once (`assemble.derive`: a CP rank's slice, a
pipeline stage's part, metadata only), shared by every rank that has it: TP peers get the very
same built batch (I3). Last, each rank gets the subbatches of the secondary graphs' parts of the
buckets it consumes (`subbatch.lay_out_subbatches`), laid out after its batch's payload.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from batchplane.constructor.assemble import BuiltBatch, RankSamples, assemble, derive, metadata_only
from batchplane.constructor.hooks import apply_constructor_hook
from batchplane.constructor.subbatch import FetchGroup, Key, SubBatch, SubPart, fetch_list, lay_out_subbatches, part_group, primary_payload
from batchplane.core.config import JobSettings
from batchplane.core.delivery import ALL, DeliveryRules, Variant
from batchplane.core.errors import FailedPrecondition
from batchplane.core.mesh import ClientPlaceTree


class Bucket(NamedTuple):
    """One bucket's plan."""

    source: np.ndarray  # int32 [n]
    seq: np.ndarray  # int64 [n]
    row: np.ndarray  # int64 [n]
    epoch: np.ndarray  # int32 [n]
    length: np.ndarray  # int32 [n]
    offsets: np.ndarray  # int64 [m + 1], microbatch offsets
    fetchers: int
    loaders: np.ndarray  # int32 [n]
    copies: np.ndarray  # int32 [n]: constructors fetching each sample (RankPlan.copies, else fetchers)
    digest: np.ndarray | None = None  # int64 [n]: what each sample's content must digest to (None: not checked)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A step's plan as building needs it (a decoded, checked GetPlan answer).

    Attributes:
        axis: The primary graph's axis, "DP" or "CP".
        global_loss_tokens: The step's loss tokens over all ranks.
        buckets: Each bucket's plan, by bucket.
        parts: The secondary graphs' parts.
    """

    step: int
    axis: str
    global_loss_tokens: int
    buckets: Mapping[int, Bucket]
    parts: Sequence[SubPart] = ()


@dataclasses.dataclass(frozen=True)
class Fetched:
    """The samples fetched for a step, by (source, seq).

    Attributes:
        tokens: Each sample's token ids.
        columns: Per declared payload column, each sample's view (`responses.sample_columns`).
    """

    tokens: Mapping[Key, np.ndarray]
    columns: Mapping[str, Mapping[Key, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Delivery:
    """What one rank receives for one step: its (possibly shared) batch, then `extra`."""

    batch: BuiltBatch
    rank: int
    variant: Variant
    subbatches: tuple[SubBatch, ...] = ()
    extra: bytes | bytearray = b""

    @property
    def payload_bytes(self) -> int:
        return len(self.batch.payload) + len(self.extra)


@dataclasses.dataclass(frozen=True)
class Served:
    """What building depends on besides the step: the job, the ranks served and how.

    Attributes:
        broadcast: Dimensions the trainer broadcasts along (the job's mesh as the planner says).
        hook: The strategy's constructor_do_plan hook, run on every bucket built with tensors.
    """

    job: JobSettings
    mesh: ClientPlaceTree
    ranks: tuple[int, ...]
    broadcast: frozenset[str] = frozenset()
    hook: Callable | None = None

    def variants(self, axis: str) -> dict[int, Variant]:
        """Each served rank's variant on the plan's axis."""
        rules = DeliveryRules(
            self.mesh, axis=axis or "DP", broadcast=self.broadcast, middle_tensors=self.job.constructors.pp_middle_tensors
        )
        return {rank: rules.variant(rank) for rank in self.ranks}

    def consumes(self, axis: str, bucket: int) -> bool:
        """Whether a served rank consumes `bucket` of `axis`."""
        return any(self.mesh.bucket_of(r, axis) == bucket for r in self.ranks)


def to_fetch(plan: StepPlan, served: Served, *, address: str) -> FetchGroup:
    """The samples to fetch for `plan`: those of the buckets served ranks get tensors of, and
    every sample of every delivering part, each once (`subbatch.fetch_list`).

    Args:
        address: The planner's address, for errors.
    Raises:
        FailedPrecondition: the plan lacks a bucket a served rank consumes.
        MalformedResponse: a sample listed with different lengths, copies or holders.
    """
    variants = served.variants(plan.axis)
    missing = sorted({v.bucket for v in variants.values()} - set(plan.buckets))
    if missing:
        raise FailedPrecondition(f"the plan of step {plan.step} lacks buckets {missing} this constructor's ranks consume")
    wanted = sorted({v.bucket for v in variants.values() if v.tensors})
    groups = [FetchGroup(b.source, b.seq, b.length, b.copies, b.loaders, b.digest) for b in (plan.buckets[w] for w in wanted)]
    return fetch_list(groups + [part_group(p) for p in plan.parts if p.columns], address=address)


def build_step(plan: StepPlan, fetched: Fetched, served: Served) -> list[Delivery]:
    """Every served rank's delivery of `plan`'s step, in `served.ranks` order (see the module
    docstring).

    Raises:
        KeyError: a sample to build that was not fetched.
        HookError: the constructor hook failed.
    """
    job, batch = served.job, served.job.batch
    variants = served.variants(plan.axis)
    wanted = {v.bucket for v in variants.values() if v.tensors}
    payload = primary_payload(batch.payload, plan.parts)  # delivered columns go to the subbatches
    pack_length = (batch.pack_length or job.balance.max_tokens or 2**31 - 1) if batch.packing else None
    built: dict[int, BuiltBatch] = {}
    for bucket in sorted({v.bucket for v in variants.values()}):
        b = plan.buckets[bucket]
        if bucket not in wanted:
            built[bucket] = metadata_only(
                step=plan.step,
                rank=bucket,
                lengths=b.length,
                offsets=b.offsets,
                global_loss_tokens=plan.global_loss_tokens,
                max_length=job.max_length,
                length_policy=batch.length_policy,
            )
            continue
        keys = [(int(k), int(s)) for k, s in zip(b.source, b.seq)]
        samples = RankSamples(
            tokens=[fetched.tokens[key] for key in keys],
            source=b.source,
            row=b.row,
            epoch=b.epoch,
            offsets=b.offsets,
            columns={c.name: [fetched.columns[c.name][key] for key in keys] for c in payload},
        )
        built[bucket] = assemble(
            samples,
            step=plan.step,
            rank=bucket,
            pad_id=batch.pad_id,
            ignore_id=batch.ignore_id,
            token_dtype=batch.token_dtype,
            global_loss_tokens=plan.global_loss_tokens,
            pack_length=pack_length,
            max_length=job.max_length,
            length_policy=batch.length_policy,
            payload=payload,
        )
        if served.hook is not None:
            built[bucket] = apply_constructor_hook(served.hook, built[bucket], sources=job.source_names)
    by_variant: dict[Variant, BuiltBatch] = {}
    deliveries = []
    for rank, v in variants.items():
        if v not in by_variant:
            whole = v.cp_rank is None and v.stage == ALL and v.tensors
            by_variant[v] = (
                built[v.bucket]
                if whole
                else derive(
                    built[v.bucket],
                    cp=served.mesh.sizes["cp"],
                    cp_rank=v.cp_rank,
                    cp_mode=job.constructors.cp_slicing,
                    stage=served.mesh.coords(rank).pp,
                    stages=served.mesh.sizes["pp"],
                    middle=job.constructors.pp_middle_tensors,
                    with_tensors=v.tensors,
                    pad_id=batch.pad_id,
                    ignore_id=batch.ignore_id,
                )
            )
        deliveries.append(_with_subplans(Delivery(by_variant[v], rank, v), plan.parts, fetched, served))
    return deliveries


def _with_subplans(delivery: Delivery, parts: Sequence[SubPart], fetched: Fetched, served: Served) -> Delivery:
    """Adds the secondary graphs' per-sample data of the rank (e.g. the images it encodes,
    with their pixels when the graph delivers them)."""
    mine = [p for p in parts if p.bucket == served.mesh.bucket_of(delivery.rank, p.axis)]
    if not mine:
        return delivery
    base = len(delivery.batch.payload)  # a multiple of 64: the extra tensors stay aligned
    subbatches, extra = lay_out_subbatches(
        mine, fetched.columns, served.job.batch.payload, step=delivery.batch.step, rank=delivery.rank, base=base
    )
    return dataclasses.replace(delivery, subbatches=subbatches, extra=extra)  # built once, never changed: no copy
