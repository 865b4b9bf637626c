"""`python -m batchplane.operator --namespace NS --prometheus URL`: the Kubernetes operator.

    python -m batchplane.operator --namespace NS --prometheus URL [--interval-s N]
        [--metrics-port 9100] [--kube-api URL --token-file F --ca-file F] [--once]
        [--lease-name NAME --identity POD --lease-duration-s 15 --renew-deadline-s 10
         --retry-period-s 2 | --no-leader-elect] [--log-format text|json] [--issuer-* ...]
    python -m batchplane.operator --namespace NS --no-reconcile --issuer-port P --issuer-* ...

In a pod it talks to the API with its ServiceAccount (in-cluster configuration); --kube-api
(with optional --token-file and --ca-file) points it elsewhere, e.g. at `kubectl proxy`. It
serves its metrics on --metrics-port and stops on SIGTERM/SIGINT; --once runs one pass and exits
(0 when nothing failed, 1 otherwise). See `batchplane.operator.loop` for what a pass does.

Several replicas may run: they elect a leader through the Lease --lease-name of the namespace
(`batchplane.operator.election`), and only the leader reconciles; its identity is the pod's name
($POD_NAME, else the host name). `--once` acquires the Lease for its pass (and fails when
another operator holds it); --no-leader-elect reconciles without a Lease (one replica only).

With --issuer-* it is also the job's certificate issuer (`batchplane.operator.issuer`), on every
replica. --no-reconcile runs the issuer alone: no DataPlane is reconciled, Prometheus is not
read and no Lease is taken, so the pod needs only the issuer's RBAC (TokenReview, reading pods).
The chart runs it so where this release does not reconcile its DataPlane (operator.enabled
false: another release's operator in the namespace does), and its pods still get certificates
naming each one alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, start_http_server

from batchplane.core import logformat
from batchplane.core.errors import ConfigError
from batchplane.core.metrics import build_info, process_registry
from batchplane.core.process import configure_logging, stop_on_signals
from batchplane.operator.election import ElectionSettings
from batchplane.operator.issuer import IssuerSettings, add_issuer_flags, issuer_settings, start_issuer
from batchplane.operator.kubernetes import KubeConfig, KubernetesClient, KubernetesError, in_cluster_config, in_cluster_namespace
from batchplane.operator.leader import LeaderElection
from batchplane.operator.loop import Operator, PrometheusObservations
from batchplane.operator.metrics import OperatorMetrics
from batchplane.operator.prometheus import PrometheusReader
from batchplane.operator.recorder import EventRecorder

log = logging.getLogger(__name__)

#: Exit status for bad flags or configuration.
EXIT_BAD_INPUT = 2


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    """The operator's command line."""

    #: The namespace whose DataPlanes it reconciles.
    namespace: str
    #: Prometheus's base URL ("" with reconcile off).
    prometheus: str
    #: Reconcile DataPlanes; False: serve the issuer only (--no-reconcile).
    reconcile: bool = True
    #: Seconds between passes; None: the smallest spec.scaling.intervalSeconds of the DataPlanes.
    interval_s: float | None = None
    #: Port of the metrics endpoint (0: any free port).
    metrics_port: int = 9100
    #: Address the metrics endpoint binds.
    metrics_host: str = "0.0.0.0"
    #: The API's URL; None: in-cluster configuration.
    kube_api: str | None = None
    #: Bearer token file and CA bundle for --kube-api.
    token_file: pathlib.Path | None = None
    ca_file: pathlib.Path | None = None
    #: Deadline of one Kubernetes API request, in seconds.
    kube_timeout_s: float = 10.0
    #: Deadline of one Prometheus query, in seconds.
    prometheus_timeout_s: float = 5.0
    #: Window of the rates read from Prometheus, in seconds.
    rate_window_s: float = 120.0
    #: Run one pass and exit.
    once: bool = False
    #: Log level name.
    log_level: str = "INFO"
    #: Log format: "text" or "json" (core.logformat).
    log_format: str = "text"
    #: Elect a leader through a Lease (only the leader reconciles).
    leader_elect: bool = True
    #: The Lease's name, in --namespace.
    lease_name: str = "batchplane-operator"
    #: This operator's identity in the election (its pod's name).
    identity: str = ""
    #: Seconds a Lease stays valid without renewal; a leader that cannot renew stops after
    #: renew_deadline_s; candidates try every retry_period_s.
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    #: The certificate issuer (--issuer-*, tls.mode issued); None: not served.
    issuer: IssuerSettings | None = None


def parse_args(argv: Sequence[str] | None, env: Mapping[str, str]) -> OperatorSettings:
    """The settings from the command line, falling back to POD_NAMESPACE or the pod's
    ServiceAccount namespace for --namespace. Exits with status 2 on bad flags."""
    parser = argparse.ArgumentParser(
        prog="python -m batchplane.operator", description="batchplane operator: loader Deployments scaled from the mixture"
    )
    parser.add_argument(
        "--namespace",
        default=env.get("POD_NAMESPACE") or in_cluster_namespace(),
        help="namespace to reconcile (default: $POD_NAMESPACE, or the pod's own)",
    )
    parser.add_argument(
        "--prometheus", default="", help="Prometheus base URL, e.g. http://prometheus-operated.monitoring.svc:9090 (required to reconcile)"
    )
    parser.add_argument(
        "--reconcile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reconcile the namespace's DataPlanes (default: on); --no-reconcile serves the certificate issuer alone (needs --issuer-port)",
    )
    parser.add_argument(
        "--interval-s",
        type=_positive,
        help="seconds between passes (default: the smallest spec.scaling.intervalSeconds, 30 without DataPlanes)",
    )
    parser.add_argument("--metrics-port", type=int, default=9100, help="metrics port (default 9100; 0: any free port)")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="metrics address to bind (default 0.0.0.0)")
    parser.add_argument("--kube-api", help="Kubernetes API URL (default: in-cluster, from the ServiceAccount)")
    parser.add_argument("--token-file", type=pathlib.Path, help="bearer token file for --kube-api")
    parser.add_argument("--ca-file", type=pathlib.Path, help="CA bundle verifying --kube-api")
    parser.add_argument("--kube-timeout-s", type=_positive, default=10.0, help="deadline of one API request (default 10)")
    parser.add_argument("--prometheus-timeout-s", type=_positive, default=5.0, help="deadline of one Prometheus query (default 5)")
    parser.add_argument(
        "--rate-window-s",
        type=_positive,
        default=120.0,
        help="window of the rates read from Prometheus (default 120; at least two scrape intervals)",
    )
    parser.add_argument("--once", action="store_true", help="run one pass and exit (0: nothing failed)")
    parser.add_argument("--log-level", default=env.get("BATCHPLANE_LOG_LEVEL", "INFO"))
    parser.add_argument("--log-format", help=f"log format: text or json (one object per line) (default: ${logformat.ENV}, else text)")
    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="elect a leader through a Lease; only the leader reconciles (default: on)",
    )
    parser.add_argument(
        "--lease-name", default="batchplane-operator", help="the leader-election Lease in --namespace (default batchplane-operator)"
    )
    parser.add_argument(
        "--identity",
        default=env.get("POD_NAME") or socket.gethostname(),
        help="this operator in the election (default: $POD_NAME, else the host name)",
    )
    parser.add_argument(
        "--lease-duration-s",
        type=_positive,
        default=15.0,
        help="seconds a Lease stays valid without renewal: a standby takes over at most this long after the leader's last renewal (default 15)",
    )
    parser.add_argument(
        "--renew-deadline-s",
        type=_positive,
        default=10.0,
        help="seconds a leader keeps leading while it cannot renew; < --lease-duration-s (default 10)",
    )
    parser.add_argument(
        "--retry-period-s",
        type=_positive,
        default=2.0,
        help="seconds between two attempts to acquire or renew; < --renew-deadline-s (default 2)",
    )
    add_issuer_flags(parser)
    ns = parser.parse_args(argv)
    if not ns.namespace:
        parser.error("--namespace is required outside a pod (or set POD_NAMESPACE)")
    ns.issuer = issuer_settings(ns, parser)
    if ns.reconcile and not ns.prometheus:
        parser.error(
            "--prometheus is required: the operator scales loaders from what Prometheus holds (or --no-reconcile: the issuer alone)"
        )
    if not ns.reconcile and ns.issuer is None:
        parser.error("--no-reconcile serves the certificate issuer alone: give --issuer-port and the other --issuer-* flags")
    if not ns.reconcile and ns.once:
        parser.error("--once runs one reconcile pass: it does not go with --no-reconcile")
    if (ns.token_file or ns.ca_file) and not ns.kube_api:
        parser.error("--token-file and --ca-file go with --kube-api (in a pod the ServiceAccount's are used)")
    if not 0 <= ns.metrics_port <= 65535:
        parser.error(f"--metrics-port: must be a port number, got {ns.metrics_port}")
    if not ns.lease_duration_s > ns.renew_deadline_s:
        parser.error(f"--lease-duration-s: must be > --renew-deadline-s ({ns.renew_deadline_s:g}), got {ns.lease_duration_s:g}")
    if not ns.renew_deadline_s > ns.retry_period_s:
        parser.error(f"--renew-deadline-s: must be > --retry-period-s ({ns.retry_period_s:g}), got {ns.renew_deadline_s:g}")
    if ns.leader_elect and not ns.identity:
        parser.error("--identity: must not be empty (set POD_NAME or pass --identity)")
    try:
        if ns.log_format is not None:
            ns.log_format = logformat.parse_log_format(ns.log_format, field="--log-format")
        else:
            ns.log_format = logformat.parse_log_format(env.get(logformat.ENV))
    except ConfigError as exc:
        parser.error(str(exc))
    return OperatorSettings(**vars(ns))


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv, os.environ)
    configure_logging(settings.log_level, "operator", log_format=settings.log_format, part="operator")
    try:
        if settings.kube_api:
            config = KubeConfig(settings.kube_api, settings.token_file, settings.ca_file, settings.kube_timeout_s)
        else:
            config = in_cluster_config(os.environ, timeout_s=settings.kube_timeout_s)
        api = KubernetesClient(config)
        observations = None
        if settings.reconcile:
            reader = PrometheusReader(settings.prometheus, settings.prometheus_timeout_s)
            observations = PrometheusObservations(reader, rate_window_s=settings.rate_window_s)
    except (KubernetesError, ValueError) as exc:
        log.error("cannot start the operator: %s", exc)
        return EXIT_BAD_INPUT
    registry = process_registry("operator", build_info(os.environ))
    issuer = None
    if settings.issuer is not None and not settings.once:
        try:
            issuer, _ = start_issuer(settings.issuer, review=api.review_token, get_pod=api.get_pod, registry=registry)
        except (ConfigError, OSError) as exc:
            log.error("cannot start the operator's issuer: %s", exc)
            return EXIT_BAD_INPUT
    if observations is None:
        assert issuer is not None  # parse_args requires one with --no-reconcile
        return _issue_only(settings, api, registry, stop_issuer=lambda: issuer.stop(1).wait())
    metrics = OperatorMetrics(registry)
    leader = None
    if settings.leader_elect:
        leader = LeaderElection(
            api,
            namespace=settings.namespace,
            name=settings.lease_name,
            identity=settings.identity,
            settings=ElectionSettings(settings.lease_duration_s, settings.renew_deadline_s, settings.retry_period_s),
            labels={"app.kubernetes.io/managed-by": "batchplane-operator"},
            on_change=lambda leading: metrics.leader.set(1 if leading else 0),
        )
    else:
        metrics.leader.set(1)
    recorder = EventRecorder(api, instance=settings.identity or socket.gethostname())
    operator = Operator(
        api,
        observations,
        metrics,
        namespace=settings.namespace,
        interval_s=settings.interval_s,
        events=recorder,
        leading=leader.is_leader if leader is not None else None,
    )
    if settings.once:
        return _once(operator, leader)
    server, _ = start_http_server(settings.metrics_port, addr=settings.metrics_host, registry=registry)
    stop = stop_on_signals()
    log.info(
        "operator %s for namespace %s: API %s, Prometheus %s, metrics on http://%s:%d/metrics, %s",
        settings.identity,
        settings.namespace,
        config.api_url,
        settings.prometheus,
        settings.metrics_host,
        server.server_port,
        f"leader election through the lease {settings.namespace}/{settings.lease_name}" if leader is not None else "no leader election",
    )
    # The election stops only after the loop: the Lease is released once no pass can write any more.
    election_stop = threading.Event()
    election = leader.start(election_stop) if leader is not None else None
    operator.run(stop)
    if election is not None:
        election_stop.set()
        election.join(timeout=2 * settings.kube_timeout_s + 1)  # it releases the Lease as it stops
    server.shutdown()
    if issuer is not None:
        issuer.stop(1).wait()
    log.info("operator stopped")
    return 0


def _issue_only(
    settings: OperatorSettings, api: KubernetesClient, registry: CollectorRegistry, *, stop_issuer: Callable[[], object]
) -> int:
    """--no-reconcile: serves the metrics beside the started certificate issuer until SIGTERM or
    SIGINT, then stops both."""
    server, _ = start_http_server(settings.metrics_port, addr=settings.metrics_host, registry=registry)
    stop = stop_on_signals()
    log.info(
        "operator %s for namespace %s: the certificate issuer alone (--no-reconcile), API %s, metrics on http://%s:%d/metrics",
        settings.identity,
        settings.namespace,
        api.config.api_url,
        settings.metrics_host,
        server.server_port,
    )
    stop.wait()
    server.shutdown()
    stop_issuer()
    log.info("operator stopped")
    return 0


def _once(operator: Operator, leader: LeaderElection | None) -> int:
    """One pass, holding the Lease for it (renewed while it runs) when electing; 0 when
    nothing failed."""
    if leader is not None and not leader.try_once():
        log.error("another operator (%s) leads this namespace; --once did nothing", leader.holder or "unknown")
        return 1
    done = threading.Event()
    election = leader.start(done) if leader is not None else None
    try:
        result = operator.run_once(time.monotonic())
    finally:
        done.set()
        if election is not None:
            election.join()  # it releases the Lease as it stops
    log.info("one pass over %d DataPlanes, %d failed steps", result.dataplanes, result.errors)
    return 0 if result.errors == 0 else 1


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
