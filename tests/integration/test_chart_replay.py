"""The chart's default security replayed from outside: render the chart (tls.mode issued, the
default; certManager; existingSecret; and issued with operator.enabled false, where this
release's operator pods are its issuer alone) and run its operator, planner, a loader of the DataPlane's group and the trainer pods'
constructor sidecars as processes with exactly the args, environment and mounted files their
pods get — the CA Secret's keys in the operator's --issuer-ca-dir, the CA ConfigMap and a
projected token in each service pod, an empty --tls-dir — then attack with what one pod holds.

What differs from a cluster, and why: every path under a volume's mountPath lies in a folder of
this test (the pod's filesystem); Service names and pod IPs are 127.0.0.1 with free ports
(`--port`, `--issuer-port`, metrics ports 0), and the job's `network.host` is 127.0.0.1 (tests
bind loopback only); the operator is given `--kube-api`, a stand-in answering TokenReviews for
the projected tokens registered here and GETs of the pods they name (`token_review_api`: no API
server can run here), which stands in for the in-cluster configuration.

Asserted: the job delivers every source row once, byte for byte; with one loader pod's mounts
an attacker is issued only that replica's identity and can register, deregister and fetch only
as it — every cross-replica, cross-group and cross-role call is refused; with one trainer pod's
sidecar mounts only its own constructor index; no service pod's files hold the CA key or any
token but its own projected one.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import pytest
import yaml
from cryptography import x509
from ca_material import intermediate as intermediate_ca, pem_key
from harness import Batch, run_ranks, to_numpy, wait_until, write_source
from test_helm_chart import NAMESPACE, RELEASE, all_of, helm_binary, loader_deployments, one, template
from token_review_api import TokenReviewApi

from batchplane.client import Client
from batchplane.core.enroll import IssuerSource
from batchplane.core.localca import LocalCA
from batchplane.core.tls import CertificateFolder, Security
from batchplane.v1 import loader_pb2, loader_pb2_grpc, planner_pb2, planner_pb2_grpc

pytestmark = pytest.mark.integration

PODS = 2  # trainer pods, one constructor each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Pod:
    """A rendered pod: its metadata, spec and the local folder its volumes are mounted under."""

    name: str
    meta: dict[str, Any]
    spec: dict[str, Any]
    root: pathlib.Path
    token: str = ""

    def mounts(self, container: dict[str, Any]) -> dict[str, pathlib.Path]:
        """mountPath -> the local folder holding that volume, for `container`."""
        return {m["mountPath"]: self.root / m["name"] for m in container.get("volumeMounts", [])}

    def local(self, container: dict[str, Any], path: str) -> str:
        """Where `path` in the container lies here (through the longest mountPath it is under)."""
        mounts = self.mounts(container)
        for mount in sorted(mounts, key=len, reverse=True):
            if path == mount or path.startswith(mount.rstrip("/") + "/"):
                return str(mounts[mount] / path[len(mount) :].lstrip("/"))
        return path


class Cluster:
    """The rendered objects, the TokenReview stand-in, and what runs."""

    def __init__(self, docs: list[dict], root: pathlib.Path) -> None:
        self.docs, self.root = docs, root
        self.api = TokenReviewApi()
        self.addresses: dict[str, str] = {}  # "<service>.<ns>.svc:<port>" as rendered -> 127.0.0.1:<free port>
        self.processes: list[tuple[str, subprocess.Popen]] = []

    def pod(self, name: str, template_: dict[str, Any], *, annotations: Mapping[str, str] = {}) -> Pod:
        """A pod made from `template_`, its volumes written from the rendered ConfigMaps and
        Secrets and its projected token registered with the API stand-in."""
        meta = {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"uid-{name}",
            "labels": dict(template_.get("metadata", {}).get("labels", {})),
            "annotations": {**template_.get("metadata", {}).get("annotations", {}), **annotations},
        }
        spec = template_["spec"]
        pod = Pod(name, meta, spec, self.root / name)
        for volume in spec.get("volumes", []):
            folder = pod.root / volume["name"]
            folder.mkdir(parents=True, exist_ok=True)
            sources = volume["projected"]["sources"] if "projected" in volume else [volume]
            for source in sources:
                if "serviceAccountToken" in source:
                    pod.token = f"projected-{name}-{os.urandom(12).hex()}"
                    audience = source["serviceAccountToken"]["audience"]
                    body = {"metadata": meta, "spec": {**spec, "serviceAccountName": spec.get("serviceAccountName", "default")}}
                    self.api.add_pod(pod.token, {**body, "status": {"phase": "Running"}}, audiences=(audience,))
                    (folder / source["serviceAccountToken"]["path"]).write_text(pod.token)
                for kind, field in (("configMap", "ConfigMap"), ("secret", "Secret")):
                    if kind in source:
                        self._write(folder, field, source[kind])
        return pod

    def _write(self, folder: pathlib.Path, kind: str, source: dict[str, Any]) -> None:
        name = source.get("name") or source.get("secretName")
        obj = next(d for d in all_of(self.docs, kind) if d["metadata"]["name"] == name)
        data = {k: base64.b64decode(v) for k, v in obj.get("data", {}).items()} if kind == "Secret" else {}
        data.update({k: v.encode() for k, v in obj.get("stringData" if kind == "Secret" else "data", {}).items()})
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            (folder / item["path"]).write_bytes(data[item["key"]])

    def address(self, rendered: str) -> str:
        """The local address of a rendered Service address."""
        return self.addresses.setdefault(rendered, f"127.0.0.1:{free_port()}")

    def start(self, pod: Pod, container: dict[str, Any], *, ports: Mapping[str, str], extra: tuple[str, ...] = ()) -> subprocess.Popen:
        """Runs `container` of `pod` through the image's entrypoint with its args (paths under
        its mounts made local, Service addresses local, `ports` flags replaced) and environment."""
        env = self._environment(pod, container)
        args = [re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in container["args"]]
        out: list[str] = []
        for i, arg in enumerate(args):
            flag = args[i - 1] if i else ""
            if flag in ports:
                arg = ports[flag]
            elif re.fullmatch(r"[a-z0-9-]+\.[a-z0-9-]+\.svc(\.[a-z.]+)?:\d+", arg):
                arg = self.address(arg)
            elif arg.startswith("unix://"):
                arg = "unix://" + pod.local(container, arg[len("unix://") :])
            elif arg.startswith("/"):
                arg = pod.local(container, arg)
            out.append(arg)
        log = (self.root / f"{pod.name}-{container['name']}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "batchplane.entrypoint", *out, *extra],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=pod.root,
        )
        self.processes.append((f"{pod.name}-{container['name']}", process))
        return process

    def _environment(self, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
        """The container's environment as the kubelet gives it (the downward API from `pod`)."""
        fields = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "status.podIP": "127.0.0.1", "spec.nodeName": "node-0"}
        env: dict[str, str] = {}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif "fieldRef" in e.get("valueFrom", {}):
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
                env[e["name"]] = pod.meta[match.group(1)].get(match.group(2), "") if match else fields[path]
        return env

    def log(self, name: str) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.root.glob(f"{name}*.log"))

    def stop(self) -> None:
        for _, process in self.processes:
            process.terminate()
        for _, process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        self.api.stop()


def container(spec: dict[str, Any], part: str) -> dict[str, Any]:
    """The container running `part` (a constructor sidecar may be a native sidecar: an init container)."""
    return next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c.get("args", [""])[0] == part)


@dataclasses.dataclass
class Replay:
    mode: str
    cluster: Cluster
    pods: dict[str, Pod]
    source: Any
    planner: str  # the planner's and the loader's local addresses
    loader: str


#: TLS modes replayed -> their values (beside the job's).
MODES = {
    "issued": {},
    "certManager": {"tls": {"mode": "certManager"}},
    "existingSecret": {"tls": {"mode": "existingSecret", "existingSecret": {"ca": "corp-pki-ca"}}},
    # Another release's operator reconciles the DataPlane: this release's operator pods are its
    # issuer alone (--no-reconcile), with the issuer's RBAC only.
    "issuerAlone": {"operator": {"enabled": False}},
}


def signing_ca_secret(name: str, *, intermediate: bool) -> dict[str, Any]:
    """The CA Secret the operator signs with, as it lies in a cluster: cert-manager's for the
    chart's CA Certificate (an intermediate signed by the chart's root: tls.crt the intermediate,
    tls.key its key, ca.crt the root), or a user's root CA (tls.crt and ca.crt the root)."""
    root = LocalCA(None, name="root")
    if not intermediate:
        return _secret(name, {"tls.crt": root.pem, "tls.key": pem_key(root.key), "ca.crt": root.pem})
    cert, key = intermediate_ca(root, name)
    return _secret(name, {"tls.crt": cert, "tls.key": key, "ca.crt": root.pem})


def _secret(name: str, data: dict[str, bytes]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


@pytest.fixture(scope="module", params=list(MODES))
def replay(request: pytest.FixtureRequest) -> Iterator[Replay]:
    root = pathlib.Path(tempfile.mkdtemp(prefix="bprep", dir="/tmp"))  # Unix socket paths must stay short
    source = write_source(root / "data", "web", [32] * 96, seed=7)
    values = {
        "example": {"enabled": True, "kind": "torchrun"},
        "mesh": {"dp": PODS},
        "trainer": {"ranksPerPod": 1},
        "batch": {"globalBatchSize": 8},
        "sourceGroups": [{"name": "text", "sources": [{"name": "web", "path": str(source.path)}]}],
        **MODES[request.param],
    }
    (root / "values.yaml").write_text(yaml.safe_dump(values))
    helm = helm_binary()
    assert helm is not None, "make helm"
    docs = template(helm, "-f", root / "values.yaml")
    identity = one(docs, "DataPlane")["spec"]["loader"].get("identity")
    assert identity, "every TLS mode of the chart issues each pod its own certificate"
    if identity and "caSecret" in identity:  # made by cert-manager, or the user's own, in a cluster
        docs.append(signing_ca_secret(identity["caSecret"], intermediate=request.param == "certManager"))
    cluster = Cluster(docs, root / "pods")
    deployments = {d["metadata"]["name"]: d for d in all_of(docs, "Deployment")}
    operator_tpl = deployments[f"{RELEASE}-batchplane-operator"]["spec"]["template"]
    planner_tpl = deployments[f"{RELEASE}-batchplane-planner"]["spec"]["template"]
    (loader_deployment,) = loader_deployments(docs)
    trainer_tpl = next(d for d in all_of(docs, "Job") if d["spec"].get("completionMode") == "Indexed")["spec"]["template"]
    pods = {
        "operator": cluster.pod("bp-operator-5f6d-a1", operator_tpl),
        "planner": cluster.pod("bp-planner-7c9b-b2", planner_tpl),
        "loader": cluster.pod("bp-loader-text-66f8-c3", loader_deployment["spec"]["template"]),
        **{
            f"trainer-{i}": cluster.pod(
                f"bp-example-{i}-x{i}", trainer_tpl, annotations={"batch.kubernetes.io/job-completion-index": str(i)}
            )
            for i in range(PODS)
        },
    }
    try:
        for pod in pods.values():  # the job's run folder and network host, as the test runs them (see the module's doc)
            job_file = pod.root / "batchplane-job" / "job.yaml"
            if job_file.exists():
                job = yaml.safe_load(job_file.read_text())
                job["network"]["host"] = "127.0.0.1"
                job["run_dir"] = str(pod.root / "run")
                job_file.write_text(yaml.safe_dump(job))
        operator = container(pods["operator"].spec, "operator")
        if "--issuer-port" in operator["args"]:  # the issuer; the operator's other work needs no replay here
            issuer_at = next(a for a in container(pods["planner"].spec, "planner")["args"] if a.endswith(":8443"))
            issuer_port = cluster.address(issuer_at).rsplit(":", 1)[1]
            ports = {"--issuer-port": issuer_port, "--metrics-port": "0"}
            cluster.start(pods["operator"], operator, ports=ports, extra=("--kube-api", cluster.api.url))
        planner_at = one(docs, "DataPlane")["spec"]["planner"]["address"]
        cluster.start(
            pods["planner"],
            container(pods["planner"].spec, "planner"),
            ports={"--port": cluster.address(planner_at).rsplit(":", 1)[1], "--metrics-port": "0"},
        )
        loader_port = str(free_port())
        cluster.start(
            pods["loader"],
            container(pods["loader"].spec, "loader"),
            ports={"--port": loader_port, "--metrics-port": "0", "--advertise": f"127.0.0.1:{loader_port}"},
        )
        for i in range(PODS):
            pod = pods[f"trainer-{i}"]
            cluster.start(pod, container(pod.spec, "constructor"), ports={"--metrics-port": "0"})
        yield Replay(request.param, cluster, pods, source, cluster.address(planner_at), f"127.0.0.1:{loader_port}")
    finally:
        cluster.stop()


def socket_of(pod: Pod) -> str:
    sidecar = container(pod.spec, "constructor")
    listen = sidecar["args"][sidecar["args"].index("--listen") + 1]
    return "unix://" + pod.local(sidecar, listen[len("unix://") :])


def tls_dir(pod: Pod, part: str) -> pathlib.Path:
    c = container(pod.spec, part)
    return pathlib.Path(pod.local(c, c["args"][c["args"].index("--tls-dir") + 1]))


def collect(pods: dict[str, Pod]) -> dict[int, list[Batch]]:
    out: dict[int, list[Batch]] = {}

    def one_rank(rank: int) -> None:
        with Client(rank=rank, address=socket_of(pods[f"trainer-{rank}"]), timeout_s=90) as client:
            out[rank] = [to_numpy(batch) for batch in client]

    run_ranks(one_rank, range(PODS))
    return out


def test_the_default_chart_s_parts_run_the_job_with_certificates_of_their_own(replay: Replay) -> None:
    cluster, pods, source = replay.cluster, replay.pods, replay.source
    batches = collect(pods)
    seen: collections.Counter[int] = collections.Counter()
    for rank_batches in batches.values():
        for batch in rank_batches:
            for mb in batch["microbatches"]:
                for i, row in enumerate(mb["sample_row"].tolist()):
                    seen[row] += 1
                    assert mb["input_ids"][i, : int(mb["sample_length"][i])].tolist() == source.rows[row].tolist()
    assert seen == {row: 1 for row in range(len(source.rows))}, cluster.log("bp-")
    operator_args = container(pods["operator"].spec, "operator")["args"]
    assert ("--no-reconcile" in operator_args) == ("--prometheus" not in operator_args) == (replay.mode == "issuerAlone")
    expected = {"loader": "batchplane://loader/0/bp-loader-text-66f8-c3", "planner": "batchplane://planner"}
    expected.update({f"trainer-{i}": f"batchplane://constructor/{i}" for i in range(PODS)})
    for name, identity in expected.items():
        part = "constructor" if name.startswith("trainer") else name
        assert identity_in(tls_dir(pods[name], part)) == identity, name


def identity_in(folder: pathlib.Path) -> str | None:

    from batchplane.core.identity import identity_of_names

    cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    found = identity_of_names(names.get_values_for_type(x509.UniformResourceIdentifier))
    return None if found is None else found.uri()


def refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    return error.value.code()


def credentials(pod: Pod, part: str) -> Security:
    """What an attacker in `pod` holds: its certificate folder and, where its part sends one, its token."""
    c = container(pod.spec, part)
    token = pod.local(c, c["args"][c["args"].index("--token-file") + 1]) if "--token-file" in c["args"] else None
    return Security(CertificateFolder(tls_dir(pod, part)), token=pathlib.Path(token).read_text().strip() if token else None)


#: Calls made with one pod's credentials, each crossing to another replica or index of its own
#: role or to another role: (whose pod, what it tries, the call).
ATTACKS: list[tuple[str, str, Callable[[planner_pb2_grpc.PlannerStub, loader_pb2_grpc.LoaderStub], Any]]] = [
    (
        "loader",
        "RegisterLoader as another replica",
        lambda p, _: p.RegisterLoader(
            planner_pb2.RegisterLoaderRequest(loader_index=0, replica="bp-loader-text-66f8-rogue", address="127.0.0.1:1"), timeout=5
        ),
    ),
    (
        "loader",
        "RegisterLoader for another group",
        lambda p, _: p.RegisterLoader(planner_pb2.RegisterLoaderRequest(loader_index=1, replica="r", address="127.0.0.1:1"), timeout=5),
    ),
    (
        "loader",
        "DeregisterLoader of another replica",
        lambda p, _: p.DeregisterLoader(planner_pb2.DeregisterLoaderRequest(loader_index=0, replica="bp-loader-text-66f8-d4"), timeout=5),
    ),
    (
        "loader",
        "GetPlan as a constructor",
        lambda p, _: p.GetPlan(planner_pb2.GetPlanRequest(constructor_index=0, step=0), timeout=5),
    ),
    (
        "loader",
        "RegisterConstructor",
        lambda p, _: p.RegisterConstructor(planner_pb2.RegisterConstructorRequest(constructor_index=0, address="unix:///x"), timeout=5),
    ),
    ("loader", "GetStatus as the operator", lambda p, _: p.GetStatus(planner_pb2.GetStatusRequest(), timeout=5)),
    (
        "loader",
        "FetchSamples as a constructor",
        lambda _, l: list(l.FetchSamples(loader_pb2.FetchSamplesRequest(constructor_index=0), timeout=5)),
    ),
    ("loader", "GetSummary as the planner", lambda _, l: l.GetSummary(loader_pb2.GetSummaryRequest(source=0), timeout=5)),
    (
        "trainer-1",
        "GetPlan as constructor 0",
        lambda p, _: p.GetPlan(planner_pb2.GetPlanRequest(constructor_index=0, step=0), timeout=5),
    ),
    (
        "trainer-1",
        "FetchSamples as constructor 0",
        lambda _, l: list(l.FetchSamples(loader_pb2.FetchSamplesRequest(constructor_index=0), timeout=5)),
    ),
    (
        "trainer-1",
        "RegisterLoader",
        lambda p, _: p.RegisterLoader(planner_pb2.RegisterLoaderRequest(loader_index=0, replica="x", address="127.0.0.1:1"), timeout=5),
    ),
]


def attack(replay: Replay, who: str, call: Callable[[planner_pb2_grpc.PlannerStub, loader_pb2_grpc.LoaderStub], Any]) -> grpc.StatusCode:
    """The status `call` gets with the credentials of pod `who` (OK: authorization let it through)."""
    pod = replay.pods[who]
    security = credentials(pod, "loader" if who == "loader" else "constructor")
    with security.channel(replay.planner, peer="planner") as to_planner, security.channel(replay.loader, peer="loader") as to_loader:
        try:
            call(planner_pb2_grpc.PlannerStub(to_planner), loader_pb2_grpc.LoaderStub(to_loader))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_what_one_pod_holds_acts_only_as_that_pod(replay: Replay) -> None:
    """The attack table of the mode: a pod acts only as itself, in its own role and for its own
    replica or index alone (the chart's retired tls.mode generated, one Helm-made certificate per
    part and role tokens, let any pod of a part act for every replica or index of it)."""
    cluster, pods = replay.cluster, replay.pods
    wait_until(
        lambda: all((tls_dir(pods[p], part) / "tls.crt").exists() for p, part in (("loader", "loader"), ("trainer-1", "constructor"))),
        timeout_s=60,
        what="the pods' certificates",
    )
    table = {(who, what): attack(replay, who, call) for who, what, call in ATTACKS}
    print(f"\nattacks in tls.mode {replay.mode}:", *(f"{who}: {what}: {code.name}" for (who, what), code in table.items()), sep="\n  ")
    for (who, what), code in table.items():
        assert code == grpc.StatusCode.PERMISSION_DENIED, (who, what, code)
    # What a loader may do, it can: the refusals are authorization, not a broken channel.
    with credentials(pods["loader"], "loader").channel(replay.planner, peer="planner") as channel:
        assert planner_pb2_grpc.PlannerStub(channel).GetJob(planner_pb2.GetJobRequest(), timeout=5).job.job_id

    # The loader pod's token gets it nothing but its own identity again.
    loader = pods["loader"]
    token_file = pathlib.Path(loader.local(container(loader.spec, "loader"), "/etc/batchplane/issuer/token"))
    issuer_at = cluster.address(next(a for a in container(loader.spec, "loader")["args"] if a.endswith(":8443")))
    minted = IssuerSource(issuer_at, token_file, token_file.parent / "ca.crt", cluster.root / "minted").request()
    assert minted.identity == "batchplane://loader/0/bp-loader-text-66f8-c3"

    # No service pod's files hold the CA key, and none holds another pod's token; no bearer
    # tokens Secret exists.
    assert not [d for d in all_of(cluster.docs, "Secret") if d["metadata"]["name"].endswith("-auth-tokens")]
    ca_key = next(base64.b64decode(d["data"]["tls.key"]) for d in all_of(cluster.docs, "Secret") if d["metadata"]["name"].endswith("-ca"))
    for name, pod in pods.items():
        files = [f for v in pod.spec.get("volumes", []) for f in (pod.root / v["name"]).rglob("*") if f.is_file()]  # what it mounts
        if name == "operator":
            assert any(f.read_bytes() == ca_key for f in files), "the operator holds the CA key"
            continue
        assert not any(ca_key in f.read_bytes() for f in files), name
        foreign = [p.token.encode() for p in pods.values() if p is not pod and p.token]
        assert not any(t in f.read_bytes() for f in files for t in foreign), name
