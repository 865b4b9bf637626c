"""The Planner gRPC servicer: parses requests, bounds their fields (`bounds`), calls membership
and the plan book, builds responses. No logic of its own."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import numpy as np

from batchplane.core.config import JobSettings
from batchplane.core.delivery import DeliveryRules
from batchplane.core.errors import InvalidArgument, NotFound
from batchplane.core.rpc import wait_seconds
from batchplane.planner.book import PlanBook
from batchplane.planner.bounds import (
    MAX_NAME_CHARS,
    check_address,
    check_altered,
    check_max_steps,
    check_name,
    check_resume,
    check_source_files,
    check_step,
)
from batchplane.planner.dgraph import Strategy
from batchplane.planner.membership import Membership, SourceFacts
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.plan import SampleTable, StepPlan
from batchplane.planner.summaries import SummaryStore, route_messages
from batchplane.v1 import common_pb2, planner_pb2, planner_pb2_grpc
from batchplane.wire import encode_array

DEFAULT_WAIT_MS = 30_000
#: Steps whose per-sample fetcher counts the servicer keeps (`_sample_copies`).
COPIES_KEPT = 16

log = logging.getLogger(__name__)


def job_info(job: JobSettings, strategy: Strategy) -> common_pb2.JobInfo:
    """The job's description as every part sees it."""
    m = job.mesh
    return common_pb2.JobInfo(
        job_id=job.job,
        fingerprint=job.fingerprint,
        sources=job.source_names,
        mesh=common_pb2.Mesh(
            dp=m.dp,
            cp=m.cp,
            tp=m.tp,
            pp=m.pp,
            order=m.order,
            cp_slicing=job.constructors.cp_slicing,
            broadcast_at=sorted(strategy.broadcast),
        ),
        global_batch_size=job.batch.global_batch_size,
        microbatches=job.batch.microbatches,
        hooks=common_pb2.Hooks(**strategy.hook_names()),
        fingerprints=job.fingerprints,
        format=common_pb2.BatchFormat(
            pad_id=job.batch.pad_id,
            ignore_id=job.batch.ignore_id,
            labels="next_token",
            packing=job.batch.packing,
            pack_length=job.batch.pack_length or 0,
            max_length=job.max_length or 0,
            length_policy=job.batch.length_policy,
            payload=[
                common_pb2.PayloadColumn(name=c.name, kind=c.kind, dtype=c.dtype, shape=c.shape, fill=c.fill) for c in job.batch.payload
            ],
        ),
    )


def sample_set(table: SampleTable, *, digests: bool = True) -> common_pb2.SampleSet:
    """A plan's samples; `digests`: with their digests (the constructors check what loaders send)."""
    return common_pb2.SampleSet(
        source=encode_array(table.source),
        seq=encode_array(table.seq),
        row=encode_array(table.row),
        length=encode_array(table.length),
        epoch=encode_array(table.epoch),
        digest=encode_array(table.digest) if digests else None,
    )


def subplan_parts(
    plan: StepPlan,
    ranks: tuple[int, ...],
    book: PlanBook,
    *,
    holders: Callable[[SampleTable], np.ndarray],
    copies: np.ndarray | None,
    digests: bool = True,
) -> list[planner_pb2.SubPlanPart]:
    """The secondary graphs' parts for the buckets `ranks` consume; a graph that delivers
    payload columns says who holds each sample (`holders`) and how many fetch it (`copies`);
    `digests`: the samples' digests with them (`sample_set`)."""
    parts = []
    for sub in plan.subplans:
        for bucket in sorted({book.mesh.bucket_of(r, sub.axis) for r in ranks}):
            index = sub.buckets[bucket]
            samples = plan.samples.take(index)
            part = planner_pb2.SubPlanPart(
                name=sub.name,
                axis=sub.axis,
                metadata=sub.metadata,
                bucket=bucket,
                samples=sample_set(samples, digests=digests),
                values=encode_array(sub.values[index]),
            )
            if sub.columns:
                part.columns.extend(sub.columns)
                part.loaders.CopyFrom(encode_array(holders(samples)))
                part.copies.CopyFrom(encode_array(copies[index]))
            parts.append(part)
    return parts


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    """The Planner service.

    Args:
        fence: Fences a loader replica a constructor reports for altered samples
            (`watch.ReplicaWatch.fence`; default: none is).
    """

    def __init__(
        self,
        job: JobSettings,
        membership: Membership,
        book: PlanBook,
        store: SummaryStore,
        metrics: PlannerMetrics,
        *,
        fence: Callable[..., None] = lambda group, address, **_: None,
    ) -> None:
        self._job = job
        self._fence = fence
        # A loader_do_plan hook rewrites what loaders send: their samples cannot match the
        # digests of what they read, so plans carry none and constructors check none.
        self._digests = not book.strategy.hook_names().get("loader_do_plan")
        self._store = store
        self._metrics = metrics
        self._info = job_info(job, book.strategy)
        self._fingerprints = job.fingerprints
        self._membership = membership
        self._book = book
        self._rules = DeliveryRules(
            book.mesh,
            axis=book.strategy.primary.axis,
            broadcast=book.strategy.broadcast,
            middle_tensors=job.constructors.pp_middle_tensors,
            pulling_ranks=job.constructors.pulling_ranks,
        )
        self._layout = job.fetch_layout  # who fetches a step's samples (with journal delivery: its one producer)
        self._stride = job.build_stride
        self._fetchers = self._rules.fetchers(self._layout)
        self._copies: dict[int, np.ndarray] = {}  # step -> per-sample fetchers, when they differ
        self._copies_lock = threading.Lock()

    def RegisterLoader(
        self, request: planner_pb2.RegisterLoaderRequest, context: grpc.ServicerContext
    ) -> planner_pb2.RegisterLoaderResponse:
        check_address("address", request.address)
        for field in ("replica", "incarnation", "shadow_of"):
            check_name(field, getattr(request, field))
        facts = [
            SourceFacts(
                name=s.name,
                num_rows=s.num_rows,
                row_group_sizes=tuple(s.row_group_sizes),
                files=check_source_files(s.name[:MAX_NAME_CHARS], s.num_rows, s.files),
            )
            for s in request.sources
        ]
        joined = self._membership.register_loader(
            request.loader_index,
            request.address,
            facts,
            replica=request.replica,
            incarnation=request.incarnation,
            shadow_of=request.shadow_of,
        )
        if joined.restarted:
            self._metrics.loader_restarts.labels(str(request.loader_index)).inc()
        if joined.displaced:
            log.warning(
                "loader group %d: dropped the replicas registered before, which reported other source facts than the job's ledger "
                "records; this loader reports those",
                request.loader_index,
            )
        self._book.notify_membership()
        return planner_pb2.RegisterLoaderResponse(job=self._info, restore=self._restore(request.loader_index), shadow=joined.shadow)

    def _restore(self, index: int) -> list[planner_pb2.SourceRestore]:
        """Where loader group `index`'s sources stand, for a replica that (re)starts mid-job."""
        cursors = self._book.restore_point()
        if cursors is None:
            return []
        store = self._store
        return [
            planner_pb2.SourceRestore(
                source=k,
                from_seq=cursors[k],
                through_seq=max(through, cursors[k]),
                routes=route_messages(routing),
                planned_seq=store.cursor(k),
                planned_steps=store.planned_steps,
                delivered_below=store.delivered_below,
            )
            for k, through, routing in self._membership.restore_targets(index)
        ]

    def DeregisterLoader(
        self, request: planner_pb2.DeregisterLoaderRequest, context: grpc.ServicerContext
    ) -> planner_pb2.DeregisterLoaderResponse:
        drain = self._membership.deregister_loader(request.loader_index, check_name("replica", request.replica))
        return planner_pb2.DeregisterLoaderResponse(drain_through=drain)

    def RegisterConstructor(
        self, request: planner_pb2.RegisterConstructorRequest, context: grpc.ServicerContext
    ) -> planner_pb2.RegisterConstructorResponse:
        check_address("address", request.address)
        if request.rejoin:  # believed up to what the planner planned (`progress.PlanProgress.delivered`)
            check_step("next_step", request.next_step)
        self._membership.register_constructor(
            request.constructor_index, request.address, list(request.ranks), next_step=request.next_step if request.rejoin else None
        )
        resume_step = -1
        if not request.rejoin:
            resume_step = self._book.constructor_restarted(request.constructor_index)
        else:
            self._book.constructor_delivered(request.constructor_index, request.next_step)
        self._book.notify_membership()
        return planner_pb2.RegisterConstructorResponse(job=self._info, resume_step=resume_step, oldest_step=self._book.oldest_step)

    def GetJob(self, request: planner_pb2.GetJobRequest, context: grpc.ServicerContext) -> planner_pb2.GetJobResponse:
        self._book.wait_ready(timeout_s=wait_seconds(request.wait_ms, context))
        length = self._book.length()
        return planner_pb2.GetJobResponse(
            job=self._info,
            ready=self._membership.ready,
            length=common_pb2.JobLength(
                num_steps=length.num_steps or 0, infinite=length.infinite, unknown=length.unknown, exact=length.exact
            ),
        )

    def GetPlan(self, request: planner_pb2.GetPlanRequest, context: grpc.ServicerContext) -> planner_pb2.GetPlanResponse:
        ranks = self._membership.constructor_ranks(request.constructor_index)
        if ranks is None:  # NOT_FOUND tells a constructor whose planner restarted to register again
            raise NotFound(f"constructor {request.constructor_index} has not registered")
        check_step("step", request.step)
        max_steps = check_max_steps(request.max_steps, self._job.constructors.fetch_steps)
        check_altered(request.altered, sources=len(self._job.sources))
        for a in request.altered:  # before planning: this answer names the replicas serving in their place
            where = f"{a.count} sample(s) of step {a.step}, first: source {self._job.source_names[a.source]!r} position {a.seq}"
            self._fence(self._job.loader_of(a.source), a.loader_address, constructor=request.constructor_index, where=where)
        if request.step % self._stride != request.constructor_index % self._stride:
            raise InvalidArgument(
                f"step {request.step} is journal producer {request.step % self._stride}'s, not constructor "
                f"{request.constructor_index}'s (journal.producers = {self._stride}: producer i builds the steps s with s % {self._stride} == i)"
            )
        plan = self._book.plan_for(
            request.constructor_index,
            request.step,
            timeout_s=wait_seconds(request.wait_ms, context, default_ms=DEFAULT_WAIT_MS),
            resume=check_resume(request.resume, self._fingerprints),
            delivered_below=min(max(request.delivered_below, 0), request.step),  # its ranks were handed no step it has not asked for
            rewind=request.rewind,
        )
        if plan is None:
            return planner_pb2.GetPlanResponse(step=request.step, end_of_data=True)
        answer = self._answer(plan, ranks)
        following = [plan.step + i * self._stride for i in range(1, max_steps)]
        answer.following.extend(self._answer(p, ranks) for p in self._book.following(following))
        return answer

    def _answer(self, plan: StepPlan, ranks: tuple[int, ...]) -> planner_pb2.GetPlanResponse:
        """The part of `plan` that the constructor serving `ranks` builds."""
        mesh = self._book.mesh
        rank_plans = []
        addresses: dict[str, int] = {}
        copies = self._sample_copies(plan)
        for bucket in sorted({mesh.bucket_of(r, plan.axis) for r in ranks}):
            samples, offsets = plan.rank_samples(bucket)
            rank_plan = planner_pb2.RankPlan(
                dp_rank=bucket,
                samples=sample_set(samples, digests=self._digests),
                microbatch_offsets=encode_array(offsets),
                fetchers=self._fetchers[bucket],
                loaders=encode_array(self._holders(samples, addresses)),
            )
            if copies is not None:
                rank_plan.copies.CopyFrom(encode_array(copies[plan.bucket_index(bucket)]))
            rank_plans.append(rank_plan)
        subplans = subplan_parts(
            plan, ranks, self._book, holders=lambda samples: self._holders(samples, addresses), copies=copies, digests=self._digests
        )
        return planner_pb2.GetPlanResponse(
            step=plan.step,
            ranks=rank_plans,
            loader_addresses=list(addresses),
            global_loss_tokens=plan.loss_tokens,
            axis=plan.axis,
            subplans=subplans,
            oldest_step=self._book.oldest_step,
        )

    def _sample_copies(self, plan: StepPlan) -> np.ndarray | None:
        """int32 [samples]: how many constructors fetch each sample of the step, when a secondary
        graph delivers payload columns (then they differ); None otherwise (`fetchers` per bucket).
        Kept for the last few steps asked for: every constructor asks for the same ones."""
        delivering = [(sub.axis, sub.buckets) for sub in plan.subplans if sub.columns]
        if not delivering:
            return None
        with self._copies_lock:
            copies = self._copies.get(plan.step)
        if copies is None:
            buckets = [plan.bucket_index(b) for b in range(len(plan.microbatches))]
            copies = self._rules.sample_fetchers(self._layout, buckets, delivering, len(plan.samples.seq))
            with self._copies_lock:
                self._copies[plan.step] = copies
                for step in sorted(self._copies)[:-COPIES_KEPT]:
                    del self._copies[step]
        return copies

    def Report(self, request: common_pb2.ReportRequest, context: grpc.ServicerContext) -> common_pb2.ReportResponse:
        check_step("step", request.step)
        for name in request.losses:
            check_name("losses: a source name", name)
        accepted, reason = self._book.report(request.step, dict(request.losses))
        return common_pb2.ReportResponse(accepted=accepted, reason=reason)

    def _holders(self, samples: SampleTable, addresses: dict[str, int]) -> np.ndarray:
        """int32 [n]: per sample, its holder's index in `addresses` (filled as new ones appear)."""
        out = np.zeros(len(samples.seq), np.int32)
        for k in np.unique(samples.source):
            mask = samples.source == k
            out[mask] = [addresses.setdefault(a, len(addresses)) for a in self._membership.holders(int(k), samples.seq[mask])]
        return out

    def GetStatus(self, request: planner_pb2.GetStatusRequest, context: grpc.ServicerContext) -> planner_pb2.GetStatusResponse:
        ledger = self._book.ledger
        weights = self._book.shares
        return planner_pb2.GetStatusResponse(
            job=self._info,
            steps_planned=self._book.steps_planned,
            end_step=-1 if self._book.end_step is None else self._book.end_step,
            finished=self._book.finished,
            sources=[
                planner_pb2.SourceStatus(
                    name=name,
                    target_weight=float(w),
                    samples=t.samples,
                    tokens=t.tokens,
                    bad_samples=t.bad_samples,
                    target_samples=t.target_samples,
                    configured_samples=t.configured_samples,
                )
                for name, w, t in zip(self._job.source_names, weights, ledger.sources)
            ],
            balance=[
                planner_pb2.BalanceFigure(method=method, mean_max_over_min=t.mean_max_over_min, mean_max_over_mean=t.mean_max_over_mean)
                for method, t in ledger.balance.items()
            ],
        )
