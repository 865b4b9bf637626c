"""The client as trainers start it: before the data plane, across a restart of `batchplane up`,
on the rank's own device, and with the job's length for LR schedules and progress bars. Real
processes; CUDA is faked where the test says so (no GPU here)."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from harness import assert_same_batches, collect, sample_ids, start_cluster, to_numpy, wait_until, write_job, write_source

from batchplane.client import Client
from batchplane.client import device as client_device

pytestmark = pytest.mark.integration


@pytest.fixture
def sources(tmp_path):
    return [
        write_source(tmp_path / "data", "web", [4 + i % 23 for i in range(240)], row_group_size=20, seed=3),
        write_source(tmp_path / "data", "code", [3 + i % 13 for i in range(160)], row_group_size=20, seed=4),
    ]


def job(tmp_path, sources, name: str, **settings):
    return write_job(
        tmp_path / f"{name}.yaml",
        sources,
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
        mesh={"dp": 2},
        run_dir=str(tmp_path / name),
        **settings,
    )


def up(config) -> subprocess.Popen:
    """`batchplane up -c config`, as a user runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "batchplane.cli", "up", "-c", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_trainers_started_before_batchplane_up_and_kept_running_across_its_restart_finish_the_job(tmp_path, sources) -> None:
    reference_cluster = start_cluster(job(tmp_path, sources, "reference"))
    try:
        reference, _ = collect(reference_cluster.endpoints_path, [0, 1])
    finally:
        reference_cluster.stop()

    config = job(tmp_path, sources, "run")
    endpoints = tmp_path / "run" / "endpoints.json"
    assert not endpoints.exists()
    os.environ["BATCHPLANE_ENDPOINTS"] = str(endpoints)
    got: dict[int, list] = collections.defaultdict(list)
    failures: list[BaseException] = []

    def trainer(rank: int) -> None:
        try:
            with Client(rank=rank, timeout_s=120) as client:  # the data plane is not up yet
                for batch in client:
                    got[rank].append(to_numpy(batch))
                    time.sleep(0.02)  # a training step
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            failures.append(exc)

    trainers = [threading.Thread(target=trainer, args=(r,)) for r in (0, 1)]
    for t in trainers:
        t.start()
    first = up(config)
    second = None
    try:
        wait_until(lambda: min(len(got[0]), len(got[1])) >= 12 or failures, timeout_s=120, what="the trainers to reach step 12")
        first.send_signal(signal.SIGTERM)  # stops every part of the data plane; the trainers keep going
        first.wait(timeout=60)
        seen = {r: len(got[r]) for r in (0, 1)}
        second = up(config)
        for t in trainers:
            t.join(timeout=180)
        assert not failures, failures
        assert all(len(got[r]) > seen[r] for r in (0, 1)), "the trainers got nothing after the restart"
        assert second.wait(timeout=60) == 0  # it stops by itself once every rank reached the end
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    for rank in (0, 1):
        assert [b["step"] for b in got[rank]] == list(range(len(reference[rank])))
    assert_same_batches(dict(got), reference)
    seen_samples = collections.Counter(s for r in (0, 1) for step in sample_ids(got[r]) for mb in step for s in mb)
    assert sum(seen_samples.values()) == 400 and set(seen_samples.values()) == {1}


def test_each_ranks_tensors_go_to_its_own_device_from_a_fetch_thread_that_selected_it(tmp_path, sources, monkeypatch) -> None:
    """CUDA is faked (no GPU here): the test checks the wiring, that the fetch thread selects the
    rank's device (LOCAL_RANK) before it touches CUDA, copies there, and the trainer's thread
    takes the batch over; the copies themselves run on a GPU machine."""
    calls: list[tuple[str, str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", threading.current_thread().name, d)))

    def copy(self, groups):
        calls.append(("copy", threading.current_thread().name, self.device))
        return [dict(g) for g in groups], "copied"

    def hand_over(self, groups, done):
        calls.append(("hand_over", threading.current_thread().name, done))

    monkeypatch.setattr(client_device.DeviceCopier, "copy", copy)
    monkeypatch.setattr(client_device.DeviceCopier, "hand_over", hand_over)
    monkeypatch.setenv("LOCAL_RANK", "2")
    cluster = start_cluster(job(tmp_path, sources, "device", epochs="infinite"))
    try:
        os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
        with Client(rank=1, pin_memory=False, timeout_s=60) as client:
            assert client.device == torch.device("cuda", 2)
            batches = iter(client)
            next(batches), next(batches)
    finally:
        cluster.stop()
    main = threading.current_thread().name
    fetch = calls[0][1]
    assert calls[0] == ("set_device", fetch, torch.device("cuda", 2)) and fetch.startswith("batchplane-fetch")
    assert ("copy", fetch, torch.device("cuda", 2)) in calls
    assert [c for c in calls if c[0] == "hand_over"][:2] == [("hand_over", main, "copied")] * 2
    assert [c for c in calls if c[0] == "set_device"] == [calls[0]]  # once, on the one fetch thread


def test_len_is_the_number_of_steps_the_job_delivers(tmp_path, sources) -> None:
    staged = {"kind": "staged", "stages": [{"start": 0, "weights": {"web": 1, "code": 1}}, {"start": 10, "weights": {"web": 1, "code": 0}}]}
    for name, mixture in (("static", {"weights": {"web": 3, "code": 1}}), ("staged", {"schedule": staged})):
        cluster = start_cluster(job(tmp_path, sources, name, mixture=mixture))
        try:
            os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
            with Client(rank=0, timeout_s=60) as a, Client(rank=1, timeout_s=60) as b:
                lengths = {len(a), len(b), a.num_steps}
                delivered = sum(1 for _ in zip(a, b))
            assert lengths == {delivered}, (name, lengths, delivered)
            with Client(rank=0, timeout_s=60) as resumed:
                resumed.load_state_dict({**resumed.state_dict(), "next_step": 5})
                assert len(resumed) == delivered  # the job's length, like a DataLoader's
        finally:
            cluster.stop()
    cluster = start_cluster(job(tmp_path, sources, "endless", epochs="infinite"))
    try:
        os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
        with Client(rank=0, timeout_s=60) as client:
            assert client.num_steps is None
            with pytest.raises(TypeError, match="never ends"):
                len(client)
    finally:
        cluster.stop()
