"""The constructor's prefetch pipeline: for each step, in order, it asks the planner for the plan
of the ranks it serves, fetches their samples from the loaders (in parallel), builds every
rank's microbatches and keeps them until the rank has moved on.

Ranks are global ranks of the job's mesh. Each step, the pipeline fetches the samples of every
bucket its ranks consume once (TP peers, CP peers and pipeline stages in this pod share one
fetch), builds the bucket's microbatches, and then each rank's variant (`delivery`): TP peers
get the very same built batch (I3), CP ranks their slices, pipeline stages their part.

It builds up to `prefetch_steps` steps past the slowest of its ranks. The first step a rank
asks for is where it starts (a resumed trainer asks for the step after its checkpoint). Asking
for step s tells the pipeline the rank is done with earlier steps; their batches are dropped,
and asking for them again is refused unless the trainer restarted (a rewind: building goes
back). These rules live in the pure `progress.BuildProgress`, a step's deliveries come from the
pure `build.build_step`, and the loader calls from `fetcher.Fetcher`. With
`constructors.fetch_steps` > 1 the planner's answer carries the plans of the following steps
it has planned, and one call per loader fetches their samples with the step's; what the pure
`lookahead.Lookahead` keeps of them is used in their turn. This class is the driver: the build
thread, the planner's calls, the trainers' waits and the metrics.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from batchplane.constructor.blocked import Blocked
from batchplane.constructor.bounds import MalformedResponse, check_following, check_plan_step
from batchplane.constructor.build import Delivery, Fetched, Served, StepPlan, build_step, to_fetch
from batchplane.constructor.fetcher import Fetcher, StepFetch
from batchplane.constructor.hooks import HookError
from batchplane.constructor.lookahead import Lookahead
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.progress import BuildProgress, PlanRequest
from batchplane.constructor.responses import step_plan
from batchplane.core.config import JobSettings
from batchplane.core.delivery import DeliveryRules
from batchplane.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.rpc import call_with_retry, reraise
from batchplane.v1 import common_pb2, planner_pb2, planner_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The longest pause between retries of the planner: a restarted one is reached within it.
PLANNER_RETRY_BACKOFF_S = 0.25


@dataclasses.dataclass(frozen=True)
class _Planned:
    """A step's plan as used here: decoded, its samples to fetch, the oldest step a rewind can reach."""

    plan: StepPlan
    fetch: StepFetch
    oldest_step: int


class StepPipeline:
    """Builds the batches of one constructor's ranks ahead of their trainers.

    Args:
        job: The job's settings.
        index: This constructor's index.
        ranks: The data-parallel ranks it serves.
        planner: The planner's address.
        metrics: The constructor's metrics.
        connect: Opens a channel to (address, role of the part there: "planner" or "loader").
        info: The job as the planner describes it (its mesh says what the trainer broadcasts).
        hook: The strategy's constructor_do_plan hook, run on every microbatch built.
        rejoin: Registers again with a restarted planner, saying the step needed next.
        resume_step: Where a constructor restarted mid-job starts building: the oldest step its
            ranks may still ask for (None: the first step a rank asks for).
        oldest_step: The oldest step a rewind can go back to, as the planner said at
            registration (every plan says it again).
    """

    def __init__(
        self,
        job: JobSettings,
        *,
        index: int,
        ranks: Sequence[int],
        planner: str,
        metrics: ConstructorMetrics,
        connect: Callable[[str, str], grpc.Channel],
        info: common_pb2.JobInfo | None = None,
        hook: Callable | None = None,
        rejoin: Callable[[int], None] | None = None,
        resume_step: int | None = None,
        oldest_step: int = 0,
    ) -> None:
        self._job = job
        self._rejoin = rejoin
        m = job.mesh
        self.mesh = ClientPlaceTree(pp=m.pp, dp=m.dp, cp=m.cp, tp=m.tp, order=m.order)
        self.ranks = tuple(ranks)
        broadcast = frozenset(info.mesh.broadcast_at) if info is not None else frozenset()
        self._served = Served(job, self.mesh, self.ranks, broadcast=broadcast, hook=hook)
        self._index = index
        self._metrics = metrics
        #: Steps one GetBatch call may carry (`JobSettings.batch_steps`).
        self.batch_steps = job.batch_steps
        self._planner_channel = connect(planner, "planner")
        self._planner = planner_pb2_grpc.PlannerStub(self._planner_channel)
        self._planner_address = planner
        self._cond = threading.Condition()
        self._ready: dict[tuple[int, int], Delivery] = {}
        rules = DeliveryRules(self.mesh, pulling_ranks=job.constructors.pulling_ranks)
        self._steps = BuildProgress(
            self.ranks,
            pulling=[r for r in self.ranks if rules.pulls(r)],
            prefetch_steps=job.constructors.prefetch_steps,
            resume_step=resume_step,
            oldest=oldest_step,
            stride=job.build_stride,
            offset=index % job.build_stride,
        )
        self._ahead: Lookahead[_Planned, Fetched] = Lookahead(job.constructors.fetch_steps)  # the build thread's
        self._fetcher = Fetcher(
            job, index=index, metrics=metrics, connect=connect, delivered=self._delivered, stopped=lambda: self._stopped
        )
        self._failure: FailedPrecondition | None = None
        self._blocked = Blocked()  # why building fails, since when, and how it tries again
        self._peer = "planner"  # the part the step being built waits on
        self._stopped = False
        self._thread = threading.Thread(target=self._build_loop, name="build", daemon=True)
        self._thread.start()

    # ---- trainer side ----------------------------------------------------------------------

    def batch(
        self, rank: int, step: int, *, timeout_s: float, resume: dict[str, str] | None = None, restart: bool = False
    ) -> Delivery | None:
        """Rank `rank`'s batch of `step`, waiting up to `timeout_s`; None past the end of data.
        `resume`: the fingerprints of the checkpoint the rank resumed from, passed on to the
        planner with the first plan asked for; `restart`: the rank's trainer (re)starts at
        `step` (a step it has moved past is then a rewind, built again).

        Raises:
            InvalidArgument: a rank this constructor does not serve.
            FailedPrecondition: without `restart`, a step before the start or one the rank has
                moved past; a rewind the planner refuses (before its ledger's horizon).
            Unavailable: not ready in time; retry.
        """
        if rank not in self.ranks:
            raise InvalidArgument(
                f"rank {rank} is not served here: this constructor serves ranks {list(self.ranks)} "
                f"of a mesh of {self.mesh.world} ranks ({self.mesh.describe()})"
            )
        begin = time.perf_counter()
        with self._cond:
            asked = self._steps.ask(rank, step, restart=restart, resume=resume)
            if asked.started:  # a restarted constructor starts where its slowest rank may be
                log.info("starting at step %d", self._steps.start)
                self._metrics.start_step.set(self._steps.start)
            elif asked.rewound:
                log.info("rank %d restarted at step %d: building again from step %d", rank, step, self._steps.next)
                self._metrics.rewinds.inc()
            for key in asked.drop:
                self._ready.pop(key, None)
            self._cond.notify_all()
            done = self._cond.wait_for(
                lambda: self._steps.is_ready(rank, step) or self._steps.past_end(step) or self._failure is not None or self._stopped,
                timeout=timeout_s,
            )
            if self._failure is not None:
                raise self._failure
            if self._stopped:
                raise Unavailable("the constructor is stopping")
            if not done:
                why = self._blocked.why(time.monotonic())
                raise Unavailable(f"batch of step {step} for rank {rank} not ready after {timeout_s:.1f} s{why}")
            self._waited(time.perf_counter() - begin)
            self._release_if_finished()
            return self._ready.get((rank, step))

    def following(self, rank: int, step: int, *, asked: int, timeout_s: float) -> Delivery | None:
        """Rank `rank`'s batch of `step`, a step after `asked` (the step its call asked for,
        `batch`) that the same call carries (`GetBatchRequest.max_steps`), waiting up to
        `timeout_s` for it to be built; once returned, it counts as handed (`BuildProgress.hand`).
        None ends the call's batches: the step is past the end of data, not built in time, the
        rank asked for another step since (a newer call), or building failed or stopped (the
        next request says why).
        """
        begin = time.perf_counter()
        with self._cond:
            done = self._cond.wait_for(
                lambda: (
                    self._steps.asked(rank) != asked
                    or self._steps.is_ready(rank, step)
                    or self._steps.past_end(step)
                    or self._failure is not None
                    or self._stopped
                ),
                timeout=timeout_s,
            )
            if not done or self._steps.asked(rank) != asked:
                return None
            if self._steps.past_end(step):  # the call was handed every step: the rank reached the end
                self._steps.hand(rank, step)
                self._release_if_finished()
                return None
            if not self._steps.is_ready(rank, step):
                return None
            self._steps.hand(rank, step)
            self._cond.notify_all()  # building may run further ahead
            self._waited(time.perf_counter() - begin)
            return self._ready.get((rank, step))

    def told_end(self, rank: int, step: int) -> int:
        """The end of data told to rank `rank` with its batch of `step` (`BuildProgress.told_end`)."""
        with self._cond:
            end = self._steps.told_end(rank, step)
            self._release_if_finished()
            return end

    def _release_if_finished(self) -> None:
        """No later fetch will carry the release once every pulling rank reached the end: sent now."""
        if self._steps.finished() and self._steps.end is not None:
            self._fetcher.release_everywhere(self._steps.end)

    def _waited(self, waited: float) -> None:
        """A batch was ready after `waited` seconds (under the lock)."""
        self._metrics.batch_wait.observe(waited)
        self._metrics.prefetched_steps.set(self._steps.prefetched())

    def _delivered(self) -> int:
        """Every step below it was handed to all of this constructor's pulling ranks."""
        with self._cond:
            return self._steps.slowest()

    def rejoin_step(self) -> int | None:
        """The oldest step this constructor may still need planned (`BuildProgress.rejoin_step`)."""
        with self._cond:
            return self._steps.rejoin_step()

    def end_step(self) -> int | None:
        """The first step past the data, once a plan said so; None before."""
        with self._cond:
            return self._steps.end

    # ---- building --------------------------------------------------------------------------

    def _build_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._steps.to_build() is not None)
                if self._stopped:
                    return
                step, epoch = self._steps.to_build(), self._steps.epoch
                if step is None:
                    continue
                request = self._steps.plan_request(step)
            began = time.monotonic()
            try:
                built = self._build(request, epoch=epoch, abandoned=lambda: self._steps.epoch != epoch)
            except Unavailable as exc:  # a peer is slow or restarting: keep trying
                self._ahead.failed()
                if self._stopped:
                    return
                malformed = isinstance(exc, MalformedResponse)  # counted, and not asked again at once
                with self._cond:
                    retry = self._blocked.failed(step, str(exc), peer=self._peer, began=began, now=time.monotonic(), malformed=malformed)
                    if retry.first:
                        self._metrics.peer_failures.labels(self._peer).inc()
                    if retry.say:
                        log.warning("%s", retry.say)
                    if isinstance(exc, MalformedResponse):
                        self._metrics.malformed_responses.labels(exc.peer).inc()
                    self._cond.wait_for(lambda: self._stopped or self._steps.epoch != epoch, timeout=retry.wait_s)
                continue
            except Exception as exc:  # noqa: BLE001 - refused, malformed or a bug: retrying cannot help
                log.exception("step %d cannot be built", step)
                with self._cond:
                    self._failure = (
                        exc if isinstance(exc, FailedPrecondition) else FailedPrecondition(f"step {step} cannot be built: {exc}")
                    )
                    self._cond.notify_all()
                return
            with self._cond:
                blocked_s = self._blocked.built(time.monotonic())
                if blocked_s is not None:
                    self._metrics.recovery.observe(blocked_s)
                    log.info("step %d built after %.2f s of retrying", step, blocked_s)
                if built is None:
                    self._steps.ended(step, epoch=epoch)
                    log.info("end of data at step %d", step)
                else:
                    by_rank = {delivery.rank: delivery for delivery in built}
                    for key in self._steps.built(step, by_rank, epoch=epoch):
                        self._ready[key] = by_rank[key[0]]
                    self._metrics.batches_built.inc(len(built))
                self._cond.notify_all()

    def _build(self, request: PlanRequest, *, epoch: int, abandoned: Callable[[], bool]) -> list[Delivery] | None:
        """The deliveries of the step `request` asks the plan of, in build epoch `epoch`; None
        past the end of data. Plan and samples come from an earlier step's fetch (`lookahead`),
        else from the planner and the loaders (with the following steps', kept for their turn).
        Retrying the planner stops once `abandoned()` (a rank rewound), so a rewind waits for
        one planner call at most, not for the retries of a step the planner cannot plan yet."""
        self._peer = "planner"
        planned = self._ahead.plan(request.step, epoch=epoch, plain=not request.rewind and not request.resume)
        if planned is None:
            answer = self._get_plan(request, abandoned=abandoned)
            if answer.end_of_data:
                return None
            planned = self._planned(answer, asked=request.step)
            self._ahead.keep_plans({f.step: self._planned(f, asked=f.step) for f in answer.following}, epoch=epoch)
        else:
            with self._cond:
                self._steps.planned(planned.oldest_step)
        self._peer = "loader"
        fetched = self._ahead.fetched(request.step, epoch=epoch)
        if fetched is None:
            following = self._ahead.following(request.step, epoch=epoch)
            got = self._fetcher.fetch([planned.fetch, *(p.fetch for _, p in following)])
            fetched = got.pop(request.step)
            self._ahead.keep_fetched(got, epoch=epoch)
        begin = time.perf_counter()
        try:
            deliveries = build_step(planned.plan, fetched, self._served)
        except HookError:
            self._metrics.hook_failures.inc()
            raise
        self._metrics.build_latency.observe(time.perf_counter() - begin)
        return deliveries

    def _planned(self, answer: planner_pb2.GetPlanResponse, *, asked: int) -> _Planned:
        """A GetPlan answer to a request for step `asked` (or one of the following plans that
        came with it), decoded and checked, with the samples to fetch for it.

        Raises:
            MalformedResponse: see `responses.step_plan`.
            FailedPrecondition: the plan lacks a bucket a served rank consumes.
        """
        address = self._planner_address
        plan = step_plan(answer, asked=asked, address=address, job=self._job, consumes=self._served.consumes)
        fetch = StepFetch(plan.step, to_fetch(plan, self._served, address=address), tuple(answer.loader_addresses))
        return _Planned(plan, fetch, answer.oldest_step)

    def report(self, request: common_pb2.ReportRequest) -> common_pb2.ReportResponse:
        """Forwards a trainer's training report to the planner, for a step built here
        (`BuildProgress.reportable`).

        Raises:
            FailedPrecondition: a step no rank here has been built.
        """
        with self._cond:
            reason = self._steps.reportable(request.step)
        if reason:
            return common_pb2.ReportResponse(accepted=False, reason=reason)
        return self._call_planner(lambda: self._planner.Report(request, timeout=10), f"Report(step {request.step}) to")

    def job_length(self, *, wait_ms: int) -> common_pb2.JobLength:
        """How many steps the job has, as the planner says (waiting up to `wait_ms` for its loaders)."""
        request = planner_pb2.GetJobRequest(wait_ms=wait_ms)
        return self._call_planner(lambda: self._planner.GetJob(request, timeout=wait_ms / 1000 + 10), "GetJob from").length

    def _get_plan(self, ask: PlanRequest, *, abandoned: Callable[[], bool]) -> planner_pb2.GetPlanResponse:
        request = planner_pb2.GetPlanRequest(
            constructor_index=self._index,
            step=ask.step,
            max_steps=self._ahead.steps,
            wait_ms=5000,
            resume=ask.resume,
            delivered_below=ask.delivered_below,
            rewind=ask.rewind,
            altered=self._fetcher.altered(),
        )

        def get_plan() -> planner_pb2.GetPlanResponse:
            try:
                return self._planner.GetPlan(request, timeout=10)
            except grpc.RpcError as exc:
                if self._rejoin is None:
                    raise
                with self._cond:
                    step = self._steps.rejoin_after(reraise(exc, f"planner at {self._planner_address}"))
                if step is None:
                    raise
            log.warning("the planner does not know this constructor (it restarted): rejoining; its ranks need steps from %d", step)
            self._rejoin(step)
            return self._planner.GetPlan(request, timeout=10)

        plan = self._call_planner(get_plan, f"GetPlan(step {ask.step}) from", abandoned=abandoned)
        check_plan_step(asked=ask.step, step=plan.step, oldest_step=plan.oldest_step, peer="planner", address=self._planner_address)
        check_following(
            asked=ask.step,
            steps=[f.step for f in plan.following],
            stride=self._steps.stride,
            max_steps=self._ahead.steps,
            ends=[f.end_of_data for f in plan.following],
            nested=[len(f.following) for f in plan.following],
            address=self._planner_address,
        )
        with self._cond:
            self._steps.planned(plan.oldest_step)
        return plan

    def _call_planner(self, call: Callable[[], T], what: str, *, abandoned: Callable[[], bool] = lambda: False) -> T:
        """`call` retried while the planner is unavailable, within the RPC timeout, until stopped or `abandoned()`."""
        try:
            return call_with_retry(
                call,
                what=f"{what} planner at {self._planner_address}",
                deadline_s=self._job.network.rpc_timeout_s,
                should_stop=lambda: self._stopped or abandoned(),
                max_backoff_s=PLANNER_RETRY_BACKOFF_S,
            )
        except grpc.RpcError as exc:
            raise reraise(exc, f"planner at {self._planner_address}") from exc

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._fetcher.close()
        self._planner_channel.close()
