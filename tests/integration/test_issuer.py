"""The operator as certificate issuer (tls.mode issued), run as its pod runs it: a real operator
process serving the Issuer over TLS, and real planner, loader and constructor processes that
get their certificates from it with `--issuer`, as the chart starts them. The Kubernetes API's
TokenReview and pods are a stand-in (`token_review_api`): no API server can run here.

Asserted: each pod is issued its own identity and only that (the token names the pod, the
ServiceAccount the role, the pod's labels the index); unknown tokens, unmapped accounts, bad CSRs
and a client trusting another CA get nothing; a job whose parts hold issued certificates delivers
every source row once, byte for byte; with a loader pod's credentials (its token, its issued
certificate and key) an attacker can act only as that loader replica — never as another
replica, group or role — and the CA key is in no file a service was given."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from harness import Batch, run_ranks, to_numpy, wait_until, write_job, write_source
from token_review_api import TokenReviewApi

from batchplane.client import Client
from batchplane.core.enroll import IssuerSource
from batchplane.core.identity import identity_of_names
from batchplane.core.issuance import GROUP_INDEX_LABEL, POD_NAME_EXTRA, POD_UID_EXTRA, IssuancePolicy
from batchplane.core.localca import LocalCA
from batchplane.core.tls import CertificateFolder, Security
from batchplane.operator.issuer import CurrentCA, IssuerMetrics, IssuerService
from batchplane.v1 import issuer_pb2, issuer_pb2_grpc, loader_pb2, loader_pb2_grpc, planner_pb2, planner_pb2_grpc

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


# ---- a job whose parts hold issued certificates --------------------------------------------------


@dataclasses.dataclass
class Part:
    name: str
    process: subprocess.Popen
    tls_dir: pathlib.Path
    token_file: pathlib.Path
    ready: pathlib.Path

    def address(self) -> str:
        return json.loads(self.ready.read_text())["address"]


def start_part(issuer: Issuer, run: pathlib.Path, module: str, name: str, token: pathlib.Path, *args: str) -> Part:
    """A service process with the --issuer flags its pod gets; its --tls-dir an empty folder of its own."""
    tls_dir = run / "tls" / name
    ready = run / f"{name}.ready"
    flags = ["--config", str(run / "job.yaml"), "--metrics-port", "0", "--ready-file", str(ready), "--exit-with-parent"]
    flags += ["--issuer", issuer.address, "--issuer-token-file", str(token), "--issuer-ca", str(issuer.ca_file), "--tls-dir", str(tls_dir)]
    log = (run / f"{name}.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", f"batchplane.{module}", *flags, *args], stdout=log, stderr=subprocess.STDOUT)
    return Part(name, process, tls_dir, token, ready)


@contextlib.contextmanager
def running(parts: list[Part]) -> Iterator[None]:
    try:
        yield
    finally:
        for part in parts:
            part.process.terminate()
        for part in parts:
            try:
                part.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                part.process.kill()


def test_a_job_with_issued_certificates_runs_and_a_loader_pod_acts_only_as_itself(issuer: Issuer) -> None:
    run = pathlib.Path(tempfile.mkdtemp(prefix="bpiss", dir="/tmp"))  # Unix socket paths must stay short
    source = write_source(run / "data", "s", [24] * 90, seed=5)
    write_job(run / "job.yaml", [source], loaders={"count": 1})
    port = free_port()
    planner = start_part(issuer, run, "planner", "planner", issuer.pod("bp-planner-0", ACCOUNTS["planner"]), "--port", str(port))
    loader_token = issuer.pod("dp-loader-0-abc", ACCOUNTS["loader"], labels={GROUP_INDEX_LABEL: "0"})
    at = f"127.0.0.1:{port}"
    loader = start_part(issuer, run, "loader", "loader", loader_token, "--index", "0", "--replica", "dp-loader-0-abc", "--planner", at)
    constructors = [
        start_part(
            issuer,
            run,
            "constructor",
            f"constructor-{i}",
            issuer.pod(f"train-{i}", ACCOUNTS["constructor"], annotations={"batch.kubernetes.io/job-completion-index": str(i)}),
            "--index",
            str(i),
            "--planner",
            at,
            "--listen",
            f"unix://{run}/c{i}.sock",
        )
        for i in range(2)
    ]
    parts = [planner, loader, *constructors]
    with running(parts):
        for part in parts:
            wait_until(lambda p=part: p.ready.exists() or p.process.poll() is not None, timeout_s=60, what=f"{part.name} to serve")
            assert part.process.poll() is None, (run / f"{part.name}.log").read_text()
        assert issued_identity(loader.tls_dir) == "batchplane://loader/0/dp-loader-0-abc"
        assert issued_identity(constructors[1].tls_dir) == "batchplane://constructor/1"

        # What an attacker in the loader pod holds: its token, its certificate and key.
        stolen = Security(CertificateFolder(loader.tls_dir))
        with stolen.channel(at, peer="planner") as channel:
            stub = planner_pb2_grpc.PlannerStub(channel)
            denied = {
                "RegisterLoader as another replica": lambda: stub.RegisterLoader(
                    planner_pb2.RegisterLoaderRequest(loader_index=0, replica="dp-loader-0-rogue", address="127.0.0.1:1"), timeout=5
                ),
                "RegisterLoader for another group": lambda: stub.RegisterLoader(
                    planner_pb2.RegisterLoaderRequest(loader_index=1, replica="dp-loader-0-abc", address="127.0.0.1:1"), timeout=5
                ),
                "DeregisterLoader of another replica": lambda: stub.DeregisterLoader(
                    planner_pb2.DeregisterLoaderRequest(loader_index=0, replica="dp-loader-0-other"), timeout=5
                ),
                "GetPlan as a constructor": lambda: stub.GetPlan(planner_pb2.GetPlanRequest(constructor_index=0, step=0), timeout=5),
                "GetStatus as the operator": lambda: stub.GetStatus(planner_pb2.GetStatusRequest(), timeout=5),
            }
            for what, call in denied.items():
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
        with stolen.channel(loader.address(), peer="loader") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                list(loader_pb2_grpc.LoaderStub(channel).FetchSamples(loader_pb2.FetchSamplesRequest(constructor_index=0), timeout=5))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Its token gets it nothing but its own identity again.
        assert issuer.source(loader_token, run / "minted").request().identity == "batchplane://loader/0/dp-loader-0-abc"
        # The CA key is in no file any service was given.
        ca_key = (issuer.folder / "ca-secret" / "ca.key").read_bytes()
        given = [f for p in parts for f in [p.token_file, *p.tls_dir.rglob("*")] if f.is_file()]
        assert given and not any(ca_key in f.read_bytes() for f in given)

        batches = collect_from(constructors, run, ranks=range(2))
    seen: collections.Counter[int] = collections.Counter()
    for rank_batches in batches.values():
        for batch in rank_batches:
            for mb in batch["microbatches"]:
                for i, row in enumerate(mb["sample_row"].tolist()):
                    seen[row] += 1
                    length = int(mb["sample_length"][i])
                    assert mb["input_ids"][i, :length].tobytes() == source.rows[row].tobytes()
    assert seen == {row: 1 for row in range(len(source.rows))}


def collect_from(constructors: list[Part], run: pathlib.Path, *, ranks: range) -> dict[int, list[Batch]]:
    """Every rank's batches through the client, each rank at its constructor's socket, all at once (as trainers run)."""
    out: dict[int, list[Batch]] = {}

    def one(rank: int) -> None:
        with Client(rank=rank, address=f"unix://{run}/c{rank}.sock", timeout_s=60) as client:
            out[rank] = [to_numpy(batch) for batch in client]

    run_ranks(one, ranks)
    return out


# ---- a CA that cert-manager issues and renews (an intermediate) ----------------------------------


def intermediate_ca(root: LocalCA, folder: pathlib.Path, *, name: str) -> LocalCA:
    """An intermediate CA signed by `root`, written as the chart mounts cert-manager's CA Secret
    (tls.crt as ca.crt, holding the intermediate and the root; tls.key as ca.key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(root.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(root.key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    swap = folder / "swap"
    swap.mkdir()
    (swap / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM) + root.pem)
    (swap / "ca.key").write_bytes(pem_key)
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
