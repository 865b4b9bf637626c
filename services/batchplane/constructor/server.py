"""Wires a constructor together: registers with the planner, starts the prefetch pipeline, the
gRPC server and, on a Unix socket, the slab socket of shared-memory delivery beside it.

With journal delivery (`batch.delivery: journal`) a constructor runs in one of two roles:
`start_producer` (`--produce`: registers like constructor 0, builds every rank's batches and
commits them to the journal, `produce`; serves no GetBatch, only health) and `start_consumer`
(`--consume`: a pod's sidecar serving its trainers from the journal, `consume`; talks to no
planner nor loader)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import stat
import threading

import grpc
from grpc_health.v1.health import HealthServicer
from prometheus_client import CollectorRegistry

from batchplane.constructor.consume import JournalConsumer
from batchplane.constructor.journal_service import JournalConstructorServicer, add_consumer_to_server
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.pipeline import StepPipeline
from batchplane.constructor.produce import JournalProducer
from batchplane.constructor.service import ConstructorServicer, add_to_server
from batchplane.constructor.slabs import SESSIONS_PER_RANK, SlabPool, SlabServer, slab_socket_path
from batchplane.core.config import JobSettings
from batchplane.core.errors import ConfigError
from batchplane.core.process import ProcessSettings
from batchplane.core.registration import register_with_planner
from batchplane.core.rpc import RpcSettings, ServerMetrics, create_channel, create_grpc_server, serving_status, set_serving
from batchplane.core.userfile import job_hook
from batchplane.journal.location import open_journal_storage
from batchplane.v1 import common_pb2, planner_pb2, planner_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunningConstructor:
    address: str
    server: grpc.Server
    pipeline: StepPipeline
    rpc: RpcSettings
    health: HealthServicer
    slabs: SlabServer | None = None
    producer: JournalProducer | None = None
    _stopped: threading.Event = dataclasses.field(default_factory=threading.Event)

    def keep_registered(self, job: JobSettings, process: ProcessSettings, ranks: tuple[int, ...]) -> None:
        """Registers again every `network.heartbeat_s` (rejoin, idempotent) once its ranks have started,
        saying the oldest step it may still need: a restarted planner resumes there even when
        this constructor asks for no plan for a while (its ranks are busy, or past the end of
        data). A restarted planner starts on a plan request: once this constructor knows where
        the data ends it sends none, so while the planner has not started it asks for the end
        step (the job then ends with the planner knowing it, and `batchplane up` stops). Runs on
        a thread of its own."""
        timeout = max(job.network.heartbeat_s * 2, 1.0)
        with create_channel(self.rpc, process.planner, peer="planner") as channel:
            stub = planner_pb2_grpc.PlannerStub(channel)
            while not self._stopped.wait(job.network.heartbeat_s):
                step = self.pipeline.rejoin_step()
                if step is None:
                    continue
                try:
                    registered = stub.RegisterConstructor(_request(process, self.address, ranks, next_step=step), timeout=timeout)
                    end = self.pipeline.end_step()
                    if registered.resume_step < 0 and end is not None:
                        wait_ms = int(job.network.heartbeat_s * 1000)
                        request = planner_pb2.GetPlanRequest(
                            constructor_index=process.index, step=end, delivered_below=step, wait_ms=wait_ms
                        )
                        stub.GetPlan(request, timeout=timeout + wait_ms / 1000)
                except grpc.RpcError:
                    continue  # the planner is restarting, or not at the end yet: the next round tells it

    def serving(self) -> bool:
        return serving_status(self.health)

    def stop(self, grace_s: float) -> None:
        self._stopped.set()
        if self.producer is not None:
            self.producer.stop(timeout_s=0)  # asks it to end; the pipeline's stop wakes it
        self.pipeline.stop()  # first: wakes requests waiting for batches
        if self.producer is not None:
            self.producer.stop()
        self.server.stop(grace_s).wait()
        if self.slabs is not None:
            self.slabs.stop()


@dataclasses.dataclass
class _Building:
    """What a building constructor (streaming, or the journal's producer) starts with."""

    address: str
    server: grpc.Server
    health: HealthServicer
    metrics: ConstructorMetrics
    pipeline: StepPipeline
    info: common_pb2.JobInfo
    ranks: tuple[int, ...]


def start_constructor(job: JobSettings, process: ProcessSettings, registry: CollectorRegistry, rpc: RpcSettings) -> RunningConstructor:
    """Starts constructor `process.index` of `job` and registers it with the planner. It serves
    its trainer with local credentials (core.tls: a Unix socket in a folder only the pod's group
    enters, or loopback TCP) and calls the planner and loaders over mutual TLS.

    Raises:
        ConfigError: a bad index, no planner address, or journal delivery (which needs a role).
        InvalidArgument: the planner refused the registration.
    """
    if job.batch.delivery == "journal":
        raise ConfigError(
            "batch.delivery",
            "is journal: start the constructor as a producer (--produce --index I --planner ADDR, I < journal.producers) "
            "or as a pod's consumer (--consume --index I)",
            job.batch.delivery,
        )
    b = _start_building(job, process, registry, rpc)
    slabs = None
    if process.listen and process.listen.startswith("unix:") and job.constructors.shm_bytes:
        # Beside the trainer's socket, in the same folder, under the same umask.
        pool = SlabPool(job.constructors.shm_bytes, b.metrics)
        slabs = SlabServer(slab_socket_path(process.listen), pool, max_sessions=len(b.ranks) * SESSIONS_PER_RANK).start()
    add_to_server(ConstructorServicer(b.info, b.pipeline, b.metrics, slabs), b.server)
    b.server.start()
    set_serving(b.health, "batchplane.v1.Constructor")
    log.info("serving ranks %s", list(b.ranks))
    running = RunningConstructor(b.address, b.server, b.pipeline, rpc, b.health, slabs)
    threading.Thread(target=running.keep_registered, args=(job, process, b.ranks), name="register", daemon=True).start()
    return running


def start_producer(job: JobSettings, process: ProcessSettings, registry: CollectorRegistry, rpc: RpcSettings) -> RunningConstructor:
    """Starts the producer of journal delivery (`--produce`): constructor 0 of the planner's
    view, building every rank's batches and committing them to the journal (`produce`). Its
    gRPC server serves health only.

    Raises:
        ConfigError: not journal delivery, an index other than 0, or no planner address.
        InvalidArgument: the planner refused the registration.
        FailedPrecondition: the journal cannot be opened, or its store ignores conditional puts.
    """
    if job.batch.delivery != "journal":
        raise ConfigError("batch.delivery", "--produce needs batch.delivery: journal", job.batch.delivery)
    storage = open_journal_storage(job, _run_dir(job, process), check_writes=True)
    b = _start_building(job, process, registry, rpc)
    producer = JournalProducer(job, pipeline=b.pipeline, storage=storage, info=b.info, metrics=b.metrics, index=process.index)
    b.server.start()
    set_serving(b.health, "batchplane.v1.Constructor")
    log.info("producing the journal at %s for ranks %s", storage.describe(), list(b.ranks))
    running = RunningConstructor(b.address, b.server, b.pipeline, rpc, b.health, producer=producer.start())
    threading.Thread(target=running.keep_registered, args=(job, process, b.ranks), name="register", daemon=True).start()
    return running


@dataclasses.dataclass
class RunningConsumer:
    """A started consumer of journal delivery (`--consume`)."""

    address: str
    server: grpc.Server
    consumer: JournalConsumer
    health: HealthServicer

    def serving(self) -> bool:
        return serving_status(self.health)

    def stop(self, grace_s: float) -> None:
        self.consumer.stop()  # first: wakes requests waiting for steps
        self.server.stop(grace_s).wait()


def start_consumer(job: JobSettings, process: ProcessSettings, registry: CollectorRegistry, rpc: RpcSettings) -> RunningConsumer:
    """Starts pod `process.index`'s consumer of journal delivery (`--consume`): serves the
    Constructor service to the pod's ranks from the journal (`consume`), with local credentials
    as `start_constructor`. Talks to no planner and no loader.

    Raises:
        ConfigError: not journal delivery, or a bad index.
        FailedPrecondition: the journal cannot be opened.
    """
    if job.batch.delivery != "journal":
        raise ConfigError("batch.delivery", "--consume needs batch.delivery: journal", job.batch.delivery)
    if not 0 <= process.index < job.pod_count:
        raise ConfigError("--index", f"must be in [0, {job.pod_count}) (mesh ranks / constructors.ranks_per_constructor)", process.index)
    # Consumers record their marks with put-if-absent manifest versions: check like a producer.
    storage = open_journal_storage(job, _run_dir(job, process), check_writes=True)
    ranks = job.pod_ranks(process.index)
    metrics = ConstructorMetrics(registry)
    server, address, health = _create_server(job, process, registry, rpc)
    consumer = JournalConsumer(job, storage=storage, index=process.index, ranks=ranks, metrics=metrics)
    add_consumer_to_server(JournalConstructorServicer(job, consumer, metrics, storage=storage), server)
    server.start()
    set_serving(health, "batchplane.v1.Constructor")
    log.info("serving ranks %s from the journal at %s", list(ranks), storage.describe())
    return RunningConsumer(address, server, consumer, health)


def _run_dir(job: JobSettings, process: ProcessSettings) -> pathlib.Path:
    return (process.run_dir or job.resolve(job.run_dir)).absolute()


def _create_server(
    job: JobSettings, process: ProcessSettings, registry: CollectorRegistry, rpc: RpcSettings
) -> tuple[grpc.Server, str, HealthServicer]:
    if process.listen:
        prepare_socket_folder(process.listen)
        os.umask(0o007)  # the socket: owner and group read and write, nobody else
    server, port, health = create_grpc_server(
        rpc, host=process.listen or job.network.host, port=process.port, metrics=ServerMetrics("constructor", registry), local=True
    )
    return server, process.advertise or process.listen or f"{job.network.host}:{port}", health


def _start_building(job: JobSettings, process: ProcessSettings, registry: CollectorRegistry, rpc: RpcSettings) -> _Building:
    """The server (not started), the registration with the planner and the pipeline."""
    if not 0 <= process.index < job.constructor_count:
        why = "journal.producers" if job.batch.delivery == "journal" else "mesh ranks / constructors.ranks_per_constructor"
        raise ConfigError("--index", f"must be in [0, {job.constructor_count}) ({why})", process.index)
    if not process.planner:
        raise ConfigError("--planner", "is required for a constructor", None)
    ranks = job.constructor_ranks(process.index)
    metrics = ConstructorMetrics(registry)
    server, address, health = _create_server(job, process, registry, rpc)
    registered = _register(job, process, rpc, address, ranks)
    info = registered.job
    hook = job_hook(job, "constructor_do_plan", info.hooks.constructor_do_plan)
    pipeline = StepPipeline(
        job,
        index=process.index,
        ranks=ranks,
        planner=process.planner,
        metrics=metrics,
        info=info,
        hook=hook,
        connect=lambda peer_address, peer: create_channel(rpc, peer_address, peer=peer),
        rejoin=lambda step: _register(job, process, rpc, address, ranks, next_step=step),
        resume_step=registered.resume_step if registered.resume_step >= 0 else None,
        oldest_step=registered.oldest_step,
    )
    return _Building(address, server, health, metrics, pipeline, info, ranks)


def _request(
    process: ProcessSettings, address: str, ranks: tuple[int, ...], *, next_step: int | None = None
) -> planner_pb2.RegisterConstructorRequest:
    return planner_pb2.RegisterConstructorRequest(
        constructor_index=process.index, address=address, ranks=ranks, rejoin=next_step is not None, next_step=next_step or 0
    )


def _register(
    job: JobSettings, process: ProcessSettings, rpc: RpcSettings, address: str, ranks: tuple[int, ...], *, next_step: int | None = None
) -> planner_pb2.RegisterConstructorResponse:
    request = _request(process, address, ranks, next_step=next_step)
    return register_with_planner(job, process, rpc, method="RegisterConstructor", request=request, who=f"constructor {process.index}")


def prepare_socket_folder(listen: str) -> None:
    """Makes the folder of the trainer's socket before the server binds it: only its owner and
    group (the pod's fsGroup, shared with a trainer running as another user) enter it, and new
    files there take that group (set-group-id). The caller sets the umask that makes the socket
    itself owner-and-group only, so nothing outside the group can connect at any moment.

    Raises:
        ConfigError: the folder cannot be made, or exists and others may enter it.
    """
    path = pathlib.Path(listen.removeprefix("unix://").removeprefix("unix:"))
    folder = path.parent
    try:
        try:
            folder.mkdir(parents=True, mode=0o700)
        except FileExistsError:  # made by this pod's other constructor, or before a restart
            pass
        else:
            os.chmod(folder, 0o2770)  # mkdir's mode is cut by the umask; set it before any bind
        mode = folder.stat().st_mode
    except OSError as exc:
        raise ConfigError("--listen", f"cannot make the socket folder {folder}: {exc.strerror or exc}", listen) from None
    if mode & 0o007:
        raise ConfigError(
            "--listen",
            f"the socket folder {folder} lets every user in (mode {stat.S_IMODE(mode):o}); "
            "point --listen into a folder of its own, which the constructor makes with mode 2770",
            listen,
        )
