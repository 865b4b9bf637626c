"""The operator as certificate issuer (tls.mode issued): a real operator process serving the
Issuer over TLS, asked as a service's enrollment (`core.enroll`) asks. The Kubernetes API's
TokenReview and pods are a stand-in (`token_review_api`): no API server can run here.

Asserted: each pod is issued its own identity and only that (the token names the pod, the
ServiceAccount the role, the pod's labels the index), short-lived and chained to the CA;
unknown tokens, tokens for another audience, unmapped accounts, finished pods, bad CSRs and a
client trusting another CA get nothing; an intermediate CA (cert-manager's) signs chains that
peers trusting only the root accept, and a renewed one is used. A whole job run from the chart's
own rendered pods, and the attacks with one pod's credentials, are test_chart_replay.py."""

from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from ca_material import intermediate
from harness import wait_until
from token_review_api import TokenReviewApi

from batchplane.core.enroll import IssuerSource
from batchplane.core.identity import identity_of_names
from batchplane.core.issuance import GROUP_INDEX_LABEL, POD_NAME_EXTRA, POD_UID_EXTRA, IssuancePolicy
from batchplane.core.localca import LocalCA
from batchplane.operator.issuer import CurrentCA, IssuerMetrics, IssuerService
from batchplane.v1 import issuer_pb2, issuer_pb2_grpc

pytestmark = pytest.mark.integration

NS = "training"
LIFETIME_S = 3600
ACCOUNTS = {"planner": "bp-planner", "loader": "bp-loader", "constructor": "bp-trainer"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_pod(name: str, account: str, *, labels: dict | None = None, annotations: dict | None = None, phase: str = "Running") -> dict:
    return {
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "labels": labels or {}, "annotations": annotations or {}},
        "spec": {"serviceAccountName": account, "containers": [{"name": "main"}]},
        "status": {"phase": phase},
    }


@dataclasses.dataclass
class Issuer:
    address: str
    ca: LocalCA
    api: TokenReviewApi
    folder: pathlib.Path

    def pod(self, name: str, account: str, **kwargs) -> pathlib.Path:
        """Registers a pod and writes its projected token; returns the token file."""
        token = f"token-of-{name}-{os.urandom(8).hex()}"
        self.api.add_pod(token, make_pod(name, account, **kwargs))
        path = self.folder / "tokens" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)
        return path

    def source(self, token_file: pathlib.Path, folder: pathlib.Path, *, ca_file: pathlib.Path | None = None) -> IssuerSource:
        return IssuerSource(self.address, token_file, ca_file or self.ca_file, folder)

    @property
    def ca_file(self) -> pathlib.Path:
        return self.folder / "ca-bundle" / "ca.crt"


@pytest.fixture(scope="module")
def issuer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Issuer]:
    folder = tmp_path_factory.mktemp("issuer")
    api = TokenReviewApi()
    ca = LocalCA(folder / "ca-secret")  # ca.crt and ca.key, as the chart's CA Secret holds them
    (folder / "ca-bundle").mkdir()
    (folder / "ca-bundle" / "ca.crt").write_bytes(ca.pem)  # the ConfigMap every pod mounts
    port = free_port()
    args = ["--namespace", NS, "--prometheus", "http://127.0.0.1:9", "--kube-api", api.url, "--no-leader-elect"]
    args += ["--metrics-port", "0", "--interval-s", "3600", "--issuer-port", str(port), "--issuer-host", "127.0.0.1"]
    args += ["--issuer-ca-dir", str(folder / "ca-secret"), "--issuer-index-from", "indexed-job", "--issuer-lifetime-s", str(LIFETIME_S)]
    for role, account in ACCOUNTS.items():
        args += ["--issuer-role", f"{role}={account}"]
    log = (folder / "operator.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "batchplane.operator", *args], stdout=log, stderr=subprocess.STDOUT)
    found = Issuer(f"127.0.0.1:{port}", ca, api, folder)

    def serving() -> bool:
        assert process.poll() is None, (folder / "operator.log").read_text()
        return _issue_code(found.address, found.ca_file, b"", "") == grpc.StatusCode.INVALID_ARGUMENT

    try:
        wait_until(serving, timeout_s=30, what="the operator's issuer to serve")
        yield found
    finally:
        process.terminate()
        process.wait(timeout=15)
        log.close()
        api.stop()


def _issue_code(address: str, ca_file: pathlib.Path, csr: bytes, token: str) -> grpc.StatusCode:
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_file.read_bytes())
    with grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", "operator.batchplane")]) as channel:
        try:
            issuer_pb2_grpc.IssuerStub(channel).Issue(issuer_pb2.IssueRequest(csr=csr, token=token), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def issued_identity(folder: pathlib.Path) -> str:
    cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    identity = identity_of_names(names.get_values_for_type(x509.UniformResourceIdentifier))
    assert identity is not None
    return identity.uri()


def test_each_pod_is_issued_its_own_identity_short_lived_and_chained_to_the_ca(issuer: Issuer, tmp_path: pathlib.Path) -> None:
    pods: dict[str, tuple[dict[str, Any], str]] = {
        "planner-5c": ({"account": ACCOUNTS["planner"]}, "batchplane://planner"),
        "dp-loader-web-7d-q2": (
            {"account": ACCOUNTS["loader"], "labels": {GROUP_INDEX_LABEL: "1"}},
            "batchplane://loader/1/dp-loader-web-7d-q2",
        ),
        "train-3-x": (
            {"account": ACCOUNTS["constructor"], "annotations": {"batch.kubernetes.io/job-completion-index": "3"}},
            "batchplane://constructor/3",
        ),
    }
    for name, (kwargs, expected) in pods.items():
        token = issuer.pod(name, kwargs.pop("account"), **kwargs)
        enrolled = issuer.source(token, tmp_path / name).request()
        assert enrolled.identity == expected == issued_identity(tmp_path / name)
        cert = x509.load_pem_x509_certificate((tmp_path / name / "tls.crt").read_bytes())
        cert.verify_directly_issued_by(issuer.ca.cert)
        key = serialization.load_pem_private_key((tmp_path / name / "tls.key").read_bytes(), password=None)
        assert key.public_key() == cert.public_key()
        assert (tmp_path / name / "ca.crt").read_bytes() == issuer.ca_file.read_bytes()
        life = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert life <= datetime.timedelta(seconds=LIFETIME_S, minutes=5)  # the CA's allowance for clock skew
        # Asked again (a renewal), a new key gets a new certificate of the same identity.
        again = issuer.source(token, tmp_path / name).request()
        assert again.identity == expected
        assert x509.load_pem_x509_certificate((tmp_path / name / "tls.crt").read_bytes()).serial_number != cert.serial_number


def test_whoever_cannot_prove_a_role_gets_nothing(issuer: Issuer, tmp_path: pathlib.Path) -> None:
    unmapped = issuer.pod("debug-shell", "default")
    finished = issuer.pod("dp-loader-web-7d-zz", ACCOUNTS["loader"], labels={GROUP_INDEX_LABEL: "0"}, phase="Succeeded")
    unlabelled = issuer.pod("stray-loader", ACCOUNTS["loader"])
    other_audience = tmp_path / "api-token"
    other_audience.write_text("api-audience-token")
    issuer.api.add_pod("api-audience-token", make_pod("planner-api", ACCOUNTS["planner"]), audiences=("https://kubernetes.default.svc",))
    forged = tmp_path / "forged"
    forged.write_text("eyJhbGciOi.forged.token")
    cases = {
        unmapped: (grpc.StatusCode.PERMISSION_DENIED, "given no batchplane role"),
        finished: (grpc.StatusCode.PERMISSION_DENIED, "has finished"),
        unlabelled: (grpc.StatusCode.PERMISSION_DENIED, GROUP_INDEX_LABEL),
        other_audience: (grpc.StatusCode.UNAUTHENTICATED, "not authenticated"),
        forged: (grpc.StatusCode.UNAUTHENTICATED, "not authenticated"),
    }
    for token, (code, words) in cases.items():
        with pytest.raises(grpc.RpcError) as refused:
            issuer.source(token, tmp_path / token.name).request()
        assert refused.value.code() == code and words in refused.value.details(), (token.name, refused.value)
        assert not (tmp_path / token.name / "tls.crt").exists()
    good = issuer.pod("planner-6d", ACCOUNTS["planner"]).read_text()
    assert (
        _issue_code(issuer.address, issuer.ca_file, b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA", good) == grpc.StatusCode.INVALID_ARGUMENT
    )
    # A client that trusts another CA does not take the issuer for one it trusts.
    other = LocalCA(None)
    (tmp_path / "other-ca.crt").write_bytes(other.pem)
    assert _issue_code(issuer.address, tmp_path / "other-ca.crt", b"", good) == grpc.StatusCode.UNAVAILABLE


# ---- a CA that cert-manager issues and renews (an intermediate) ----------------------------------


def intermediate_ca(root: LocalCA, folder: pathlib.Path, *, name: str) -> LocalCA:
    """An intermediate CA signed by `root`, written as the chart mounts cert-manager's CA Secret
    (tls.crt as ca.crt, holding the intermediate and the root; tls.key as ca.key)."""
    cert, key = intermediate(root, name)
    folder.mkdir(parents=True, exist_ok=True)
    swap = folder / "swap"
    swap.mkdir()
    (swap / "ca.crt").write_bytes(cert + root.pem)
    (swap / "ca.key").write_bytes(key)
    for name in ("ca.crt", "ca.key"):  # replaced by rename, as the kubelet swaps a Secret's files
        os.replace(swap / name, folder / name)
    swap.rmdir()
    return LocalCA.load(folder)


def test_an_intermediate_ca_signs_chains_that_peers_trusting_only_the_root_accept(tmp_path: pathlib.Path) -> None:
    """cert-manager's CA (signed by the cluster's own issuer, renewed by cert-manager) behind the
    issuer: each leaf comes with the intermediate, a peer that trusts only the root accepts it,
    and a renewed intermediate is signed with from the next check on."""
    root = LocalCA(None)
    first = intermediate_ca(root, tmp_path / "ca", name="batchplane issuer 1")
    current = CurrentCA(tmp_path / "ca")
    policy = IssuancePolicy(NS, {"bp-planner": "planner"})
    review_status = {
        "authenticated": True,
        "audiences": ["batchplane"],
        "user": {"username": f"system:serviceaccount:{NS}:bp-planner", "extra": {POD_NAME_EXTRA: ["p"], POD_UID_EXTRA: ["uid-p"]}},
    }
    service = IssuerService(
        current,
        policy,
        review=lambda token, audience: review_status,
        get_pod=lambda namespace, name: make_pod("p", "bp-planner"),
        lifetime_s=LIFETIME_S,
        metrics=IssuerMetrics(CollectorRegistry()),
    )
    key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([])).sign(key, hashes.SHA256())
    request = issuer_pb2.IssueRequest(csr=csr.public_bytes(serialization.Encoding.PEM), token="t")
    response = service.Issue(request, context=None)
    chain = x509.load_pem_x509_certificates(response.certificate)
    assert len(chain) == 3 and chain[1] == first.cert  # the leaf, the intermediate, the root its file holds
    chain[0].verify_directly_issued_by(first.cert)
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    assert _handshake(response.certificate, pem_key, root.pem) == health_pb2.HealthCheckResponse.SERVING

    second = intermediate_ca(root, tmp_path / "ca", name="batchplane issuer 2")  # cert-manager renewed it
    current.CHECK_S = 0.0
    renewed = x509.load_pem_x509_certificates(service.Issue(request, context=None).certificate)
    assert renewed[1] == second.cert != first.cert
    renewed[0].verify_directly_issued_by(second.cert)


def _handshake(chain: bytes, key: bytes, root: bytes) -> int:
    """The health status a client trusting only `root` reads from a server presenting `chain`."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, chain)]))
    server.start()
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=root)
        options = [("grpc.ssl_target_name_override", "planner.batchplane")]
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    finally:
        server.stop(0)
