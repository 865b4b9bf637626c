"""`make e2e-podman`: the chart's pods run for real under podman, with the data and the ledger in
an S3 bucket, and exactly-once delivery checked from the ledger.

    .venv/bin/python deploy/e2e_podman.py [--kind job|torchrun] [--image batchplane:dev]
        [--trainer-image batchplane-trainer:e2e] [--helm PATH] [--timeout 900] [--keep]

What it does, in order:

1. Creates a podman network (`bp-e2e-<pid>`) and starts moto's S3 server on the host (moto's app on
   werkzeug's single-threaded server; see MOTO_SERVER for why not `python -m moto.server`), bound
   to that network's gateway address only (the pods reach the host there; a bridge's gateway
   exists only while something is attached, so an empty pod, `<network>-gw`, holds it up). It creates a
   bucket and uploads a small demo dataset (two sources of `batchplane.demo`, shrunk) under
   `s3://<bucket>/data/<source>/`; those Parquet rows are the ground truth.
2. Renders the chart with `helm template`: sources at the bucket, `planner.ledger.location:
   s3://<bucket>/ledger`, the AWS_* variables (endpoint, keys, region) in `planner.env` and
   `loader.env`, no operator, the example trainer enabled: `--kind job` (the default: one
   Indexed-Job pod running both data-parallel ranks of `batchplane.examples.tiny_lm`) or
   `--kind torchrun` (two Indexed-Job pods, one rank each, torchrun's static rendezvous over
   `batchplane.examples.timed_trainer`), `tls.mode: disabled` and the trainer as the sidecar's
   UID (kube play 4.3 can mount neither the certificate Secrets nor a pod's fsGroup).
3. Turns the rendered manifests into what `podman kube play` (4.3) runs: `transform`, a pure
   function (tests/unit/test_e2e_podman_transform.py), which records every rewrite it makes.
   The loader pods come from the DataPlane through the operator's own code
   (`batchplane.operator.dataplane.parse_dataplane` and `batchplane.operator.manifests`).
4. Plays the planner, waits until it serves; plays the loaders, waits until they registered;
   plays the trainer pods and waits until every trainer container exited (status 0 passes;
   otherwise the logs of every container are shown). The trainers run until the epoch ends.
5. Reads the ledger from the bucket (`LedgerReader` over the `s3://` location, as `batchplane
   ledger --ledger s3://...` does) and compares every delivered (source, row) with the uploaded
   rows: delivered, lost (uploaded, never delivered), repeated (delivered more than once) and
   unknown (delivered, never uploaded). Passes when nothing is lost, repeated or unknown.
6. Tears everything down, also on failure or Ctrl-C: the pods (`podman kube down`, then `podman
   pod rm -f` by name), the ConfigMap volumes, the network, the moto server (by its pid). With
   `--keep` it leaves the pods and the server up and prints how to remove them.

Needs podman (`make podman`), the images `make image` and `make image-e2e` built, helm (`make
helm`) and the venv (moto, boto3). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from batchplane.operator.dataplane import parse_dataplane
from batchplane.operator.manifests import loader_deployment

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "batchplane"

#: What an Indexed Job's controller puts on each pod (label and annotation) and into each
#: container (variable).
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
#: The uid the API server would give the DataPlane (the operator's ownerReference needs one).
DATAPLANE_UID = "e2e-podman-dataplane"
#: Downward-API fields podman 4.3's kube play refuses (the rest it fills in itself).
REFUSED_FIELDS = ("status.podIP", "metadata.namespace")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
#: The longest annotation value kube play 4.3 takes (it applies the label value limit).
MAX_ANNOTATION = 63
#: Kinds that hold pods or feed them; any other kind is dropped (and the drop recorded).
POD_KINDS = ("Deployment", "Job", "Pod")


# ---- the transform (pure) ----------------------------------------------------------------------


@dataclasses.dataclass
class PodmanPlan:
    """What `podman kube play` runs, phase by phase, and how it differs from the chart's output."""

    #: The ConfigMaps every phase's file carries (kube play builds the configMap volumes from them).
    config_maps: list[dict[str, Any]]
    #: Pods to play in order: ("planner", [...]), ("loaders", [...]), ("trainers", [...]).
    phases: list[tuple[str, list[dict[str, Any]]]]
    #: Every rewrite, one line each, in the order made.
    rewrites: list[str]
    #: Strings still naming a Kubernetes Service after the rewrites (a run would not resolve them).
    unresolved: list[str]

    def pods(self, phase: str) -> list[dict[str, Any]]:
        return next(pods for name, pods in self.phases if name == phase)

    def volume_names(self) -> list[str]:
        """The podman volumes kube play makes: one per ConfigMap, one per (renamed) emptyDir."""
        names = [cm["metadata"]["name"] for cm in self.config_maps]
        for _, pods in self.phases:
            names += [v["name"] for p in pods for v in p["spec"].get("volumes", []) if "emptyDir" in v]
        return names

    def documents(self, phase: str) -> list[dict[str, Any]]:
        """The YAML documents of one `podman kube play` call: the ConfigMaps, then the pods."""
        return [*copy.deepcopy(self.config_maps), *self.pods(phase)]


def expand_k8s(text: str, env: Mapping[str, str], used: dict[str, str] | None = None) -> str:
    """Kubernetes' `$(VAR)` expansion of command, args and env values (which podman does not do):
    `$(NAME)` becomes NAME's value when NAME is defined, and stays as written otherwise; `$$`
    becomes `$` (so `$$(NAME)` stays `$(NAME)`); any other `$` stays. The name runs to the first
    `)`, so shell's `$(cat f)` and `$((a + b))` stay as written. `used` collects what was
    substituted (name -> value)."""
    out: list[str] = []
    i = 0
    while True:
        j = text.find("$", i)
        if j < 0 or j == len(text) - 1:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        nxt = text[j + 1]
        if nxt == "$":
            out.append("$")
            i = j + 2
        elif nxt == "(":
            k = text.find(")", j + 2)
            if k < 0:
                out.append(text[j:])
                return "".join(out)
            name = text[j + 2 : k]
            if name in env:
                out.append(env[name])
                if used is not None:
                    used[name] = env[name]
            else:
                out.append(text[j : k + 1])
            i = k + 1
        else:
            out.append(text[j : j + 2])
            i = j + 2


def _field_value(path: str, pod: Mapping[str, Any]) -> str | None:
    """What the downward API gives for `path` in `pod` under podman (None: not known here).
    status.podIP becomes the pod's name: on a podman network, pods reach each other by name."""
    meta = pod["metadata"]
    if path in ("metadata.name", "status.podIP"):
        return meta["name"]
    if path == "metadata.namespace":
        return meta.get("namespace", "default")
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    return None


def _strings(obj: Any) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _map_strings(obj: Any, fn) -> Any:
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_strings(v, fn) for v in obj]
    return obj


def _pod(name: str, namespace: str, template: Mapping[str, Any]) -> dict[str, Any]:
    meta = template.get("metadata", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(meta.get("labels", {})),
            "annotations": dict(meta.get("annotations", {})),
        },
        "spec": copy.deepcopy(template["spec"]),
    }


def _startup_gate(probe: Mapping[str, Any]) -> str:
    """A shell line that waits as the sidecar's startup probe would (HTTP GET on the pod's
    loopback, periodSeconds x failureThreshold at most), with the python of the image."""
    get = probe["httpGet"]
    port, path = int(get["port"]), get.get("path", "/")
    timeout = int(probe.get("periodSeconds", 10)) * int(probe.get("failureThreshold", 3))
    return (
        "# e2e_podman: the constructor sidecar's startupProbe, as a wait (podman has no native sidecars)\n"
        "python -c 'import sys, time, urllib.request\n"
        f"deadline = time.monotonic() + {timeout}\n"
        "while True:\n"
        "    try:\n"
        f'        urllib.request.urlopen("http://127.0.0.1:{port}{path}", timeout=2).close()\n'
        "        break\n"
        "    except Exception as exc:\n"
        "        if time.monotonic() > deadline:\n"
        f'            sys.exit("the constructor sidecar did not answer {path} on port {port} within {timeout} s: %s" % exc)\n'
        "        time.sleep(1)'\n"
    )


def _gate_container(container: dict[str, Any], gate: str) -> None:
    command, args = container.get("command"), container.get("args")
    if command in (["sh", "-c"], ["/bin/sh", "-c"]) and isinstance(args, list) and len(args) == 1:
        container["args"] = [gate + args[0]]
    elif command:
        container["command"] = ["sh", "-c", gate + 'exec "$@"', "sh", *command, *(args or [])]
        container.pop("args", None)
    else:
        raise ValueError(
            f"container {container['name']}: runs the image's entrypoint, which this transform "
            "cannot wrap in the sidecar's startup wait; give it a command"
        )


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def transform(docs: Sequence[Mapping[str, Any] | None]) -> PodmanPlan:
    """Turns `helm template`'s manifests into pods `podman kube play` (4.3) runs, on a podman
    network where pods reach each other by pod name.

    Args:
        docs: The rendered documents (None for empty ones), as `yaml.safe_load_all` reads them.
    Returns:
        The pods by phase, the ConfigMaps, and every rewrite made (`PodmanPlan.rewrites`).
    Raises:
        ValueError: something this transform cannot turn into pods (no planner, a sidecar
            without an HTTP startup probe, a gated container without a command).
    """
    rewrites: list[str] = []
    note = rewrites.append
    config_maps: list[dict[str, Any]] = []
    services: list[Mapping[str, Any]] = []
    phases: dict[str, list[dict[str, Any]]] = {"planner": [], "loaders": [], "trainers": []}
    completion_index: dict[str, str] = {}  # pod -> its completion index

    for doc in docs:
        if not doc:
            continue
        kind, meta = doc.get("kind"), doc.get("metadata", {})
        name, namespace = meta.get("name"), meta.get("namespace", "default")
        ref = f"{kind}/{name}"
        component = meta.get("labels", {}).get("app.kubernetes.io/component")
        if kind == "ConfigMap":
            config_maps.append(copy.deepcopy(dict(doc)))
        elif kind == "Service":
            services.append(doc)
            note(f"{ref}: dropped (no Services under podman); the DNS names it gives are rewritten to pod names")
        elif kind == "DataPlane":
            dataplane = parse_dataplane({**doc, "metadata": {**meta, "uid": meta.get("uid", DATAPLANE_UID)}})
            for group in dataplane.groups:
                replicas = group.min_replicas  # what the operator creates a group's Deployment with
                deployment = loader_deployment(dataplane, group, replicas=replicas)
                dname = deployment["metadata"]["name"]
                note(
                    f"{ref}: loader Deployment/{dname} made by batchplane.operator.manifests.loader_deployment "
                    f"(group {group.name}, index {group.index}, {replicas} replica(s) = minReplicas), as the operator "
                    f"would; metadata.uid {DATAPLANE_UID!r} stands in for the API server's"
                )
                for i in range(replicas):
                    phases["loaders"].append(_pod(f"{dname}-{i}", namespace, deployment["spec"]["template"]))
                note(f"Deployment/{dname} -> Pod {', '.join(f'{dname}-{i}' for i in range(replicas))} (ownerReferences dropped)")
        elif kind == "Deployment" and component == "operator":
            note(f"{ref}: dropped (the operator needs the Kubernetes API; its loader Deployments are made here from the DataPlane)")
        elif kind == "Deployment":
            replicas = int(doc["spec"].get("replicas", 1))
            pods = [_pod(f"{name}-{i}", namespace, doc["spec"]["template"]) for i in range(replicas)]
            phases["planner" if component == "planner" else "trainers"].extend(pods)
            note(
                f"{ref} -> Pod {', '.join(p['metadata']['name'] for p in pods)} (one per replica, named so "
                "that $(POD_NAME) and the DNS rewrites have a literal name; kube play would call it "
                f"{name}-pod-0)"
            )
        elif kind == "Job":
            spec = doc["spec"]
            indexed = spec.get("completionMode") == "Indexed"
            count = int(spec.get("completions", 1))
            for i in range(count):
                pod = _pod(f"{name}-{i}", namespace, spec["template"])
                if indexed:
                    pod["metadata"]["annotations"][COMPLETION_INDEX] = str(i)
                    pod["metadata"]["labels"][COMPLETION_INDEX] = str(i)
                    completion_index[pod["metadata"]["name"]] = str(i)
                pod["metadata"]["labels"][JOB_NAME_LABEL] = name
                pod["metadata"]["labels"]["job-name"] = name
                phases["trainers"].append(pod)
            note(
                f"{ref} -> Pod {', '.join(f'{name}-{i}' for i in range(count))} (kube play runs no Jobs: one Pod per "
                + (
                    f"completion index, with annotation and label {COMPLETION_INDEX}, labels job-name and "
                    f"{JOB_NAME_LABEL}, and {COMPLETION_INDEX_ENV} in every container, as the Job controller sets them)"
                    if indexed
                    else "completion)"
                )
            )
        elif kind == "Pod":
            phases["trainers"].append(_pod(name, namespace, doc))
        else:
            note(f"{ref}: dropped (not run under podman)")
    if not phases["planner"]:
        raise ValueError("no planner Deployment (label app.kubernetes.io/component: planner) in the manifests")

    all_pods = [p for pods in phases.values() for p in pods]

    # Service DNS names -> pod names (aardvark-dns answers a pod's name on the podman network).
    dns: dict[str, str] = {}
    for svc in services:
        sname, sns = svc["metadata"]["name"], svc["metadata"].get("namespace", "default")
        selector = svc.get("spec", {}).get("selector", {})
        chosen = [p for p in all_pods if _selects(selector, p["metadata"]["labels"])]
        if len(chosen) == 1:
            for form in (f"{sname}.{sns}.svc.cluster.local", f"{sname}.{sns}.svc", f"{sname}.{sns}"):
                dns[form] = chosen[0]["metadata"]["name"]
        for pod in chosen:
            if pod["spec"].get("subdomain") == sname:
                host = pod["spec"].get("hostname", pod["metadata"]["name"])
                for form in (
                    f"{host}.{sname}.{sns}.svc.cluster.local",
                    f"{host}.{sname}.{sns}.svc",
                    f"{host}.{sname}.{sns}",
                    f"{host}.{sname}",
                ):
                    dns[form] = pod["metadata"]["name"]
    pattern = (
        re.compile(r"(?<![A-Za-z0-9.-])(" + "|".join(re.escape(k) for k in sorted(dns, key=len, reverse=True)) + r")(?![A-Za-z0-9.-])")
        if dns
        else None
    )

    for phase, pods in phases.items():
        for pod in pods:
            pname = pod["metadata"]["name"]
            spec = pod["spec"]
            # Native sidecars: init containers with restartPolicy Always become ordinary containers
            # (first), without probes; the others wait as the sidecar's startup probe made them.
            sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
            if sidecars:
                spec["initContainers"] = [c for c in spec["initContainers"] if c not in sidecars]
                if not spec["initContainers"]:
                    del spec["initContainers"]
                gates, waits = [], []
                for c in sidecars:
                    c.pop("restartPolicy")
                    probe = c.get("startupProbe")
                    if not (probe and "httpGet" in probe):
                        raise ValueError(f"pod {pname}: sidecar {c['name']} has no HTTP startupProbe to wait on")
                    gates.append(_startup_gate(probe))
                    waits.append(f"{c['name']}'s {probe['httpGet'].get('path', '/')} on 127.0.0.1:{probe['httpGet']['port']}")
                    dropped = [p for p in PROBES if c.pop(p, None) is not None]
                    note(
                        f"Pod {pname}: native sidecar {c['name']} moved from initContainers into containers (first), "
                        f"restartPolicy Always and its probes ({', '.join(dropped)}) dropped"
                    )
                for c in spec["containers"]:
                    _gate_container(c, "".join(gates))
                    note(
                        f"Pod {pname}: container {c['name']} first waits as the sidecar's startupProbe made it wait "
                        f"(its command is prefixed with a python loop polling {', '.join(waits)})"
                    )
                spec["containers"] = [*sidecars, *spec["containers"]]
            for c in spec.get("initContainers", []):
                dropped = [p for p in PROBES if c.pop(p, None) is not None]
                if dropped:
                    note(f"Pod {pname}: init container {c['name']}: probes dropped ({', '.join(dropped)}; kube play refuses them)")
            # kube play 4.3 makes each emptyDir a named volume called after the volume, shared by
            # every pod that names one the same (the trainer pods' socket folders would be one).
            renamed: dict[str, str] = {}
            for volume in spec.get("volumes", []):
                if "emptyDir" in volume:
                    old_name = volume["name"]
                    volume["name"] = renamed[old_name] = f"{pname}-{old_name}"
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                for mount in c.get("volumeMounts", []):
                    mount["name"] = renamed.get(mount["name"], mount["name"])
            if renamed:
                note(
                    f"Pod {pname}: emptyDir volumes renamed {', '.join(f'{k} -> {v}' for k, v in renamed.items())} "
                    "(kube play 4.3 makes an emptyDir a named volume called after the volume, which every pod "
                    "naming one the same would share)"
                )
            annotations = pod["metadata"]["annotations"]
            for key, value in list(annotations.items()):
                if len(str(value)) > MAX_ANNOTATION:
                    annotations[key] = str(value)[:MAX_ANNOTATION]
                    note(
                        f"Pod {pname}: annotation {key} cut to its first {MAX_ANNOTATION} characters (kube play "
                        "refuses longer annotation values, which Kubernetes allows)"
                    )
            if spec.pop("subdomain", None) is not None:
                note(f"Pod {pname}: subdomain dropped (its <hostname>.<subdomain> names are rewritten to the pod's name)")

            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                where = f"Pod {pname}: container {c['name']}"
                ports = c.pop("ports", None)
                if ports:
                    note(
                        f"{where}: ports dropped ({', '.join(str(p['containerPort']) for p in ports)}): kube play 4.3 "
                        "publishes every containerPort on the host's same port, so pods with the same port collide; "
                        "pods reach them on the podman network without it"
                    )
                env = c.setdefault("env", [])
                if pname in completion_index and not any(e["name"] == COMPLETION_INDEX_ENV for e in env):
                    env.append({"name": COMPLETION_INDEX_ENV, "value": completion_index[pname]})
                values: dict[str, str] = {}
                for e in env:
                    field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                    if field is not None:
                        value = _field_value(field, pod)
                        if field in REFUSED_FIELDS:
                            e.pop("valueFrom")
                            e["value"] = value
                            how = "the pod's name, which resolves on the podman network" if field == "status.podIP" else "literally"
                            note(f"{where}: env {e['name']} fieldRef {field} -> {value!r} ({how}; kube play refuses {field})")
                        if value is not None:
                            values[e["name"]] = value
                    elif "value" in e:
                        used = {}
                        expanded = expand_k8s(str(e["value"]), values, used)
                        for var, value in used.items():
                            note(f"{where}: env {e['name']}: $({var}) -> {value!r} (podman does not expand $(VAR))")
                        e["value"] = expanded
                        values[e["name"]] = expanded
                if not env:
                    del c["env"]
                for key in ("command", "args"):
                    if key in c:
                        used: dict[str, str] = {}
                        c[key] = [expand_k8s(a, values, used) for a in c[key]]
                        for var, value in used.items():
                            note(f"{where}: {key}: $({var}) -> {value!r} (podman does not expand $(VAR))")
                if pattern is not None:
                    for key in ("command", "args"):
                        if key in c:
                            new = [pattern.sub(lambda m: dns[m.group(1)], a) for a in c[key]]
                            for old, now in zip(c[key], new):
                                for found in sorted(set(pattern.findall(old))):
                                    note(f"{where}: {key}: Service DNS name {found} -> {dns[found]} (pod name)")
                            c[key] = new
                    for e in c.get("env", []):
                        if isinstance(e.get("value"), str) and pattern.search(e["value"]):
                            for found in sorted(set(pattern.findall(e["value"]))):
                                note(f"{where}: env {e['name']}: Service DNS name {found} -> {dns[found]} (pod name)")
                            e["value"] = pattern.sub(lambda m: dns[m.group(1)], e["value"])

    unresolved = sorted(
        {
            f"Pod {p['metadata']['name']}: {m.group(0)}"
            for p in all_pods
            for s in _strings(p["spec"])
            for m in re.finditer(r"[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.svc(\.cluster\.local)?\b", s)
        }
    )
    return PodmanPlan(
        config_maps=config_maps,
        phases=[(k, v) for k, v in phases.items()],
        rewrites=rewrites,
        unresolved=unresolved,
    )


def sidecar_names(pod: Mapping[str, Any], rendered_sidecars: Iterable[str] = ("batchplane-constructor",)) -> list[str]:
    return [c["name"] for c in pod["spec"]["containers"] if c["name"] in rendered_sidecars]


# ---- the run (I/O) -----------------------------------------------------------------------------

BUCKET = "batchplane-e2e"
ACCESS_KEY = "batchplane-e2e"
SECRET_KEY = "batchplane-e2e-secret"
REGION = "us-east-1"
RELEASE = "e2e"
NAMESPACE = "e2e"
#: The demo sources uploaded (shrunk): name -> rows. 320 rows = 20 steps of 16.
SOURCES = {"docs": 192, "code": 128}
GLOBAL_BATCH = 16


def log(message: str) -> None:
    print(message, flush=True)


def run(cmd: Sequence[str], *, check: bool = True, capture: bool = True, timeout: float | None = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, text=True, capture_output=capture, timeout=timeout, **kw)


def qualify(image: str) -> str:
    """podman's name of a locally built image: a name without a registry is localhost's."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"localhost/{image}"


def split_image(image: str) -> tuple[str, str]:
    repo, _, tag = image.rpartition(":")
    if not repo or "/" in tag:
        return image, "latest"
    return repo, tag


#: moto's S3 app (what `python -m moto.server` serves) on werkzeug's single-threaded HTTP/1.0
#: server. `python -m moto.server` runs the threaded one, which here leaves about 1 connection in
#: 200 unanswered for a second or more (measured: sequential connects with a 1 s timeout, from the
#: host and from a pod; a plain listener on the same address drops none). pyarrow's S3 client gives
#: up on a connection after about 3 s, and the loader then skips the row group (see the report).
MOTO_SERVER = """
import sys
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
make_server(sys.argv[1], int(sys.argv[2]), DomainDispatcherApplication(create_backend_app), threaded=False,
            request_handler=MotoRequestHandler).serve_forever()
"""


class Moto:
    """moto's S3 server on `host`, a free port, stopped by its pid (its own process group)."""

    def __init__(self, host: str, workdir: pathlib.Path) -> None:
        with socket.socket() as s:
            s.bind((host, 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://{host}:{self.port}"
        self.log_path = workdir / "moto.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", MOTO_SERVER, host, str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not answer within 30 s: {self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",  # obstore (the ledger) refuses plain http without it
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def upload_dataset(moto: Moto, workdir: pathlib.Path) -> dict[str, int]:
    """Writes the shrunk demo sources, uploads them under s3://BUCKET/data/<source>/; returns the
    ground truth: rows per source, counted from the uploaded objects' Parquet metadata."""
    import io

    import pyarrow.parquet as pq

    from batchplane.demo.dataset import DEMO_SOURCES, write_demo_dataset

    sources = [
        dataclasses.replace(s, num_rows=SOURCES[s.name], files=2, rows_per_row_group=32, max_length=min(s.max_length, 512))
        for s in DEMO_SOURCES
        if s.name in SOURCES
    ]
    data = workdir / "data"
    write_demo_dataset(data, sources=sources)
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    truth = {}
    for source in sources:
        for path in sorted((data / source.name).glob("*.parquet")):
            s3.upload_file(str(path), BUCKET, f"data/{source.name}/{path.name}")
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"data/{source.name}/")["Contents"])
        rows = 0
        for key in keys:
            body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            rows += pq.ParquetFile(io.BytesIO(body)).metadata.num_rows
        truth[source.name] = rows
        log(f"   s3://{BUCKET}/data/{source.name}/: {len(keys)} Parquet files, {rows} rows")
    return truth


def chart_values(kind: str, image: str, trainer_image: str, env: Mapping[str, str]) -> dict[str, Any]:
    repo, tag = split_image(qualify(image))
    trepo, ttag = split_image(qualify(trainer_image))
    aws = [{"name": k, "value": v} for k, v in env.items()]
    world = 2
    per_pod = world if kind == "job" else 1
    return {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
        "operator": {"enabled": False},
        "dashboard": {"enabled": False},
        "sourceGroups": [{"name": "text", "sources": [{"name": n, "path": f"s3://{BUCKET}/data/{n}/"} for n in SOURCES]}],
        "mixture": {"weights": {n: 1 for n in SOURCES}},
        "mesh": {"dp": world},
        "batch": {"globalBatchSize": GLOBAL_BATCH, "microbatches": 1},
        "trainer": {"ranksPerPod": per_pod},
        "job": {"epochs": 1, "seed": 7},
        "planner": {"ledger": {"location": f"s3://{BUCKET}/ledger"}, "env": aws},
        "loader": {"env": aws},
        "constructor": {"indexFrom": "indexed-job"},
        # steps beyond the epoch: the trainers stop when the epoch ends, having read every row.
        # The trainer runs as the sidecar's UID: kube play 4.3 ignores fsGroup, which is how the
        # chart's own example (another UID) enters the constructor's socket folder.
        "example": {
            "enabled": True,
            "kind": kind,
            "steps": 100000,
            "image": {"repository": trepo, "tag": ttag},
            "runAsUser": 10001,
            "runAsGroup": 10001,
        },
        # Plaintext between the pods: kube play 4.3 cannot mount the chart's certificate Secrets
        # (it writes a Secret's values still base64-encoded, and panics on a Secret volume
        # without `optional`). The chart's TLS path is checked by tests/integration/test_helm_chart.py
        # and the processes' by the integration tests. `insecure`: plaintext on the pods' network
        # of this one machine is meant.
        "tls": {"mode": "disabled", "insecure": True},
    }


def find_helm(given: str | None) -> str:
    for candidate in (given, os.environ.get("BATCHPLANE_HELM"), shutil.which("helm"), str(ROOT / ".tools/helm-3.17.2/helm")):
        if candidate and (os.access(candidate, os.X_OK) or shutil.which(candidate)):
            return candidate
    raise SystemExit("e2e_podman.py: no helm (run `make helm`, or pass --helm)")


class Podman:
    """The podman objects of one run, removed by name at the end."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.network = prefix
        self.files: list[pathlib.Path] = []
        self.pods: list[str] = []
        self.volumes: set[str] = set()
        self.network_made = False

    def create_network(self) -> str:
        """Creates the network and holds its bridge up (an empty pod); returns the gateway address."""
        run(["podman", "network", "create", self.network])
        self.network_made = True
        info = json.loads(run(["podman", "network", "inspect", self.network]).stdout)[0]
        gateway = info["subnets"][0]["gateway"]
        holder = f"{self.prefix}-gw"
        self.pods.append(holder)
        run(["podman", "pod", "create", "--name", holder, "--network", self.network])
        run(["podman", "pod", "start", holder])
        return gateway

    def play(self, path: pathlib.Path, pods: Iterable[str], volumes: Iterable[str]) -> None:
        self.files.append(path)
        self.pods.extend(pods)
        self.volumes.update(volumes)
        out = run(["podman", "kube", "play", "--network", self.network, str(path)], check=False)
        if out.returncode != 0:
            raise RuntimeError(f"podman kube play {path.name} failed ({out.returncode}):\n{out.stdout}{out.stderr}")

    def state(self, container: str) -> tuple[str, int]:
        out = run(["podman", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container], check=False)
        if out.returncode != 0:
            return "missing", -1
        status, code = out.stdout.split()
        return status, int(code)

    def logs(self, container: str, tail: int | None = None) -> str:
        cmd = ["podman", "logs", *(["--tail", str(tail)] if tail else []), container]
        out = run(cmd, check=False)
        return out.stdout + out.stderr

    def containers(self) -> list[str]:
        names = []
        for pod in self.pods:
            out = run(["podman", "ps", "-a", "--filter", f"pod={pod}", "--format", "{{.Names}}"], check=False)
            names += [n for n in out.stdout.split() if not n.endswith("-infra")]
        return names

    def teardown(self) -> None:
        for path in reversed(self.files):
            run(["podman", "kube", "down", str(path)], check=False)
        for pod in self.pods:
            run(["podman", "pod", "rm", "-f", "-t", "0", pod], check=False)
        for volume in sorted(self.volumes):
            run(["podman", "volume", "rm", "-f", volume], check=False)
        if self.network_made:
            run(["podman", "network", "rm", "-f", self.network], check=False)


def wait_for_log(podman: Podman, container: str, text: str, timeout_s: float, what: str) -> float:
    begin = time.monotonic()
    while True:
        if text in podman.logs(container):
            return time.monotonic() - begin
        status, code = podman.state(container)
        if status in ("exited", "stopped", "missing"):
            raise RuntimeError(f"{container} {status} (exit status {code}) before {what}")
        if time.monotonic() - begin > timeout_s:
            raise RuntimeError(f"{container}: no {what} within {timeout_s:.0f} s")
        time.sleep(1)


def check_ledger(location: str, truth: Mapping[str, int]) -> dict[str, Any]:
    """Every (source, row) the ledger in the bucket says was delivered, against the uploaded rows."""
    from batchplane.core.object_storage import ObjectStorage
    from batchplane.planner.journal import LedgerReader

    reader = LedgerReader(ObjectStorage.from_url(location))
    if not reader.generations:
        raise RuntimeError(f"no ledger at {location}")
    names = list(reader.generations[-1].sources)
    delivered: Counter[tuple[str, int]] = Counter()
    steps = 0
    for record in reader.records():
        steps += 1
        for rank in record["ranks"]:
            for microbatch in rank:
                for k, row, _epoch in microbatch:
                    delivered[(names[k], int(row))] += 1
    expected = {(name, row) for name, rows in truth.items() for row in range(rows)}
    return {
        "sources": names,
        "counts": delivered,
        "generations": len(reader.generations),
        "steps": steps,
        "last_step": reader.last_step(),
        "delivered": sum(delivered.values()),
        "distinct": len(delivered),
        "expected": len(expected),
        "lost": sorted(expected - set(delivered)),
        "repeated": sorted(s for s, n in delivered.items() if n > 1),
        "unknown": sorted(set(delivered) - expected),
        "per_source": {name: sum(n for (s, _), n in delivered.items() if s == name) for name in names},
    }


def trainer_samples(plan: PodmanPlan, sources: Sequence[str]) -> Counter[tuple[str, int]] | None:
    """What the trainers themselves recorded receiving: the `steps-<rank>.jsonl` files that
    `batchplane.examples.timed_trainer` (example.kind torchrun) writes into the trainer's /tmp
    volume, read from podman's volume folder; None when there are none (tiny_lm writes none)."""
    received: Counter[tuple[str, int]] = Counter()
    found = False
    for pod in plan.pods("trainers"):
        for c in pod["spec"]["containers"]:
            for mount in c.get("volumeMounts", []):
                if mount["mountPath"] != "/tmp":
                    continue
                out = run(["podman", "volume", "inspect", "--format", "{{.Mountpoint}}", mount["name"]], check=False)
                if out.returncode != 0:
                    continue
                for path in sorted(pathlib.Path(out.stdout.strip()).glob("steps-*.jsonl")):
                    found = True
                    for line in path.read_text().splitlines():
                        for k, row, _epoch in json.loads(line)["samples"]:
                            received[(sources[k], int(row))] += 1
    return received if found else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kind",
        choices=("job", "torchrun"),
        default="job",
        help="example.kind: job (one pod, two tiny_lm ranks; default) or torchrun (two pods, one rank each)",
    )
    parser.add_argument("--image", default="batchplane:dev", help="the service image (make image)")
    parser.add_argument("--trainer-image", default="batchplane-trainer:e2e", help="the trainer image (make image-e2e)")
    parser.add_argument("--helm", help="helm 3 (default: BATCHPLANE_HELM, helm on PATH, .tools/)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds the trainers may take (default 900)")
    parser.add_argument("--keep", action="store_true", help="leave the pods, network and S3 server up")
    args = parser.parse_args(argv)

    begin = time.monotonic()
    helm = find_helm(args.helm)
    if not shutil.which("podman"):
        raise SystemExit("e2e_podman.py: podman is missing (make podman)")
    for image, target in ((args.image, "make image"), (args.trainer_image, "make image-e2e")):
        if run(["podman", "image", "exists", qualify(image)], check=False).returncode != 0:
            raise SystemExit(f"e2e_podman.py: no image {qualify(image)}: build it with `{target}`")

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="batchplane-e2e-podman-"))
    podman = Podman(f"bp-e2e-{os.getpid()}")
    moto: Moto | None = None
    ok = False
    try:
        log(f"== podman network {podman.network}, moto S3 server")
        gateway = podman.create_network()
        moto = Moto(gateway, workdir)
        env = moto.env()
        os.environ.update(env)  # obstore (the ledger check) reads the process's environment
        log(f"   S3 endpoint {moto.endpoint} (the network's gateway: the host as the pods see it), moto pid {moto.proc.pid}")

        log("== dataset")
        truth = upload_dataset(moto, workdir)

        log(f"== chart (helm template, example.kind {args.kind})")
        values = chart_values(args.kind, args.image, args.trainer_image, env)
        (workdir / "values.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
        rendered = run([helm, "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(workdir / "values.yaml")]).stdout
        (workdir / "rendered.yaml").write_text(rendered)
        plan = transform(list(yaml.safe_load_all(rendered)))
        log(f"   {len(plan.rewrites)} rewrites for podman kube play:")
        for line in plan.rewrites:
            log(f"   - {line}")
        if plan.unresolved:
            raise RuntimeError(f"Service names left after the rewrites: {plan.unresolved}")
        volumes = plan.volume_names()
        names = [p["metadata"]["name"] for _, pods in plan.phases for p in pods]
        leftover = [n for n in names if run(["podman", "pod", "exists", n], check=False).returncode == 0]
        if leftover:
            raise SystemExit(
                f"e2e_podman.py: pods {leftover} exist already (another run, or one with --keep): "
                f"remove them with `podman pod rm -f {' '.join(leftover)}`"
            )
        for volume in volumes:  # a leftover volume would carry an earlier run's files
            run(["podman", "volume", "rm", "-f", volume], check=False)

        files = {}
        for phase, pods in plan.phases:
            path = workdir / f"{phase}.yaml"
            path.write_text(
                f"# {phase}: made by deploy/e2e_podman.py from {workdir / 'rendered.yaml'}\n"
                + yaml.safe_dump_all(plan.documents(phase), sort_keys=False)
            )
            files[phase] = path

        planner = plan.pods("planner")[0]["metadata"]["name"]
        log(f"== planner: {planner}")
        podman.play(files["planner"], [p["metadata"]["name"] for p in plan.pods("planner")], volumes)
        took = wait_for_log(podman, f"{planner}-planner", "serving on", 120, "serving")
        log(f"   serving after {took:.1f} s: {podman.logs(f'{planner}-planner').strip().splitlines()[-1][:200]}")

        loaders = [p["metadata"]["name"] for p in plan.pods("loaders")]
        log(f"== loaders: {', '.join(loaders)}")
        podman.play(files["loaders"], loaders, volumes)
        for pod in loaders:
            took = wait_for_log(podman, f"{pod}-loader", "registered with planner", 180, "registration with the planner")
            log(f"   {pod} registered after {took:.1f} s")

        trainer_pods = plan.pods("trainers")
        log(f"== trainers: {', '.join(p['metadata']['name'] for p in trainer_pods)}")
        podman.play(files["trainers"], [p["metadata"]["name"] for p in trainer_pods], volumes)
        mains = [
            f"{p['metadata']['name']}-{c['name']}"
            for p in trainer_pods
            for c in p["spec"]["containers"]
            if c["name"] not in sidecar_names(p)
        ]
        sidecars = [f"{p['metadata']['name']}-{n}" for p in trainer_pods for n in sidecar_names(p)]
        services = [f"{planner}-planner", *(f"{pod}-loader" for pod in loaders)]
        started = time.monotonic()
        while True:
            states = {c: podman.state(c) for c in mains}
            if all(s in ("exited", "stopped") for s, _ in states.values()):
                break
            failed = [f"{c} exited {code}" for c, (s, code) in states.items() if s in ("exited", "stopped") and code != 0]
            if failed:
                raise RuntimeError(f"trainers failed: {', '.join(failed)}")
            broken = [f"{c} {s} ({code})" for c in [*sidecars, *services] for s, code in [podman.state(c)] if s != "running"]
            if broken:
                raise RuntimeError(f"while the trainers ran: {', '.join(broken)}")
            if time.monotonic() - started > args.timeout:
                raise RuntimeError(f"the trainers did not finish within {args.timeout:.0f} s")
            time.sleep(2)
        train_s = time.monotonic() - started
        failed = [f"{c} exited {code}" for c, (_, code) in states.items() if code != 0]
        for c in sidecars:
            marks = ("registered with planner", "serving ranks", "end of data")
            served = [line for line in podman.logs(c).splitlines() if any(m in line for m in marks)]
            log(f"   {c}: {' / '.join(line.split(' ', 4)[-1] for line in served)}")
        for c in mains:
            log(f"   --- {c} (last lines)")
            for line in podman.logs(c, tail=6).strip().splitlines():
                log(f"   | {line}")
        if failed:
            raise RuntimeError(f"trainers failed: {', '.join(failed)}")
        log(f"   every trainer exited 0 after {train_s:.1f} s")

        log(f"== ledger s3://{BUCKET}/ledger against the uploaded rows")
        result = check_ledger(f"s3://{BUCKET}/ledger", truth)
        stats = run([sys.executable, "-m", "batchplane.cli", "ledger", "stats", "--ledger", f"s3://{BUCKET}/ledger", "--json"], check=False)
        if stats.returncode == 0:
            summary = json.loads(stats.stdout)
            log(
                f"   batchplane ledger stats: steps {summary.get('steps')}, samples {summary.get('samples')}, "
                f"per source { ({r['source']: r['samples'] for r in summary.get('sources', [])}) }"
            )
        else:
            log(f"   batchplane ledger stats failed: {stats.stderr.strip()[-500:]}")
        pods_run = [*(p["metadata"]["name"] for p in plan.pods("planner")), *loaders, *(p["metadata"]["name"] for p in trainer_pods)]
        log(f"   pods run: {len(pods_run)} ({', '.join(pods_run)})")
        log(f"   steps in the ledger: {result['steps']} (last {result['last_step']}, {result['generations']} generation(s))")
        log(f"   uploaded rows: {result['expected']} {dict(truth)}")
        log(f"   delivered: {result['delivered']} ({result['distinct']} distinct) {result['per_source']}")
        log(f"   lost: {len(result['lost'])}  repeated: {len(result['repeated'])}  unknown: {len(result['unknown'])}")
        received = trainer_samples(plan, result["sources"])
        if received is not None:
            same = received == result["counts"]
            log(
                f"   the trainers' own record (timed_trainer's steps-*.jsonl): {sum(received.values())} samples, "
                f"{'the same (source, row)s as the ledger' if same else 'NOT what the ledger says'}"
            )
            if not same:
                raise RuntimeError("the trainers received other samples than the ledger records")
        if result["lost"] or result["repeated"] or result["unknown"]:
            for key in ("lost", "repeated", "unknown"):
                if result[key]:
                    log(f"   {key} (first 10): {result[key][:10]}")
            raise RuntimeError("delivery was not exactly once")
        ok = True
        log(f"e2e_podman.py: passed in {time.monotonic() - begin:.0f} s (example.kind {args.kind})")
        return 0
    except (RuntimeError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = f"\n{exc.stdout or ''}{exc.stderr or ''}" if isinstance(exc, subprocess.CalledProcessError) else ""
        log(f"e2e_podman.py: FAILED: {exc}{detail}")
        for c in podman.containers():
            log(f"--- {c}: {' '.join(map(str, podman.state(c)))}")
            for line in podman.logs(c, tail=40).rstrip().splitlines():
                log(f"| {line}")
        if moto is not None:
            log(f"--- moto log (tail): {moto.log_path.read_text(errors='replace')[-1500:]}")
        return 1
    finally:
        if args.keep:
            log(
                f"--keep: left up: pods {podman.pods}, network {podman.network}, moto pid "
                f"{moto.proc.pid if moto else '-'}; files in {workdir}"
            )
        else:
            log("== teardown")
            podman.teardown()
            if moto is not None:
                moto.stop()
            if ok:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                log(f"   kept {workdir} (rendered.yaml, values.yaml, the played files, moto.log)")


if __name__ == "__main__":
    sys.exit(main())
