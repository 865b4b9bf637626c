"""Wires the planner together: membership, summary pulling, the plan book, its durable ledger
(`ledger.location`, else `<run_dir>/ledger`; a bucket is proved to honour conditional writes,
and the planner claims the next writer epoch, see `fencing`) and the gRPC server."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket

import grpc
from grpc_health.v1.health import HealthServicer
from prometheus_client import CollectorRegistry

from batchplane.core.config import JobSettings
from batchplane.core.process import EXIT_FENCED, ProcessSettings
from batchplane.core.rpc import RpcSettings, ServerMetrics, create_channel, create_grpc_server, serving_status, set_serving
from batchplane.planner.book import PlanBook
from batchplane.planner.fencing import Fenced, FencedStorage, claim_epoch
from batchplane.planner.journal import open_ledger_storage
from batchplane.planner.membership import Membership
from batchplane.planner.metrics import PlannerMetrics
from batchplane.planner.service import PlannerServicer
from batchplane.planner.strategy import load_schedule, load_strategy
from batchplane.planner.substitute import MAX_SEARCH
from batchplane.planner.window import window_steps
from batchplane.planner.summaries import SummaryPuller, SummaryStore
from batchplane.planner.watch import ReplicaWatch
from batchplane.v1 import planner_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunningPlanner:
    address: str
    server: grpc.Server
    book: PlanBook
    puller: SummaryPuller
    watch: ReplicaWatch
    health: HealthServicer

    def serving(self) -> bool:
        return serving_status(self.health)

    def stop(self, grace_s: float) -> None:
        self.watch.stop()
        self.puller.stop()
        self.book.stop()  # first: wakes requests waiting for plans
        self.server.stop(grace_s).wait()


def summary_lookahead(job: JobSettings, *, window: int = 1) -> int:
    """Samples per source the planner wants to know ahead of its cursor: two full steps, and at
    least a whole planning window of `window` steps (which it needs before planning it) and the
    substitutes of its bad samples after it (`substitute.MAX_SEARCH`)."""
    return max(min(max(2 * job.batch.global_batch_size, 256), 65536), window * job.batch.global_batch_size + MAX_SEARCH)


def start_planner(job: JobSettings, process: ProcessSettings, registry: CollectorRegistry, rpc: RpcSettings) -> RunningPlanner:
    """Starts the planner of `job`: opens its ledger (`ledger.location`, else `ledger/` in the
    run folder, `process.run_dir` or the job's `run_dir`) and claims the next writer epoch of
    it, fencing any planner still writing it.

    Raises:
        ConfigError: a bad cost function import path.
        FailedPrecondition: the ledger's store cannot be opened or ignores conditional writes.
        Unavailable: the ledger's store cannot be reached.
    """
    run_dir = (process.run_dir or job.resolve(job.run_dir)).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    strategy = load_strategy(job)
    schedule = load_schedule(job, strategy)
    metrics = PlannerMetrics(registry, source_names=job.source_names, target_weights=schedule.initial_shares)
    membership = Membership(job)
    window = window_steps(job, strategy, adaptive=schedule.adaptive is not None)
    store = SummaryStore(len(job.sources), lookahead=summary_lookahead(job, window=window))
    storage = open_ledger_storage(job, run_dir)
    epoch = claim_epoch(storage, owner={"host": socket.gethostname(), "pid": os.getpid()})
    ledger = FencedStorage(storage, epoch=epoch, on_fenced=_exit_fenced)
    book = PlanBook(job, membership=membership, store=store, metrics=metrics, ledger=ledger, strategy=strategy, schedule=schedule)

    def connect(address: str) -> grpc.Channel:
        return create_channel(rpc, address, peer="loader")

    watch = ReplicaWatch(
        membership, job.loaders.failover, metrics, connect=connect, shadows=job.loaders.shadow, constructors=job.constructor_count
    )
    puller = SummaryPuller(
        store,
        num_sources=len(job.sources),
        target=membership.summary_target,
        connect=connect,
        observe=watch.observe,
    )
    server, port, health = create_grpc_server(
        rpc, host=process.listen or job.network.host, port=process.port, metrics=ServerMetrics("planner", registry)
    )
    planner_pb2_grpc.add_PlannerServicer_to_server(PlannerServicer(job, membership, book, store, metrics, fence=watch.fence), server)
    server.start()
    set_serving(health, "batchplane.v1.Planner")
    address = process.advertise or process.listen or f"{job.network.host}:{port}"
    log.info(
        "job %r (fingerprint %s): %d sources, mesh %s, ledger in %s (writer epoch %d)",
        job.job,
        job.fingerprint,
        len(job.sources),
        book.mesh.describe(),
        ledger.describe(),
        epoch,
    )
    return RunningPlanner(address, server, book, puller, watch, health)


def _exit_fenced(error: Fenced) -> None:
    """Ends the planner process at once with EXIT_FENCED: a newer planner writes the ledger, and
    this one must neither write nor serve plans any more (its launcher must not restart it)."""
    log.critical("stopping: %s", error)
    logging.shutdown()
    os._exit(EXIT_FENCED)
