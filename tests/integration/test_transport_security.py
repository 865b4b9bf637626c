"""Mutual TLS between the parts, each allowed only its own calls, on a real `batchplane up` job
(processes on 127.0.0.1 with the certificates of the run's throwaway CA): the job runs end to end
over TLS; callers without a certificate, with another CA's, with one naming no identity, with
another role's or another index's are refused, each with the status stated; a certificate
rotated mid-job is picked up by every process without a restart and without losing a step; the
trainer's socket is entered only by the pod's group, also by a trainer of another user id."""

from __future__ import annotations

import collections
import datetime
import hashlib
import os
import pathlib
import socket
import ssl
import stat
import subprocess
import sys
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import collect, peer_channel, scrape, start_cluster, wait_until, write_job, write_source

from batchplane.core.identity import Identity
from batchplane.core.localca import LocalCA, write_certificate_folder
from batchplane.core.tls import RELOAD_CHECK_S, CertificateFolder, Security, read_role_verifiers
from batchplane.launcher.local import _identity_of
from batchplane.v1 import planner_pb2, planner_pb2_grpc

pytestmark = pytest.mark.integration

ROTATE_AT_STEP = 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("data")
    return [write_source(root, "a", [20] * 240, seed=1), write_source(root, "b", [30] * 120, seed=2)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, dataset):
    folder = tmp_path_factory.mktemp("job")
    cluster = start_cluster(write_job(folder / "job.yaml", dataset, loaders={"count": 2}))
    yield cluster
    cluster.stop()


def _planner(channel: grpc.Channel) -> planner_pb2_grpc.PlannerStub:
    return planner_pb2_grpc.PlannerStub(channel)


def _code_of_get_job(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        _planner(channel).GetJob(planner_pb2.GetJobRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _tls_channel(address: str, *, ca: bytes, cert: bytes | None = None, key: bytes | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", "planner.batchplane")])


def _certificate_without_identity(ca: LocalCA) -> tuple[bytes, bytes]:
    """A certificate of the job's CA that names no batchplane:// identity (a DNS name only)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "someone")]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("someone.example")]), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def test_every_part_serves_over_mutual_tls_and_trainers_over_local_sockets(cluster) -> None:
    for p in cluster.processes:
        assert "(mutual TLS)" in p.log_path.read_text(), p.name
    for p in cluster.constructors:
        assert p.address.startswith("unix://"), p.address
    with pytest.raises(OSError):  # the planner speaks TLS only: a plaintext HTTP/2 preface is refused
        with socket.create_connection(tuple(cluster.planner.address.rsplit(":", 1)), timeout=5) as s:
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            if not s.recv(1024):
                raise ConnectionResetError("closed")


def test_callers_without_a_valid_identity_are_refused(cluster, tmp_path) -> None:
    address = cluster.planner.address
    ca = cluster.ca.pem
    # No TLS at all, and TLS without a client certificate: the handshake itself fails.
    assert _code_of_get_job(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    assert _code_of_get_job(_tls_channel(address, ca=ca)) == grpc.StatusCode.UNAVAILABLE
    # A certificate of another CA: refused in the handshake too.
    stranger = LocalCA(tmp_path / "other-ca").issue(Identity("operator"), tmp_path / "stranger")
    material = CertificateFolder(stranger).read()
    assert _code_of_get_job(_tls_channel(address, ca=ca, cert=material[1], key=material[2])) == grpc.StatusCode.UNAVAILABLE
    # A certificate of the job's CA naming no identity: authenticated transport, no role.
    cert, key = _certificate_without_identity(cluster.ca)
    assert _code_of_get_job(_tls_channel(address, ca=ca, cert=cert, key=key)) == grpc.StatusCode.UNAUTHENTICATED


def test_each_role_may_make_only_its_own_calls_for_its_own_index(cluster) -> None:
    planner = cluster.planner.address
    with peer_channel(cluster, planner, role="operator") as channel:
        assert _planner(channel).GetStatus(planner_pb2.GetStatusRequest(), timeout=5).job.fingerprint == cluster.job.fingerprint
        with pytest.raises(grpc.RpcError) as info:  # another role's call
            _planner(channel).GetPlan(planner_pb2.GetPlanRequest(constructor_index=0, step=0, wait_ms=10), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with peer_channel(cluster, planner, role="loader", index=0, replica="0") as channel:
        with pytest.raises(grpc.RpcError) as info:
            _planner(channel).GetPlan(planner_pb2.GetPlanRequest(constructor_index=0, step=0, wait_ms=10), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:  # registering another replica's id
            _planner(channel).RegisterLoader(
                planner_pb2.RegisterLoaderRequest(loader_index=0, replica="rogue", address="127.0.0.1:9"), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as info:  # another group's
            _planner(channel).DeregisterLoader(planner_pb2.DeregisterLoaderRequest(loader_index=1, replica="1"), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "replica" not in info.value.details() or "1" not in info.value.details().split("only")[-1]
    with peer_channel(cluster, planner, role="constructor", index=1) as channel:
        with pytest.raises(grpc.RpcError) as info:  # another constructor's plan
            _planner(channel).GetPlan(planner_pb2.GetPlanRequest(constructor_index=0, step=0, wait_ms=10), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "only for itself" in info.value.details()
        # The health service answers any authenticated caller.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert scrape(_metrics_url(cluster, "planner"))['batchplane_planner_requests_total{code="PERMISSION_DENIED",method="GetPlan"}'] >= 3


def _metrics_url(cluster, name: str) -> str:
    p = next(p for p in cluster.processes if p.name == name)
    return f"http://127.0.0.1:{p.metrics_port}/metrics"


def _served_serial(address: str, folder: pathlib.Path) -> int:
    """The serial number of the certificate a server presents in a new handshake (read with the
    standard library's TLS, as any client would see it)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(folder / "ca.crt"))
    context.load_cert_chain(folder / "tls.crt", folder / "tls.key")
    context.set_alpn_protocols(["h2"])
    context.check_hostname = False
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw, context.wrap_socket(raw) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def _serial_in(folder: pathlib.Path) -> int:
    return x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes()).serial_number


def test_a_certificate_rotated_mid_job_is_picked_up_without_a_restart_or_a_lost_step(cluster, dataset) -> None:
    pids = {p.name: p.pid for p in cluster.processes}
    before = _served_serial(cluster.planner.address, cluster.tls_dir / "launcher")
    rotated: list[str] = []

    def rotate(rank: int, batch: dict) -> None:
        if rank == 0 and batch["step"] == ROTATE_AT_STEP:
            for p in cluster.processes:  # as cert-manager renews a Secret: every part gets a new key and certificate
                cluster.ca.issue(_identity_of(p.module, p.args), cluster.tls_dir / p.name)
                rotated.append(p.name)
        if rotated:
            time.sleep(3 * RELOAD_CHECK_S / 10)  # a trainer's step: the job outlasts the processes' next look at their files

    def reloads(p) -> float:
        return scrape(_metrics_url(cluster, p.name)).get(f"batchplane_{p.module.rsplit('.', 1)[-1]}_certificate_reloads_total", 0)

    batches, _ = collect(cluster.endpoints_path, range(2), on_batch=rotate)
    assert len(rotated) == len(cluster.processes)
    for p in cluster.processes:  # each read its new certificate while the job ran (servers at a handshake, channels at a call)
        assert reloads(p) >= 1, p.name
    wait_until(
        lambda: _served_serial(cluster.planner.address, cluster.tls_dir / "launcher") == _serial_in(cluster.tls_dir / "planner"),
        timeout_s=10,
        what="the planner to present its new certificate",
    )
    assert _serial_in(cluster.tls_dir / "planner") != before
    assert {p.name: p.pid for p in cluster.processes} == pids, "a process was restarted"
    seen = collections.Counter(
        (s, r)
        for rank in batches.values()
        for b in rank
        for mb in b["microbatches"]
        for s, r in zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())
    )
    assert max(seen.values()) == 1, "a sample arrived twice"
    assert set(seen) == {(k, r) for k, s in enumerate(dataset) for r in range(len(s.rows))}
    steps = [b["step"] for b in batches[0]]
    assert steps == list(range(len(steps))) and [b["step"] for b in batches[1]] == steps


def test_the_trainer_socket_admits_only_the_pods_group_whatever_its_user_id(cluster) -> None:
    assert os.geteuid() == 0, "this test runs clients as other user ids: run the suite as root (as CI does)"
    path = pathlib.Path(cluster.constructors[0].address.removeprefix("unix://"))
    folder = path.parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o2770
    assert stat.S_IMODE(path.stat().st_mode) & 0o007 == 0
    group = folder.stat().st_gid

    # The trainer container's user: another uid, in the pod's group (fsGroup) or not. A forked
    # child takes it (no interpreter needed that the other user may not be allowed to run).
    def connect(groups: list[int]) -> str:
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through its exit status only
            code = 3
            try:
                os.setgroups(groups)
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(path))
                code = 0
            except PermissionError:
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        return {0: "connected", 1: "EACCES"}.get(os.waitstatus_to_exitcode(status), "failed")

    assert connect([group]) == "connected"  # another user in the pod's group reaches the socket
    assert connect([]) == "EACCES"  # another user outside it cannot


def test_a_token_names_the_role_where_certificates_cannot(tmp_path) -> None:
    """A server with per-role tokens takes the caller's role from its bearer token (certificates
    from a store that cannot carry roles); a missing or wrong token is refused UNAUTHENTICATED,
    and a token contradicting the certificate's role too."""
    from concurrent import futures

    from prometheus_client import CollectorRegistry

    from batchplane.core.rpc import RpcSettings, ServerMetrics, create_grpc_server

    ca = LocalCA(tmp_path / "ca")
    server_folder = ca.issue(Identity("planner"), tmp_path / "server")
    cert, key = _certificate_without_identity(ca)
    write_certificate_folder(tmp_path / "anonymous", ca=ca.pem, cert=cert, key=key)
    # The server holds the operator's token as a verifier only (its SHA-256), the loader's as the
    # token itself (hashed as read): either way it keeps digests, never another role's token.
    accepted = tmp_path / "auth-tokens"
    accepted.mkdir()
    (accepted / "operator.sha256").write_text(hashlib.sha256(b"t-operator").hexdigest() + "\n")
    (accepted / "loader").write_text("t-loader\n")
    security = Security(CertificateFolder(server_folder), role_verifiers=read_role_verifiers(accepted))
    assert "t-operator" not in repr(vars(security)) and "t-loader" not in repr(vars(security))
    server, port, health = create_grpc_server(
        RpcSettings(security=security, max_message_bytes=4 << 20),
        host="127.0.0.1",
        port=0,
        metrics=ServerMetrics("planner", CollectorRegistry()),
    )

    class Status(planner_pb2_grpc.PlannerServicer):
        def GetStatus(self, request, context):  # noqa: N802 - the RPC's name
            return planner_pb2.GetStatusResponse(steps_planned=7)

    planner_pb2_grpc.add_PlannerServicer_to_server(Status(), server)
    server.start()
    try:

        def status(folder: str, token: str | None) -> grpc.StatusCode:
            channel = Security(CertificateFolder(tmp_path / folder), token=token).channel(f"127.0.0.1:{port}", peer="planner")
            with channel:
                try:
                    _planner(channel).GetStatus(planner_pb2.GetStatusRequest(), timeout=5)
                except grpc.RpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        assert status("anonymous", "t-operator") == grpc.StatusCode.OK
        assert status("anonymous", "t-loader") == grpc.StatusCode.PERMISSION_DENIED  # a loader may not ask for status
        assert status("anonymous", "wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert status("anonymous", None) == grpc.StatusCode.UNAUTHENTICATED
        ca.issue(Identity("constructor", 0), tmp_path / "constructor")
        assert status("constructor", "t-operator") == grpc.StatusCode.UNAUTHENTICATED  # certificate and token disagree
    finally:
        server.stop(0)
    del futures


def test_a_process_given_an_unreadable_token_or_no_certificates_does_not_start(cluster, tmp_path) -> None:
    config = str(cluster.config_path)
    for extra, message in (
        (
            ["--tls-dir", str(cluster.tls_dir / "planner"), "--token-file", str(tmp_path / "missing")],
            "--token-file: cannot read token file",
        ),
        ([], "network.tls: is on, so every part needs --tls-dir"),
        (["--tls-dir", str(tmp_path)], "--tls-dir: cannot read"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "batchplane.planner", "--config", config, "--run-dir", str(tmp_path / "run"), *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert message in out.stderr
