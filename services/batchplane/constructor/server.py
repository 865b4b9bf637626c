"""Wires a constructor together: registers with the planner, starts the prefetch pipeline and
the gRPC server."""

from __future__ import annotations

import dataclasses
import logging

import grpc
from prometheus_client import CollectorRegistry

from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.pipeline import StepPipeline
from batchplane.constructor.service import ConstructorServicer
from batchplane.core.config import JobSettings
from batchplane.core.errors import ConfigError
from batchplane.core.process import ProcessSettings
from batchplane.core.registration import register_with_planner
from batchplane.core.rpc import ServerMetrics, create_grpc_server, set_serving
from batchplane.core.userfile import job_hook
from batchplane.v1 import common_pb2, constructor_pb2_grpc, planner_pb2

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunningConstructor:
    address: str
    server: grpc.Server
    pipeline: StepPipeline

    def stop(self, grace_s: float) -> None:
        self.pipeline.stop()  # first: wakes requests waiting for batches
        self.server.stop(grace_s).wait()


def start_constructor(job: JobSettings, process: ProcessSettings, registry: CollectorRegistry) -> RunningConstructor:
    """Starts constructor `process.index` of `job` and registers it with the planner.

    Raises:
        ConfigError: a bad index or no planner address.
        InvalidArgument: the planner refused the registration.
    """
    if not 0 <= process.index < job.constructor_count:
        raise ConfigError("--index", f"must be in [0, {job.constructor_count}) (mesh ranks / constructors.ranks_per_constructor)", process.index)
    if not process.planner:
        raise ConfigError("--planner", "is required for a constructor", None)
    ranks = job.constructor_ranks(process.index)
    metrics = ConstructorMetrics(registry)
    server, port, health = create_grpc_server(
        host=process.listen or job.network.host,
        port=process.port,
        metrics=ServerMetrics("constructor", registry),
        max_message_bytes=job.network.max_message_bytes,
    )
    address = process.advertise or process.listen or f"{job.network.host}:{port}"
    info = _register(job, process, address, ranks)
    hook = job_hook(job, "constructor_do_plan", info.hooks.constructor_do_plan)
    pipeline = StepPipeline(
        job, index=process.index, ranks=ranks, planner=process.planner, metrics=metrics, info=info, hook=hook,
        rejoin=lambda step: _register(job, process, address, ranks, next_step=step),
    )
    constructor_pb2_grpc.add_ConstructorServicer_to_server(ConstructorServicer(info, pipeline, metrics), server)
    server.start()
    set_serving(health, "batchplane.v1.Constructor")
    log.info("serving ranks %s", list(ranks))
    return RunningConstructor(address, server, pipeline)


def _register(job: JobSettings, process: ProcessSettings, address: str, ranks: tuple[int, ...], *, next_step: int | None = None) -> common_pb2.JobInfo:
    request = planner_pb2.RegisterConstructorRequest(
        constructor_index=process.index, address=address, ranks=ranks, rejoin=next_step is not None, next_step=next_step or 0
    )
    return register_with_planner(job, process, rpc="RegisterConstructor", request=request, who=f"constructor {process.index}")
