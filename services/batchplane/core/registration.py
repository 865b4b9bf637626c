"""Joining a job: a loader or constructor registers with the planner, retrying while the planner
starts, and checks that both read the same job (fingerprint)."""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import Message

from batchplane.core.config import JobSettings
from batchplane.core.errors import ConfigError
from batchplane.core.process import ProcessSettings
from batchplane.core.rpc import RpcSettings, call_with_retry, create_channel, reraise
from batchplane.v1 import planner_pb2_grpc

log = logging.getLogger(__name__)


def register_with_planner(
    job: JobSettings, process: ProcessSettings, rpc: RpcSettings, *, method: str, request: Message, who: str
) -> Message:
    """Calls Planner.<method>(request) until the planner answers, and returns its response (whose
    `job` is the job it serves).

    Args:
        job: The job as this process read it.
        process: This process's settings (planner address, config path).
        rpc: This process's message limits and transport security.
        method: "RegisterLoader" or "RegisterConstructor".
        request: The registration request.
        who: "loader 0", "constructor 1": for errors and logs.
    Raises:
        Unavailable: the planner did not answer within twice the RPC timeout.
        InvalidArgument: the planner refused the registration (the message says why).
        ConfigError: the planner runs a job with another fingerprint than this process's file.
    """
    with create_channel(rpc, process.planner, peer="planner") as channel:
        call = getattr(planner_pb2_grpc.PlannerStub(channel), method)
        try:
            response = call_with_retry(
                lambda: call(request, timeout=job.network.rpc_timeout_s),
                what=f"{method} with planner at {process.planner}",
                deadline_s=job.network.rpc_timeout_s * 2,
            )
        except grpc.RpcError as exc:
            raise reraise(exc, f"planner at {process.planner} refused {who}") from exc
    if response.job.fingerprint != job.fingerprint:
        raise ConfigError(
            "--config",
            f"describes job fingerprint {job.fingerprint}, but the planner runs {response.job.fingerprint}",
            str(process.config),
        )
    log.info("registered with planner at %s as %s", process.planner, who)
    return response
