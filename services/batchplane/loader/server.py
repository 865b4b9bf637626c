"""Wires a source loader together: opens its sources, starts its streams and gRPC server, and
registers it with the planner."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
import logging
import threading
import time
import uuid

import grpc
from grpc_health.v1.health import HealthServicer
from prometheus_client import CollectorRegistry

from batchplane.core.config import JobSettings
from batchplane.core.errors import ConfigError
from batchplane.core.process import ProcessSettings
from batchplane.core.registration import register_with_planner
from batchplane.core.userfile import job_hook
from batchplane.core.rpc import RpcSettings, ServerMetrics, add_servicer, create_channel, create_grpc_server, serving_status, set_serving
from batchplane.loader.bounds import FetchLimits
from batchplane.loader.fetch import FetchBook
from batchplane.loader.metrics import LoaderMetrics
from batchplane.core.order import SampleOrder
from batchplane.loader.service import LoaderServicer, routing_of
from batchplane.loader.source import ParquetSource
from batchplane.loader.stream import ByteBudget, SourceStream
from batchplane.loader.transforms import bind_transform
from batchplane.v1 import common_pb2, loader_pb2, planner_pb2, planner_pb2_grpc

log = logging.getLogger(__name__)


def open_streams(job: JobSettings, loader_index: int, metrics: LoaderMetrics, *, replica: str = "") -> dict[int, SourceStream]:
    """Opens the sources of loader `loader_index` and starts their streams.

    Raises:
        ConfigError: a bad transform import path.
        SourceError: a source that cannot be opened (see `batchplane.loader.source`).
    """
    budget = ByteBudget(job.loaders.buffer_bytes)
    streams = {}
    for k in job.loader_sources(loader_index):
        settings = job.sources[k]
        transform = bind_transform(k, settings, max_length=job.max_length, length_policy=job.batch.length_policy, payload=job.batch.payload)
        source = ParquetSource(
            settings.name,
            job.locate(settings.path),
            required_columns=transform.columns or (),
            token_column=settings.token_column if settings.transform is None else None,
            on_retry=metrics.read_retries.labels(settings.name).inc,
        )
        order = SampleOrder(
            [rg.num_rows for rg in source.row_groups],
            seed=job.seed,
            source_name=settings.name,
            window_row_groups=job.loaders.shuffle.window_row_groups,
            shuffle=job.loaders.shuffle.enabled,
        )
        streams[k] = SourceStream(
            k,
            source,
            order,
            transform,
            epochs=job.passes(k),
            read_ahead_samples=job.loaders.read_ahead_samples,
            budget=budget,
            metrics=metrics,
            replica=replica or str(loader_index),
        )
        log.info(
            "source %r: %d rows in %d file(s), %d row groups", settings.name, source.num_rows, len(source.files), len(source.row_groups)
        )
    return streams


#: How long a leaving replica serves its windows at most before it exits anyway.
DRAIN_TIMEOUT_S = 300.0


@dataclasses.dataclass
class RunningLoader:
    address: str
    server: grpc.Server
    streams: dict[int, SourceStream]
    job: JobSettings | None = None
    process: ProcessSettings | None = None
    registration: planner_pb2.RegisterLoaderRequest | None = None
    rpc: RpcSettings | None = None
    health: HealthServicer | None = None
    _done_registering: threading.Event = dataclasses.field(default_factory=threading.Event)

    def serving(self) -> bool:
        return self.health is not None and serving_status(self.health)

    def _planner_channel(self) -> grpc.Channel:
        return create_channel(self.rpc, self.process.planner, peer="planner")

    def keep_registered(self) -> None:
        """Registers again every `network.heartbeat_s` (idempotent), so that a restarted planner, which
        knows no loader, learns of this replica at once; runs on a thread of its own."""
        job, process, request = self.job, self.process, self.registration
        with self._planner_channel() as channel:
            stub = planner_pb2_grpc.PlannerStub(channel)
            known = True
            while not self._done_registering.wait(job.network.heartbeat_s):
                try:
                    answer = stub.RegisterLoader(request, timeout=max(job.network.heartbeat_s * 2, 1.0))
                    self.took_role(answer.shadow)
                    for r in answer.restore:  # how far the planner has asked this group: fetches may reach there
                        if r.source in self.streams:
                            self.streams[r.source].asked_through(r.through_seq)
                except grpc.RpcError as exc:
                    if known:  # a refusal says why (e.g. this replica was fenced); anything else: it does not answer
                        refused = exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED)
                        what = f"refuses this loader: {exc.details()}" if refused else f"does not answer ({exc.code().name})"
                        log.warning("the planner at %s %s; registering again until it takes it", process.planner, what)
                    known = False
                    continue
                if not known:
                    log.info("registered again with the planner at %s", process.planner)
                known = True

    def took_role(self, shadow: bool) -> None:
        """Registers from now on in the role the planner gave: a promoted shadow as the replica,
        a replica whose shadow took over as the shadow (so a restarted planner keeps the roles)."""
        replica = self.streams_replica
        role = replica if shadow else ""
        if self.registration.shadow_of != role:
            log.info(
                "the planner %s",
                f"made this loader the shadow of replica {replica!r}"
                if shadow
                else f"promoted this shadow: it serves as replica {replica!r}",
            )
            self.registration.shadow_of = role

    @property
    def streams_replica(self) -> str:
        """The replica id whose windows this process reads."""
        return self.process.shadow_of or replica_id(self.process)

    def leave(self) -> bool:
        """Leaves the loader group (scaled down): the planner routes no more windows here; this
        replica serves the windows it was routed until they are consumed (at most
        DRAIN_TIMEOUT_S). Returns False, and keeps serving, when it cannot leave: it is the
        group's last replica, or the planner did not answer."""
        job, process = self.job, self.process
        if self.registration.shadow_of:
            log.info("a shadow leaves at once: it serves nothing the planner counts on")
            return True
        request = planner_pb2.DeregisterLoaderRequest(loader_index=process.index, replica=replica_id(process))
        try:
            with self._planner_channel() as channel:
                response = planner_pb2_grpc.PlannerStub(channel).DeregisterLoader(request, timeout=job.network.rpc_timeout_s)
        except grpc.RpcError as exc:
            log.error("cannot leave loader group %d, serving on: %s: %s", process.index, exc.code().name, exc.details())
            return False
        self._done_registering.set()  # a replica that left must not register again
        below = dict(zip(job.loader_sources(process.index), response.drain_through))
        log.info("left loader group %d; serving the windows routed here below %s", process.index, below)
        give_up = time.monotonic() + DRAIN_TIMEOUT_S
        while not all(stream.drained(below[k]) for k, stream in self.streams.items()):
            if time.monotonic() > give_up:
                log.error("windows routed here are still unserved after %.0f s; leaving anyway", DRAIN_TIMEOUT_S)
                return True
            time.sleep(0.1)
        log.info("every window routed here was served")
        return True

    def stop(self, grace_s: float) -> None:
        self._done_registering.set()
        for stream in self.streams.values():
            stream.close()  # first: wakes requests waiting for data
        self.server.stop(grace_s).wait()


def start_loader(job: JobSettings, process: ProcessSettings, registry: CollectorRegistry, rpc: RpcSettings) -> RunningLoader:
    """Starts loader `process.index` of `job` and registers it with the planner.

    Raises:
        ConfigError, SourceError: bad configuration or sources; nothing is left running.
    """
    if not 0 <= process.index < job.loader_count:
        raise ConfigError("--index", f"must be in [0, {job.loader_count}) (loaders.count)", process.index)
    if not process.planner:
        raise ConfigError("--planner", "is required for a loader", None)
    metrics = LoaderMetrics(registry)
    streams = open_streams(job, process.index, metrics, replica=process.shadow_of or replica_id(process))
    try:
        servicer = LoaderServicer(streams, FetchBook(streams), metrics, limits=FetchLimits.of(job))
        server, port, health = create_grpc_server(
            rpc, host=process.listen or job.network.host, port=process.port, metrics=ServerMetrics("loader", registry)
        )
        add_servicer(server, servicer, loader_pb2.DESCRIPTOR.services_by_name["Loader"])  # FetchSamples' chunks serialized once
        server.start()
        address = process.advertise or process.listen or f"{job.network.host}:{port}"
        running = RunningLoader(
            address, server, streams, job, process, registration=_registration(process, address, streams), rpc=rpc, health=health
        )
        who = f"loader {process.index}" + (f" (shadow of replica {process.shadow_of!r})" if process.shadow_of else "")
        registered = register_with_planner(job, process, rpc, method="RegisterLoader", request=running.registration, who=who)
        if registered.shadow:
            log.info(
                "serving as the shadow of replica %r: reading what it reads until the planner promotes this one", running.streams_replica
            )
        running.registration.shadow_of = running.streams_replica if registered.shadow else ""
        restore(streams, registered.restore, metrics)
        info = registered.job
        servicer.join(sources=tuple(info.sources), hook=job_hook(job, "loader_do_plan", info.hooks.loader_do_plan))
        threading.Thread(target=running.keep_registered, name="register", daemon=True).start()
    except BaseException:
        for stream in streams.values():
            stream.close()
        raise
    set_serving(health, "batchplane.v1.Loader")
    return running


def _registration(process: ProcessSettings, address: str, streams: dict[int, SourceStream]) -> planner_pb2.RegisterLoaderRequest:
    request = planner_pb2.RegisterLoaderRequest(
        loader_index=process.index,
        replica=replica_id(process),
        incarnation=uuid.uuid4().hex,
        shadow_of=process.shadow_of or "",
        address=address,
        sources=[
            common_pb2.SourceInfo(
                name=s.name,
                num_rows=s.num_rows,
                num_files=len(s.source.files),
                num_row_groups=len(s.source.row_groups),
                row_group_sizes=[rg.num_rows for rg in s.source.row_groups],
                files=[
                    common_pb2.SourceFile(name=f.name, size_bytes=f.size_bytes, mtime_ns=f.mtime_ns, rows=f.rows)
                    for f in s.source.file_facts
                ],
            )
            for s in streams.values()
        ],
    )
    return request


def restore(streams: dict[int, SourceStream], sources: Sequence[planner_pb2.SourceRestore], metrics: LoaderMetrics) -> None:
    """Rebuilds a loader that (re)starts mid-job from the planner's replay of its ledger: each
    stream reads again at once its windows that constructors may still fetch."""
    for r in sources:
        metrics.start_step.labels(source=streams[r.source].name).set(r.delivered_below)
        replay = streams[r.source].restore(
            from_seq=r.from_seq,
            through_seq=r.through_seq,
            routes=routing_of(r.routes),
            planned_seq=r.planned_seq,
            planned_steps=r.planned_steps,
            delivered_below=r.delivered_below,
        )
        log.info(
            "source %r: joined mid-job at step %d; reading again %d samples from position %d that constructors may still fetch",
            streams[r.source].name,
            r.delivered_below,
            replay,
            r.from_seq,
        )


def replica_id(process: ProcessSettings) -> str:
    """The loader's replica id in its group: --replica, else its index."""
    return process.replica or str(process.index)
