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
back). These rules live in the pure `progress.BuildProgress`; this class drives it and does the
I/O.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TypeVar

import grpc
import numpy as np
import pyarrow as pa

from batchplane.constructor.assemble import BuiltBatch, RankSamples, assemble, derive, metadata_only
from batchplane.constructor.bounds import MalformedResponse, check_plan_step
from batchplane.constructor.hooks import HookError, apply_constructor_hook
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.progress import BuildProgress
from batchplane.constructor.responses import plan_buckets, plan_subplans, receive_samples, sample_columns
from batchplane.constructor.subbatch import FetchGroup, SubBatch, SubPart, fetch_list, lay_out_subbatches, part_group, primary_payload
from batchplane.core.config import JobSettings
from batchplane.core.delivery import ALL, DeliveryRules, Variant
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from batchplane.core.rpc import call_with_retry, reraise
from batchplane.v1 import common_pb2, loader_pb2, loader_pb2_grpc, planner_pb2, planner_pb2_grpc
from batchplane.wire import encode_array

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The longest pause between retries of the planner: a restarted one is reached within it.
PLANNER_RETRY_BACKOFF_S = 0.25

#: Failed releases in a row at a loader that served earlier steps after which it counts as gone.
RELEASE_GIVE_UP = 20

#: How long building waits before it asks again a peer that answered a malformed response.
MALFORMED_BACKOFF_S = 0.25

#: How long a fetch retries an unreachable loader before the step is built again from a fresh
#: plan, which names the loader's shadow once the planner has promoted it.
FETCH_RETRY_S = 0.25


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
        self._broadcast = frozenset(info.mesh.broadcast_at) if info is not None else frozenset()
        self._hook = hook
        self._index = index
        self.ranks = tuple(ranks)
        self._metrics = metrics
        self._connect = connect
        self._planner_channel = connect(planner, "planner")
        self._planner = planner_pb2_grpc.PlannerStub(self._planner_channel)
        self._planner_address = planner
        self._loader_channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self._fetchers = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="fetch")
        self._holding: dict[str, int] = {}  # loader replica -> the last step fetched there, until released
        self._release_failures: dict[str, int] = {}  # loader replica -> releases there that failed in a row
        self._holding_lock = threading.Lock()
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
        self._resume: dict[str, str] = {}
        self._failure: FailedPrecondition | None = None
        self._planned = False  # the planner has answered a GetPlan: the job has started
        self._blocked: tuple[str, float] | None = None  # why building fails, and since when (monotonic)
        self._peer = "planner"  # the part the step being built waits on
        self._longest_wait: dict[int, float] = {}
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
            asked = self._steps.ask(rank, step, restart=restart)
            if asked.started:  # a restarted constructor starts where its slowest rank may be
                self._resume = dict(resume or {})
                log.info("starting at step %d", self._steps.start)
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
                why = ""
                if self._blocked is not None:
                    reason, since = self._blocked
                    why = f": the constructor has been retrying for {time.monotonic() - since:.1f} s: {reason}"
                raise Unavailable(f"batch of step {step} for rank {rank} not ready after {timeout_s:.1f} s{why}")
            waited = time.perf_counter() - begin
            self._metrics.batch_wait.observe(waited)
            self._metrics.rank_wait.labels(str(rank)).inc(waited)
            if waited > self._longest_wait.get(rank, 0.0):
                self._longest_wait[rank] = waited
                self._metrics.rank_longest_wait.labels(str(rank)).set(waited)
            self._metrics.prefetched_steps.set(max((self._steps.next - self._steps.slowest()) // self._steps.stride - 1, 0))
            if self._steps.finished():  # no later fetch will carry the release: send it now
                self._release_everywhere(self._steps.end)
            return self._ready.get((rank, step))

    def _release_everywhere(self, step: int) -> None:
        """Every loader that served this constructor frees what it holds for it (the end of
        data: every rank was handed every step)."""
        with self._holding_lock:
            held = list(self._holding)
        for address in held:
            self._fetchers.submit(self._release_at, address, step)

    def _delivered(self) -> int:
        """Every step below it was handed to all of this constructor's pulling ranks (each has
        asked for a later one)."""
        with self._cond:
            return self._steps.slowest()

    def rejoin_step(self) -> int | None:
        """The oldest step this constructor may still need planned (its ranks have not all been
        handed it; a restart would build it again); None until the planner has planned for it."""
        with self._cond:
            return self._steps.rejoin_step() if self._planned else None

    # ---- building --------------------------------------------------------------------------

    def _build_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._steps.to_build() is not None)
                if self._stopped:
                    return
                # No rank needs a step below its slowest rank's (a restarted constructor starts at
                # the oldest step its ranks may ask for; once they have asked, the rest are skipped).
                step, epoch = self._steps.to_build(), self._steps.epoch
                rewind = self._steps.plan_request(step)
            began = time.monotonic()
            try:
                built = self._build(step, rewind=rewind)
            except Unavailable as exc:  # a peer is slow or restarting: keep trying
                if self._stopped:
                    return
                log.warning("step %d: %s; retrying", step, exc)
                with self._cond:
                    if self._blocked is None:
                        self._metrics.peer_failures.labels(self._peer).inc()
                    since = self._blocked[1] if self._blocked is not None else began
                    self._blocked = (" ".join(str(exc).splitlines()), since)
                    if isinstance(exc, MalformedResponse):  # counted, and not asked again at once
                        self._metrics.malformed_responses.labels(exc.peer).inc()
                        self._cond.wait_for(lambda: self._stopped, timeout=MALFORMED_BACKOFF_S)
                continue
            except Exception as exc:  # noqa: BLE001 - refused, malformed or a bug: retrying cannot help
                log.exception("step %d cannot be built", step)
                with self._cond:
                    self._failure = exc if isinstance(exc, FailedPrecondition) else FailedPrecondition(f"step {step} cannot be built: {exc}")
                    self._cond.notify_all()
                return
            with self._cond:
                if self._blocked is not None:
                    self._metrics.recovery.observe(time.monotonic() - self._blocked[1])
                    log.info("step %d built after %.2f s of retrying", step, time.monotonic() - self._blocked[1])
                self._blocked = None
                if built is None:
                    self._steps.ended(step, epoch=epoch)
                    log.info("end of data at step %d", step)
                else:
                    by_rank = {delivery.rank: delivery for delivery in built}
                    for key in self._steps.built(step, by_rank, epoch=epoch):
                        self._ready[key] = by_rank[key[0]]
                    self._metrics.batches_built.inc(len(built))
                self._cond.notify_all()

    def _build(self, step: int, *, rewind: bool = False) -> list[Delivery] | None:
        self._peer = "planner"
        plan = self._get_plan(step, rewind=rewind)
        self._peer = "loader"
        if plan.end_of_data:
            return None
        rules = DeliveryRules(self.mesh, axis=plan.axis or "DP", broadcast=self._broadcast, middle_tensors=self._job.constructors.pp_middle_tensors)
        variants = {rank: rules.variant(rank) for rank in self.ranks}
        wanted = {v.bucket for v in variants.values() if v.tensors}
        buckets = plan_buckets(
            plan, asked=step, address=self._planner_address, constructors=self._job.constructor_count,
            max_samples=self._job.batch.global_batch_size, microbatches=self._job.batch.microbatches,
        )
        missing = sorted({v.bucket for v in variants.values()} - set(buckets))
        if missing:
            raise FailedPrecondition(f"the plan of step {step} lacks buckets {missing} this constructor's ranks consume")
        parts = plan_subplans(
            plan, address=self._planner_address, constructors=self._job.constructor_count, max_samples=self._job.batch.global_batch_size,
            payload=self._job.batch.payload, consumes=lambda axis, b: any(self.mesh.bucket_of(r, axis) == b for r in self.ranks),
        )
        # the buckets' samples and every delivering part's (`subbatch` module docstring), each once
        groups = [FetchGroup(buckets[b].source, buckets[b].seq, buckets[b].length, buckets[b].copies, buckets[b].loaders) for b in sorted(wanted)]
        fetch = fetch_list(groups + [part_group(p) for p in parts if p.columns], address=self._planner_address)
        tokens: dict[tuple[int, int], np.ndarray] = {}
        columns: dict[str, dict[tuple[int, int], np.ndarray]] = {c.name: {} for c in self._job.batch.payload}
        if len(fetch.seq):
            begin = time.perf_counter()
            tokens, columns = self._fetch(step, fetch.source, fetch.seq, fetch.copies, fetch.holders, fetch.length, list(plan.loader_addresses))
            self._metrics.fetch_latency.observe(time.perf_counter() - begin)
        begin = time.perf_counter()
        batch = self._job.batch
        payload = primary_payload(batch.payload, parts)  # delivered columns go to the subbatches
        pack_length = (batch.pack_length or self._job.balance.max_tokens or 2**31 - 1) if batch.packing else None
        built: dict[int, BuiltBatch] = {}
        for bucket, (source, seq, row, epoch, length, offsets, *_) in buckets.items():
            if bucket in wanted:
                keys = [(int(k), int(s)) for k, s in zip(source, seq)]
                samples = RankSamples(
                    tokens=[tokens[key] for key in keys], source=source, row=row, epoch=epoch, offsets=offsets,
                    columns={c.name: [columns[c.name][key] for key in keys] for c in payload},
                )
                built[bucket] = assemble(
                    samples, step=step, rank=bucket, pad_id=batch.pad_id, ignore_id=batch.ignore_id,
                    token_dtype=batch.token_dtype, global_loss_tokens=plan.global_loss_tokens, pack_length=pack_length,
                    max_length=self._job.max_length, length_policy=batch.length_policy, payload=payload,
                )
                if self._hook is not None:
                    try:
                        built[bucket] = apply_constructor_hook(self._hook, built[bucket], sources=self._job.source_names)
                    except HookError:
                        self._metrics.hook_failures.inc()
                        raise
            else:
                built[bucket] = metadata_only(
                    step=step, rank=bucket, lengths=length, offsets=offsets, global_loss_tokens=plan.global_loss_tokens,
                    max_length=self._job.max_length, length_policy=batch.length_policy,
                )
        variants_built: dict[Variant, BuiltBatch] = {}
        deliveries = []
        for rank, v in variants.items():
            if v not in variants_built:
                whole = v.cp_rank is None and v.stage == ALL and v.tensors
                variants_built[v] = built[v.bucket] if whole else derive(
                    built[v.bucket],
                    cp=self.mesh.sizes["cp"],
                    cp_rank=v.cp_rank,
                    cp_mode=self._job.constructors.cp_slicing,
                    stage=self.mesh.coords(rank).pp,
                    stages=self.mesh.sizes["pp"],
                    middle=self._job.constructors.pp_middle_tensors,
                    with_tensors=v.tensors,
                    pad_id=batch.pad_id,
                    ignore_id=batch.ignore_id,
                )
            deliveries.append(self._with_subplans(Delivery(variants_built[v], rank, v), parts, columns))
        self._metrics.build_latency.observe(time.perf_counter() - begin)
        return deliveries

    def _with_subplans(self, delivery: Delivery, parts: list[SubPart], columns: dict[str, dict[tuple[int, int], np.ndarray]]) -> Delivery:
        """Adds the secondary graphs' per-sample data of the rank (e.g. the images it encodes,
        with their pixels when the graph delivers them)."""
        mine = [p for p in parts if p.bucket == self.mesh.bucket_of(delivery.rank, p.axis)]
        if not mine:
            return delivery
        base = len(delivery.batch.payload)  # a multiple of 64: the extra tensors stay aligned
        subbatches, extra = lay_out_subbatches(mine, columns, self._job.batch.payload, step=delivery.batch.step, rank=delivery.rank, base=base)
        return dataclasses.replace(delivery, subbatches=subbatches, extra=extra)  # built once, never changed: no copy

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
        """How many steps the job has, as the planner says (waiting up to `wait_ms` for its
        loaders to register)."""
        request = planner_pb2.GetJobRequest(wait_ms=wait_ms)
        response = self._call_planner(lambda: self._planner.GetJob(request, timeout=wait_ms / 1000 + 10), "GetJob from")
        return response.length

    def _get_plan(self, step: int, *, rewind: bool = False) -> planner_pb2.GetPlanResponse:
        resume = self._resume if step == self._steps.start else {}
        request = planner_pb2.GetPlanRequest(
            constructor_index=self._index, step=step, wait_ms=5000, resume=resume, delivered_below=self._delivered(), rewind=rewind
        )

        def get_plan() -> planner_pb2.GetPlanResponse:
            try:
                return self._planner.GetPlan(request, timeout=10)
            except grpc.RpcError as exc:  # NOT_FOUND: the planner restarted and does not know us
                if self._rejoin is None or exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            log.warning("the planner does not know this constructor (it restarted): rejoining; its ranks need steps from %d", self._delivered())
            self._rejoin(self._delivered())
            return self._planner.GetPlan(request, timeout=10)

        plan = self._call_planner(get_plan, f"GetPlan(step {step}) from")
        check_plan_step(asked=step, step=plan.step, oldest_step=plan.oldest_step, peer="planner", address=self._planner_address)
        with self._cond:
            self._planned = True
            self._steps.oldest = plan.oldest_step
        return plan

    def _call_planner(self, call: Callable[[], T], what: str) -> T:
        """`call` retried while the planner is unavailable, within the job's RPC timeout."""
        try:
            return call_with_retry(
                call,
                what=f"{what} planner at {self._planner_address}",
                deadline_s=self._job.network.rpc_timeout_s,
                should_stop=lambda: self._stopped,
                max_backoff_s=PLANNER_RETRY_BACKOFF_S,
            )
        except grpc.RpcError as exc:
            raise reraise(exc, f"planner at {self._planner_address}") from exc

    def _fetch(
        self, step: int, sources: np.ndarray, seqs: np.ndarray, copies: np.ndarray, holders: np.ndarray, lengths: np.ndarray, addresses: list[str]
    ) -> tuple[dict[tuple[int, int], np.ndarray], dict[str, dict[tuple[int, int], np.ndarray]]]:
        """Token ids of every (source, seq) of the step (of planned `lengths`), and per declared
        payload column each one's values (`responses.sample_columns`), fetched in parallel from
        the loader replicas that hold them (`holders` indexes `addresses`)."""
        by_loader: dict[str, np.ndarray] = {}
        if len(holders) != len(seqs) or (len(holders) and not 0 <= holders.min() <= holders.max() < len(addresses)):
            raise FailedPrecondition(f"the plan of step {step} names loaders outside its {len(addresses)} loader addresses")
        for i in np.unique(holders):
            address = addresses[int(i)]
            if not address:
                raise Unavailable(f"the plan of step {step} has no address for a loader of sources {sorted(set(sources[holders == i].tolist()))}")
            by_loader[address] = holders == i
        jobs = {
            address: self._fetchers.submit(self._fetch_from, address, step, sources[mask], seqs[mask], copies[mask], lengths[mask])
            for address, mask in by_loader.items()
        }
        # Loaders that served earlier steps but not this one release what they hold for us too,
        # until every step they served was handed to our ranks (a replica that left its group
        # waits for that before it exits).
        with self._holding_lock:
            for address in set(self._holding) - set(jobs):
                self._fetchers.submit(self._release_at, address, step)
            self._holding.update((a, step) for a in jobs)
        tokens: dict[tuple[int, int], np.ndarray] = {}
        columns: dict[str, dict[tuple[int, int], np.ndarray]] = {c.name: {} for c in self._job.batch.payload}
        for address, job in jobs.items():
            table = job.result()
            values = table.column("input_ids").combine_chunks()
            flat = values.values.to_numpy()
            offsets = values.offsets.to_numpy()
            keys = [(int(k), int(s)) for k, s in zip(table.column("source").to_numpy(), table.column("seq").to_numpy())]
            for i, key in enumerate(keys):
                tokens[key] = flat[offsets[i] : offsets[i + 1]]
            for name, views in sample_columns(table, self._job.batch.payload).items():
                columns[name].update(zip(keys, views))
        return tokens, columns

    def _release_at(self, address: str, step: int) -> None:
        """Tells a loader that served earlier steps what this constructor's ranks were handed
        (a fetch of nothing), once per step built, until it is told every step it served was
        handed (then it is dropped), or RELEASE_GIVE_UP attempts in a row failed (it is gone: it
        left, or failed and was replaced)."""
        below = self._delivered()
        request = loader_pb2.FetchSamplesRequest(
            constructor_index=self._index,
            step=step,
            samples=common_pb2.SampleSet(source=encode_array(np.zeros(0, np.int32)), seq=encode_array(np.zeros(0, np.int64))),
            release_below_step=below,
        )
        try:
            for _ in self._loader(address).FetchSamples(request, timeout=min(self._job.network.rpc_timeout_s, 5.0)):
                pass
            failed = False
        except grpc.RpcError as exc:
            log.debug("release at loader %s, which served earlier steps: %s", address, exc.code().name)
            failed = True
        with self._holding_lock:
            if address not in self._holding:
                return
            if not failed:
                self._release_failures.pop(address, None)
                if below > self._holding[address]:  # it was told every step it served was handed
                    del self._holding[address]
                return
            self._release_failures[address] = self._release_failures.get(address, 0) + 1
            if self._release_failures[address] >= RELEASE_GIVE_UP:
                del self._holding[address], self._release_failures[address]

    def _loader(self, address: str) -> loader_pb2_grpc.LoaderStub:
        with self._channels_lock:
            channel = self._loader_channels.get(address)
            if channel is None:
                channel = self._loader_channels[address] = self._connect(address, "loader")
        return loader_pb2_grpc.LoaderStub(channel)

    def _fetch_from(self, address: str, step: int, sources: np.ndarray, seqs: np.ndarray, copies: np.ndarray, lengths: np.ndarray) -> pa.Table:
        request = loader_pb2.FetchSamplesRequest(
            constructor_index=self._index,
            step=step,
            samples=common_pb2.SampleSet(source=encode_array(sources), seq=encode_array(seqs)),
            # only what every rank was handed: a restarted constructor fetches the rest again
            release_below_step=self._delivered(),
            copies=encode_array(copies) if np.any(copies != 1) else None,
        )
        stub = self._loader(address)

        def attempt() -> pa.Table:
            stream = stub.FetchSamples(request, timeout=self._job.network.rpc_timeout_s)
            table, nbytes = receive_samples(
                stream, address=address, sources=sources, seqs=seqs, lengths=lengths, columns=self._job.batch.payload,
                max_bytes=self._job.loaders.buffer_bytes,
            )
            self._metrics.received_bytes.inc(nbytes)
            self._metrics.samples_received.inc(table.num_rows)
            return table

        try:
            return call_with_retry(
                attempt,
                what=f"FetchSamples(step {step}) from loader at {address}",
                deadline_s=min(self._job.network.rpc_timeout_s, FETCH_RETRY_S),
                should_stop=lambda: self._stopped,
            )
        except grpc.RpcError as exc:
            error = reraise(exc, f"loader at {address}")
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                # The loader does not hold what the plan says it does: retrying cannot help.
                raise FailedPrecondition(str(error)) from exc
            raise error from exc

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self._planner_channel.close()
        for channel in self._loader_channels.values():
            channel.close()

