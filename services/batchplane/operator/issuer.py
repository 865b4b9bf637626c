"""The operator as batchplane's certificate issuer (the chart's `tls.mode: issued`): the `Issuer`
gRPC service every planner, loader and constructor pod asks for its own short-lived certificate.

A pod sends a certificate signing request and its projected ServiceAccount token. The operator
asks the API server who the token belongs to (a TokenReview), reads that pod, and signs a
certificate naming the identity `core.issuance` gives it, valid for `lifetime_s`; the pod renews
it itself (`core.enroll`). The CA's key is read from `--issuer-ca-dir` (a Secret mounted into the
operator pod only) and never leaves this process.

The service is served over TLS without client certificates (callers have none yet): its own
serving certificate names `operator.batchplane`, is signed here and renewed in memory before a
third of its life is left. Every operator replica serves it (signing needs no leader).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import pathlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client import CollectorRegistry, Counter

from batchplane.core.errors import ConfigError, InvalidArgument, Unauthenticated, Unavailable
from batchplane.core.identity import Identity
from batchplane.core.issuance import ISSUED_ROLES, IssuancePolicy, IssuanceRefused, identity_for, reviewed
from batchplane.core.localca import LocalCA, pem_key
from batchplane.core.rpc import RpcSettings, ServerMetrics, create_grpc_server
from batchplane.core.tls import Security, files_stamp
from batchplane.operator.kubernetes import KubernetesError
from batchplane.v1 import issuer_pb2, issuer_pb2_grpc

log = logging.getLogger(__name__)

#: The largest CSR and token accepted (a P-256 CSR is under 1 KiB, a projected token under 2).
MAX_CSR_BYTES = 8192
MAX_TOKEN_BYTES = 16384
#: Messages of the issuer's server (a request is a CSR and a token).
MAX_MESSAGE_BYTES = 64 * 1024
#: A certificate is renewed once this share of its life has passed.
RENEW_AT = 2 / 3


@dataclasses.dataclass(frozen=True)
class IssuerSettings:
    """The operator's --issuer-* flags.

    Attributes:
        port: Port of the Issuer service (0: any free one).
        host: Address it binds.
        ca_dir: Folder with the CA's ca.crt and ca.key.
        policy: Whom it serves (`core.issuance`).
        lifetime_s: How long an issued certificate is valid.
    """

    port: int
    host: str
    ca_dir: pathlib.Path
    policy: IssuancePolicy
    lifetime_s: float = 86400.0


def add_issuer_flags(parser: argparse.ArgumentParser) -> None:
    """The operator's --issuer-* flags."""
    group = parser.add_argument_group("certificate issuer (tls.mode issued)")
    group.add_argument("--issuer-port", type=int, default=None, help="serve the Issuer here (0: any free port; default: no issuer)")
    group.add_argument("--issuer-host", default="0.0.0.0", help="address the Issuer binds (default 0.0.0.0)")
    group.add_argument("--issuer-ca-dir", type=pathlib.Path, help="folder with the CA's ca.crt and ca.key (a Secret mounted here only)")
    group.add_argument(
        "--issuer-role",
        action="append",
        default=[],
        metavar="ROLE=SERVICEACCOUNT",
        help=f"pods of this ServiceAccount are given this role ({', '.join(ISSUED_ROLES)}); repeat for each",
    )
    group.add_argument(
        "--issuer-index-from", help="how a constructor's index is read from its trainer pod (the chart's constructor.indexFrom)"
    )
    group.add_argument("--issuer-trainer-pods", type=int, help="the number of trainer pods (for --issuer-index-from jobset)")
    group.add_argument("--issuer-lifetime-s", type=float, default=86400.0, help="how long an issued certificate is valid (default 86400)")
    group.add_argument("--issuer-audience", default="batchplane", help="the audience a pod's token must be for (default batchplane)")


def issuer_settings(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> IssuerSettings | None:
    """The Issuer's settings from the parsed flags (removed from `ns`); None without --issuer-port.
    Exits through `parser.error` naming the bad flag."""
    flags = {name: vars(ns).pop(name) for name in list(vars(ns)) if name.startswith("issuer_")}
    if flags["issuer_port"] is None:
        return None
    if not 0 <= flags["issuer_port"] <= 65535:
        parser.error(f"--issuer-port: must be a port number, got {flags['issuer_port']}")
    if flags["issuer_ca_dir"] is None:
        parser.error("--issuer-port needs --issuer-ca-dir (the CA's ca.crt and ca.key)")
    if not 60 <= flags["issuer_lifetime_s"] <= 366 * 86400:
        parser.error(f"--issuer-lifetime-s: must be between 60 and {366 * 86400}, got {flags['issuer_lifetime_s']:g}")
    audience = flags["issuer_audience"]
    if not audience or audience in ("kubernetes", "api") or audience.startswith("https://kubernetes.default.svc"):
        parser.error(
            f"--issuer-audience: must not be the Kubernetes API server's own ({audience!r}): tokens for it would be API credentials"
        )
    roles: dict[str, str] = {}
    for item in flags["issuer_role"]:
        role, _, account = item.partition("=")
        if not account or role not in ISSUED_ROLES or account in roles:
            parser.error(
                f"--issuer-role: must be ROLE=SERVICEACCOUNT with ROLE one of {', '.join(ISSUED_ROLES)}, each account once, got {item!r}"
            )
        roles[account] = role
    try:
        policy = IssuancePolicy(
            ns.namespace,
            roles,
            audience=flags["issuer_audience"],
            index_from=flags["issuer_index_from"],
            trainer_pods=flags["issuer_trainer_pods"],
        )
    except (ValueError, ConfigError) as exc:
        parser.error(f"--issuer-index-from: {exc}")
    return IssuerSettings(flags["issuer_port"], flags["issuer_host"], flags["issuer_ca_dir"], policy, flags["issuer_lifetime_s"])


class IssuerMetrics:
    """batchplane_operator_certificates_{issued,refused}_total."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.issued = Counter(
            "batchplane_operator_certificates_issued_total", "Certificates the issuer signed, by role.", ["role"], registry=registry
        )
        self.refused = Counter(
            "batchplane_operator_certificates_refused_total",
            "Certificate requests the issuer refused, by reason (token, audience, subject, namespace, unbound, pod, role, label, "
            "index, csr).",
            ["reason"],
            registry=registry,
        )
        self.server = ServerMetrics("issuer", registry)


class CurrentCA:
    """The CA of a folder (a mounted Secret), read again once its files change: a CA that
    cert-manager renews is used from its renewal on. Looked at no more than every CHECK_S; a
    folder caught mid-update keeps the CA read last."""

    CHECK_S = 10.0

    def __init__(self, folder: pathlib.Path) -> None:
        self._folder = folder
        self._stamp = files_stamp(folder, _CA_FILES)
        self._ca = LocalCA.load(folder)
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self) -> LocalCA:
        with self._lock:
            now = time.monotonic()
            if now - self._checked >= self.CHECK_S:
                self._checked = now
                stamp = files_stamp(self._folder, _CA_FILES)
                if stamp and stamp != self._stamp:
                    try:
                        self._ca, self._stamp = LocalCA.load(self._folder), stamp
                        log.info(
                            "the CA in %s changed: signing with the new one, valid until %s",
                            self._folder,
                            self._ca.cert.not_valid_after_utc,
                        )
                    except ConfigError as exc:
                        log.warning("the CA in %s changed but cannot be read yet (%s); signing with the one read before", self._folder, exc)
            return self._ca


_CA_FILES = ("ca.crt", "ca.key")


class IssuerService(issuer_pb2_grpc.IssuerServicer):
    """Issue: checks the request, reviews the token, reads the pod, signs.

    Args:
        ca: The CA that signs now.
        policy: Whom it serves.
        review: (token, audience) -> the TokenReview's status.
        get_pod: (namespace, name) -> the pod, or None when there is none.
        lifetime_s: How long an issued certificate is valid.
        metrics: Its counters.
    """

    def __init__(
        self,
        ca: Callable[[], LocalCA],
        policy: IssuancePolicy,
        *,
        review: Callable[[str, str], Mapping[str, Any]],
        get_pod: Callable[[str, str], Mapping[str, Any] | None],
        lifetime_s: float,
        metrics: IssuerMetrics,
    ) -> None:
        self._ca, self._policy, self._review, self._get_pod = ca, policy, review, get_pod
        self._lifetime = datetime.timedelta(seconds=lifetime_s)
        self._metrics = metrics

    def Issue(self, request: issuer_pb2.IssueRequest, context: grpc.ServicerContext) -> issuer_pb2.IssueResponse:
        public_key = self._requested_key(request)
        if not request.token or len(request.token) > MAX_TOKEN_BYTES:
            self._metrics.refused.labels("token").inc()
            raise Unauthenticated(f"token: a projected ServiceAccount token of at most {MAX_TOKEN_BYTES} bytes is required")
        try:
            status = self._review(request.token, self._policy.audience)
            who = reviewed(self._policy, status)
            identity = identity_for(self._policy, who, self._get_pod(self._policy.namespace, who.pod))
        except IssuanceRefused as exc:
            self._metrics.refused.labels(exc.reason).inc()
            if exc.reason == "token":
                raise Unauthenticated(str(exc)) from None
            raise
        except KubernetesError as exc:
            raise Unavailable(f"the Kubernetes API could not be asked: {exc}") from None
        ca = self._ca()
        certificate = ca.sign(identity, public_key, lifetime=self._lifetime) + ca.chain
        self._metrics.issued.labels(identity.role).inc()
        log.info("issued %s to pod %s (ServiceAccount %s) for %s", identity, who.pod, who.service_account, self._lifetime)
        return issuer_pb2.IssueResponse(certificate=certificate, ca=ca.pem, identity=identity.uri())

    def _requested_key(self, request: issuer_pb2.IssueRequest) -> ec.EllipticCurvePublicKey:
        """The P-256 key of the request's CSR, whose signature proves the caller holds it."""
        if not request.csr or len(request.csr) > MAX_CSR_BYTES:
            self._metrics.refused.labels("csr").inc()
            raise InvalidArgument(f"csr: a PEM certificate signing request of at most {MAX_CSR_BYTES} bytes is required")
        try:
            csr = x509.load_pem_x509_csr(request.csr)
            key = csr.public_key()
            valid = csr.is_signature_valid
        except ValueError as exc:
            self._metrics.refused.labels("csr").inc()
            raise InvalidArgument(f"csr: not a PEM certificate signing request: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1" or not valid:
            self._metrics.refused.labels("csr").inc()
            raise InvalidArgument("csr: must be signed by an ECDSA P-256 key, the key the certificate is for")
        return key


class _ServingCertificate(Security):
    """The issuer's transport: TLS with a serving certificate for `operator.batchplane` signed
    here and renewed in memory; no client certificate (the token in the request is the caller's
    credential), so every call reaches the service."""

    def __init__(self, ca: Callable[[], LocalCA], lifetime_s: float) -> None:
        super().__init__(None)
        self._ca, self._lifetime_s = ca, lifetime_s
        self._lock = threading.Lock()
        self._renew_at = 0.0

    def add_port(self, server: grpc.Server, address: str) -> int:
        credentials = grpc.dynamic_ssl_server_credentials(self._configuration(), self._fetch, require_client_authentication=False)
        return server.add_secure_port(address, credentials)

    def identify(self, context: grpc.ServicerContext) -> Identity | None:
        return None

    def _fetch(self) -> Any:  # every handshake; None keeps the current configuration
        with self._lock:
            due = time.monotonic() >= self._renew_at
        return self._configuration() if due else None

    def _configuration(self) -> Any:
        key = ec.generate_private_key(ec.SECP256R1())
        ca = self._ca()
        cert = ca.sign(Identity("operator"), key.public_key(), lifetime=datetime.timedelta(seconds=self._lifetime_s)) + ca.chain
        with self._lock:
            self._renew_at = time.monotonic() + self._lifetime_s * RENEW_AT
        return grpc.ssl_server_certificate_configuration([(pem_key(key), cert)])


def start_issuer(
    settings: IssuerSettings,
    *,
    review: Callable[[str, str], Mapping[str, Any]],
    get_pod: Callable[[str, str], Mapping[str, Any] | None],
    registry: CollectorRegistry,
) -> tuple[grpc.Server, int]:
    """Starts the Issuer service; returns the server and its bound port.

    Raises:
        ConfigError: the CA folder does not hold the CA's certificate and key.
        PortUnavailable: the port cannot be bound.
    """
    ca = CurrentCA(settings.ca_dir)
    metrics = IssuerMetrics(registry)
    transport = _ServingCertificate(ca, settings.lifetime_s)
    rpc = RpcSettings(security=transport, max_message_bytes=MAX_MESSAGE_BYTES)
    server, port, _ = create_grpc_server(rpc, host=settings.host, port=settings.port, metrics=metrics.server, max_workers=4)
    service = IssuerService(ca, settings.policy, review=review, get_pod=get_pod, lifetime_s=settings.lifetime_s, metrics=metrics)
    issuer_pb2_grpc.add_IssuerServicer_to_server(service, server)
    server.start()
    log.info("issuing certificates on %s:%d (TLS; callers prove their pod with a ServiceAccount token)", settings.host, port)
    return server, port
