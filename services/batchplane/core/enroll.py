"""A service's own certificate from batchplane's issuer (the chart's `tls.mode: issued`; the
issuer is the operator, `operator.issuer`).

With `--issuer HOST:PORT`, a planner, loader or constructor makes its key in memory, sends a
certificate signing request with its pod's projected ServiceAccount token (`--issuer-token-file`,
read again at every request: the kubelet rotates it) and writes what comes back into its
`--tls-dir` (a pod-private emptyDir) the way a mounted Secret is written, so the hot reload of
`core.tls` picks each renewal up. The trust anchor written beside it is `--issuer-ca`, the CA
certificate the deployment mounts, never what the issuer says. The issuer's own certificate is
checked against it and must name `operator.batchplane`.

The first certificate is waited for (the operator may start after the service); later ones are
asked for once RENEW_AT of the current one's life has passed, retried with backoff while the
current one stays in use.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import pathlib
import threading
import time

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from batchplane.core.errors import BatchplaneError, ConfigError, Unavailable
from batchplane.core.identity import identity_of_names
from batchplane.core.localca import pem_key, write_certificate_folder
from batchplane.core.rpc import create_issuer_channel
from batchplane.core.tls import read_token
from batchplane.v1 import issuer_pb2, issuer_pb2_grpc

log = logging.getLogger(__name__)

#: A certificate is renewed once this share of its life has passed.
RENEW_AT = 2 / 3
#: Waits between failed requests: doubling from the first to the most.
FIRST_RETRY_S = 0.5
MOST_RETRY_S = 30.0
#: Deadline of one request.
REQUEST_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Enrolled:
    """A certificate written: the identity it names and when it is valid."""

    identity: str
    not_before: datetime.datetime
    not_after: datetime.datetime

    def renew_in_s(self, now: datetime.datetime) -> float:
        """Seconds from `now` until it should be renewed."""
        due = self.not_before + (self.not_after - self.not_before) * RENEW_AT
        return max((due - now).total_seconds(), 0.0)


@dataclasses.dataclass(frozen=True)
class IssuerSource:
    """Where a service gets its certificate: the --issuer flags."""

    address: str
    token_file: pathlib.Path
    ca_file: pathlib.Path
    folder: pathlib.Path

    def request(self) -> Enrolled:
        """One certificate, written into `folder`.

        Raises:
            ConfigError: the token or CA file cannot be read.
            grpc.RpcError: the issuer refused or could not be reached.
            Unavailable: the issuer's answer is not a certificate for this key.
        """
        token = read_token(self.token_file, "--issuer-token-file")
        try:
            ca = self.ca_file.read_bytes()
        except OSError as exc:
            raise ConfigError("--issuer-ca", f"cannot be read: {exc}", str(self.ca_file)) from None
        key = ec.generate_private_key(ec.SECP256R1())
        csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, hashes.SHA256())
        with create_issuer_channel(self.address, ca=ca) as channel:
            request = issuer_pb2.IssueRequest(csr=csr.public_bytes(serialization.Encoding.PEM), token=token)
            response = issuer_pb2_grpc.IssuerStub(channel).Issue(request, timeout=REQUEST_TIMEOUT_S)
        try:
            cert = x509.load_pem_x509_certificate(response.certificate)
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            identity = identity_of_names(names.get_values_for_type(x509.UniformResourceIdentifier))
        except (ValueError, x509.ExtensionNotFound, BatchplaneError) as exc:
            raise Unavailable(f"the issuer at {self.address} sent a certificate that is not usable: {exc}") from None
        if identity is None or cert.public_key() != key.public_key():
            raise Unavailable(f"the issuer at {self.address} sent a certificate naming no identity or not for this process's key")
        write_certificate_folder(self.folder, ca=ca, cert=response.certificate, key=pem_key(key))
        return Enrolled(identity.uri(), cert.not_valid_before_utc, cert.not_valid_after_utc)


class Enrollment:
    """Keeps a service's certificate from `source` current: `start` waits for the first one,
    then a daemon thread renews it until `stop`."""

    def __init__(self, source: IssuerSource) -> None:
        self.source = source
        self.current: Enrolled | None = None
        self._stopped = threading.Event()

    def start(self) -> Enrollment:
        """Gets the first certificate (retrying until the issuer gives one), then renews it on
        a thread of its own. Returns self.

        Raises:
            ConfigError: the token or CA file cannot be read.
        """
        self.current = self._get(first=True)
        log.info("certificate issued: %s, valid until %s", self.current.identity, self.current.not_after.isoformat())
        threading.Thread(target=self._renew, name="enroll", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _renew(self) -> None:
        while self.current is not None and not self._stopped.wait(self.current.renew_in_s(_now())):
            try:
                self.current = self._get(first=False)
            except ConfigError as exc:  # a token file gone: said, and tried again on the next round
                log.warning("renewing the certificate failed: %s", exc)
                continue
            log.info("certificate renewed: valid until %s", self.current.not_after.isoformat())

    def _get(self, *, first: bool) -> Enrolled:
        wait = FIRST_RETRY_S
        told_at: float | None = None
        while True:
            try:
                return self.source.request()
            except (grpc.RpcError, Unavailable) as exc:
                detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                now = time.monotonic()
                if told_at is None or now - told_at >= MOST_RETRY_S:
                    told_at = now
                    kept = (
                        ""
                        if first or self.current is None
                        else f"; the current one stays in use until {self.current.not_after.isoformat()}"
                    )
                    log.warning("the issuer at %s gave no certificate: %s; trying again%s", self.source.address, detail, kept)
            if self._stopped.wait(wait):
                raise ConfigError("--issuer", "stopped before the issuer gave a certificate", self.source.address)
            wait = min(wait * 2, MOST_RETRY_S)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
