"""Shared-memory delivery from a constructor to its trainers (the trainer's Unix socket, which
every local constructor serves with TLS on or off, and the slab socket beside it):
byte-identical to the gRPC stream, and nothing leaks when either side is killed with SIGKILL."""

from __future__ import annotations

import gc
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from batchplane.client import Client
from batchplane.client.client import MAX_CALL_STEPS
from harness import (
    assert_same_batches,
    collect,
    sample_ids,
    scrape,
    start_cluster,
    to_numpy,
    wait_until,
    write_job,
    write_source,
)

SLAB = "/memfd:batchplane-slab"


@pytest.fixture
def sources(tmp_path):
    return [
        write_source(tmp_path / "data", "a", [int(n) for n in np.random.default_rng(1).integers(20, 400, 120)], seed=1),
        write_source(tmp_path / "data", "b", [int(n) for n in np.random.default_rng(2).integers(20, 400, 80)], seed=2),
    ]


def _job(tmp_path: pathlib.Path, sources, name: str, **settings) -> pathlib.Path:
    folder = tmp_path / name
    folder.mkdir()
    settings.setdefault("mesh", {"dp": 1, "tp": 2})
    settings.setdefault("constructors", {"ranks_per_constructor": 2, "batch_steps": 8})  # several steps per call
    return write_job(folder / "job.yaml", sources, **settings)


def _metrics_url(cluster, name: str) -> str:
    import json

    return json.loads(cluster.endpoints_path.read_text())["metrics"][name]


def _slab_fds(pid: int) -> set[int]:
    """Inodes of the slab memfds process `pid` holds open."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SLAB):
                found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            continue
    return found


def _leftovers(killed: set[int], current: set[int]) -> str:
    """What a failed leak check found: the slabs mapped here beyond the constructor's own, which
    of them were the killed constructor's, and which stay after a collection."""
    extra = _mapped_slabs() - current
    gc.collect()
    return f"mapped beyond the constructor's slabs: {sorted(extra)}, the killed one's: {sorted(extra & killed)}, after gc: {sorted(_mapped_slabs() - current)}"


def _mapped_slabs() -> set[int]:
    """Inodes of the slab memfds this process maps."""
    found = set()
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(SLAB):
            found.add(int(parts[4]))
    return found


def _no_batchplane_files_in_dev_shm() -> None:
    assert [n for n in os.listdir("/dev/shm") if "batchplane" in n] == []


def test_shm_delivers_the_same_bytes_as_grpc(tmp_path, sources, monkeypatch) -> None:
    batches = {}
    for transport in ("grpc", "shm"):
        monkeypatch.setenv("BATCHPLANE_SHM", "1" if transport == "shm" else "0")
        cluster = start_cluster(_job(tmp_path, sources, transport))
        try:
            got, _ = collect(cluster.endpoints_path, [0, 1])
            batches[transport] = got
            metrics = scrape(_metrics_url(cluster, "constructor-0"))
            placements = metrics.get("batchplane_constructor_shm_placements_total", 0)
            if transport == "shm":
                # Every batch came through shared memory, in a few slabs reused step after step:
                # the TP peers share each step's slab, and a client holds those of the steps its
                # current call carries and of the last one's, until its next call releases them.
                assert metrics.get("batchplane_constructor_shm_fallbacks_total", 0) == 0
                assert 0 < placements <= metrics["batchplane_constructor_batches_sent_total"]
                slabs = metrics["batchplane_constructor_shm_slabs"]
                assert slabs <= 2 * MAX_CALL_STEPS + 2
                assert slabs < placements, (slabs, placements)
            else:
                assert placements == 0
        finally:
            cluster.stop()
        assert len(got[0]) >= 10
    assert_same_batches(batches["shm"], batches["grpc"])


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
def test_the_client_says_which_transport_it_uses(tmp_path, sources, monkeypatch, tls: bool) -> None:
    cluster = start_cluster(_job(tmp_path, sources, "job", network={"tls": tls}))
    try:
        monkeypatch.setenv("BATCHPLANE_ENDPOINTS", str(cluster.endpoints_path))
        with Client(rank=0, timeout_s=30) as client:
            assert client.transport == "shm"
            batch = next(iter(client))
            assert client.transport == "shm"
            ids = batch["microbatches"][0]["input_ids"]
            assert ids.numpy().flags.writeable  # a private, writable mapping: no torch warning
            before = ids.clone()
            ids.fill_(7)  # the trainer's own copy on write; the slab (its TP peer's) is untouched
            del ids, batch
        monkeypatch.setenv("BATCHPLANE_SHM", "0")
        with Client(rank=1, timeout_s=30) as peer:
            first = next(iter(peer))
            assert peer.transport == "grpc"
            assert np.array_equal(first["microbatches"][0]["input_ids"].numpy(), before.numpy())
    finally:
        cluster.stop()


TRAINER = textwrap.dedent(
    """
    import sys, time
    from batchplane.client import Client
    kept = []
    with Client(rank=int(sys.argv[1]), timeout_s=60) as client:
        for batch in client:
            kept.append(batch)  # holds every step's tensors: its slabs stay held
            print(client.transport, batch["step"], flush=True)
            time.sleep(0.05)
    """
)


def test_a_killed_trainer_releases_its_slabs_and_a_new_one_resumes(tmp_path, sources) -> None:
    cluster = start_cluster(_job(tmp_path, sources, "job", mesh={"dp": 1}, constructors={"ranks_per_constructor": 1}))
    env = {**os.environ, "BATCHPLANE_ENDPOINTS": str(cluster.endpoints_path)}
    try:
        url = _metrics_url(cluster, "constructor-0")
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, "0"], stdout=subprocess.PIPE, text=True, env=env)
        lines = [trainer.stdout.readline().split() for _ in range(4)]
        assert [line[0] for line in lines] == ["shm"] * 4
        metrics = scrape(url)
        assert metrics["batchplane_constructor_shm_sessions"] == 1
        held = metrics["batchplane_constructor_shm_slabs"]
        assert held >= 3  # the trainer keeps every step: each holds its own slab
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        trainer.stdout.close()
        wait_until(lambda: scrape(url)["batchplane_constructor_shm_sessions"] == 0, timeout_s=10, what="the session to end")
        constructor = cluster.constructors[0].pid
        # The slabs stay for reuse, bounded; the constructor holds exactly those open.
        assert len(_slab_fds(constructor)) == scrape(url)["batchplane_constructor_shm_slabs"] <= held + 2
        resume = int(lines[-1][1]) + 1
        os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
        with Client(rank=0, timeout_s=30) as client:
            client.load_state_dict({"version": 4, "fingerprints": client.state_dict()["fingerprints"], "next_step": resume})
            steps = []
            for batch in client:
                steps.append(batch["step"])
                assert client.transport == "shm"
                del batch  # released: the pool reuses slabs instead of growing
                if len(steps) == 8:
                    break
        assert steps == list(range(resume, resume + 8))
        after = scrape(url)
        assert after["batchplane_constructor_shm_slabs"] <= held + 2
        assert after.get('batchplane_constructor_shm_fallbacks_total{reason="full"}', 0) == 0
        _no_batchplane_files_in_dev_shm()
    finally:
        cluster.stop()


def test_a_killed_constructor_restarts_and_the_trainer_finishes_without_leaks(tmp_path, sources, monkeypatch) -> None:
    cluster = start_cluster(_job(tmp_path, sources, "job", mesh={"dp": 1}, constructors={"ranks_per_constructor": 1}))
    try:
        monkeypatch.setenv("BATCHPLANE_ENDPOINTS", str(cluster.endpoints_path))
        trained = []
        with Client(rank=0, timeout_s=60) as client:
            it = iter(client)
            kept = [next(it) for _ in range(3)]
            assert client.transport == "shm"
            old = _mapped_slabs()
            assert old  # the kept steps' slabs are mapped here
            trained.extend(to_numpy(b) for b in kept)
            killed = _slab_fds(cluster.constructors[0].pid)
            cluster.restart_constructor(0)  # SIGKILL, then a new one on the same socket
            new_pid = cluster.constructors[0].pid
            # The old constructor's memory lives on only while the trainer views it.
            assert old <= _mapped_slabs()
            del kept
            transports = []
            for batch in it:
                trained.append(to_numpy(batch))
                transports.append(client.transport)
                del batch
            # It connected the new constructor's slab socket as soon as that one served.
            assert transports[-1] == "shm" and transports.count("grpc") <= 1  # it connected the new constructor's slab socket
            # Every slab still mapped is one of the new constructor's: the old ones went with
            # their tensors.
            assert _mapped_slabs() <= _slab_fds(new_pid), _leftovers(killed, _slab_fds(new_pid))
        assert not old & _mapped_slabs()
        steps = [b["step"] for b in trained]
        assert steps == list(range(len(steps)))
        seen = [sample for step in sample_ids(trained) for mb in step for sample in mb]
        assert len(seen) == len(set(seen)) == 200  # every sample once (I1)
        _no_batchplane_files_in_dev_shm()
    finally:
        cluster.stop()
