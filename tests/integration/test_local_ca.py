"""The local CA's key is out of a service's reach (issue 41, point 3): `batchplane up` keeps it in
the launcher's memory, so a loader running compromised user code (a strategy hook, here one that
reads every file it can under the run folder and the sockets' folder and collects the private
keys it finds) finds its own certificate's key but not the CA's, and cannot mint identities.
Real processes."""

from __future__ import annotations

import json
import pathlib

from cryptography.hazmat.primitives import serialization
from harness import collect, running_cluster, skewed_lengths, write_job, write_source

import pytest

pytestmark = pytest.mark.integration

SNOOPING = """
import json, os, pathlib
from cryptography.hazmat.primitives import serialization
from batchplane.planner import DGraph

def snoop(samples, plan):
    found = []
    for root in ({roots}):
        for path in pathlib.Path(root).rglob("*"):
            try:
                data = path.read_bytes() if path.is_file() else b""
            except OSError:
                continue
            if b"PRIVATE KEY" in data:
                try:
                    key = serialization.load_pem_private_key(data, password=None)
                except ValueError:  # a log or this file, naming keys
                    continue
                found.append(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode())
    with open({out!r}, "a") as f:
        f.write(json.dumps({{"pid": os.getpid(), "keys": sorted(set(found))}}) + "\\n")
    return samples

def strategy(mesh):
    return DGraph().mix().loader_do_plan(snoop).plan()
"""


def _public(key) -> str:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def test_a_loader_running_hostile_code_finds_no_ca_key_to_read(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(40, seed=1), seed=1)]
    found = tmp_path / "found.jsonl"
    config = write_job(tmp_path / "job.yaml", sources, run_dir=str(tmp_path / "run"), loaders={"count": 1})
    with running_cluster(config) as cluster:
        roots = ", ".join(repr(str(p)) for p in (cluster.run_dir, cluster._socket_folder, tmp_path))
        strategy = tmp_path / "snooping.py"
        strategy.write_text(SNOOPING.format(roots=roots, out=str(found)))
    config = write_job(tmp_path / "job.yaml", sources, run_dir=str(tmp_path / "run"), loaders={"count": 1}, strategy=str(strategy))
    with running_cluster(config) as cluster:
        ca = _public(cluster.ca.key)
        collect(cluster.endpoints_path, range(2))
    reports = [json.loads(line) for line in found.read_text().splitlines()]
    keys = {k for r in reports for k in r["keys"]}
    assert reports and len(keys) >= 2, "the hook ran in the loader and read keys it can (its own certificate's, at least)"
    assert ca not in keys, "the CA's key is nowhere a service can read"
    assert not (tmp_path / "run" / "tls" / "ca").exists()
