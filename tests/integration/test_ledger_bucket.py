"""The planner's ledger in a bucket (`ledger.location: s3://...`), against a real S3 endpoint
(moto's server, which honours `If-None-Match: *`):

- ObjectStorage passes the Storage contract (tests/unit/storage_contract.py) and keeps its
  objects under its prefix (its errors: tests/integration/test_store_errors.py);
- a job whose planner is killed (SIGKILL) mid-run and restarted resumes from the bucket's
  ledger and delivers every Parquet row exactly once, as the ledger, read back from the bucket
  through `batchplane ledger`, says;
- a store that ignores conditional writes (a proxy that drops If-None-Match) is refused at
  start-up, naming the store;
- a second planner on the same ledger fences the first, which exits without writing again;
- without ledger.location, `batchplane up --run-dir` moves the ledger with the run folder.
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))  # the shared contract

from disturbed import Kill, disturb  # noqa: E402
from harness import (
    Batch,
    collect,
    running_cluster,
    sample_ids,
    skewed_lengths,
    start_cluster,
    to_numpy,
    wait_until,
    write_job,
    write_source,
)  # noqa: E402
from s3_proxy import S3Proxy  # noqa: E402
from s3_server import S3Server  # noqa: E402
from storage_contract import *  # noqa: E402,F403 - the contract's tests, run here on ObjectStorage over S3

from batchplane.client import Client  # noqa: E402
from batchplane.client.errors import DataPlaneError  # noqa: E402
from batchplane.core.errors import FailedPrecondition  # noqa: E402
from batchplane.core.object_storage import PROBE_PREFIX, ObjectStorage, open_storage  # noqa: E402
from batchplane.core.process import EXIT_BAD_INPUT, EXIT_FENCED  # noqa: E402
from batchplane.core.storage import LocalStorage  # noqa: E402
from batchplane.launcher.local import LaunchError, LocalCluster  # noqa: E402
from batchplane.planner.journal import LedgerReader  # noqa: E402

pytestmark = pytest.mark.integration

BUCKET = "ledgers"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(autouse=True)
def aws_environment(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Points obstore (here, and in the service processes, which inherit it) at the server."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def new_storage():
    """A maker of empty object storages: each a fresh prefix of the bucket."""
    return lambda: ObjectStorage.from_url(f"s3://{BUCKET}/contract/{uuid.uuid4().hex}")


@pytest.fixture
def storage(new_storage) -> ObjectStorage:
    return new_storage()


# --- ObjectStorage on S3, beyond the contract ------------------------------------------------


def test_objects_lie_under_the_prefix_and_the_check_of_conditional_writes_leaves_nothing(s3: S3Server) -> None:
    storage = open_storage(f"s3://{BUCKET}/under/a/prefix/", check_writes=True)
    assert storage.describe() == f"object store s3://{BUCKET}/under/a/prefix"
    assert s3.keys(BUCKET, "under/") == [], f"the scratch keys of the check were left: {PROBE_PREFIX}"
    storage.put_if_absent("gen-000001/head.json", b"{}")
    assert s3.keys(BUCKET, "under/") == ["under/a/prefix/gen-000001/head.json"]
    assert storage.list("gen-") == ["gen-000001/head.json"]


# --- A store that ignores conditional writes -------------------------------------------------


def test_a_store_that_ignores_conditional_writes_is_refused_at_start_up(
    s3: S3Server, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a proxy that drops If-None-Match, every PUT overwrites: opening the store for
    writing refuses it, and so does the planner, which exits before serving (its launcher says so)."""
    location = f"s3://{BUCKET}/careless/ledger"
    with S3Proxy(s3.endpoint, drop=("If-None-Match",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with pytest.raises(FailedPrecondition) as caught:
            open_storage(location, check_writes=True)
        assert str(caught.value).startswith(f"object store {location} ignores conditional writes (If-None-Match)")
        assert "the ledger needs them" in str(caught.value)
        assert proxy.dropped == 2, "the two conditional puts of the check went through the proxy"
        assert s3.keys(BUCKET, "careless/") == [], "the check's scratch key was left"

        sources = [write_source(tmp_path / "data", "a", skewed_lengths(40, seed=1), seed=1)]
        config = write_job(tmp_path / "job.yaml", sources, ledger={"location": location})
        cluster = LocalCluster(config, log_level="INFO")
        with pytest.raises(LaunchError, match=f"planner exited with status {EXIT_BAD_INPUT} while starting") as launch:
            cluster.start(timeout_s=60)
    log = (cluster.run_dir / "logs" / "planner.log").read_text()
    assert f"cannot start planner: object store {location} ignores conditional writes (If-None-Match)" in log
    assert "ignores conditional writes" in str(launch.value)
    assert s3.keys(BUCKET, "careless/") == [], "the refused planner wrote to the ledger"


# --- A job with its ledger in the bucket -----------------------------------------------------


def _sources(root: pathlib.Path):
    """450 and 300 rows: 93 steps of 8, far more than the planning window (`bounds.plan_lead`)
    past the 3 steps the trainers take before they hold, so the planner has steps left to plan."""
    return [
        write_source(root / "data", "a", skewed_lengths(450, seed=5), row_group_size=10, seed=5),
        write_source(root / "data", "b", skewed_lengths(300, seed=6), row_group_size=10, seed=6),
    ]


def _job(root: pathlib.Path, sources, location: str) -> pathlib.Path:
    return write_job(
        root / "job.yaml",
        sources,
        run_dir=str(root / "run"),
        ledger={"location": location},
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
    )


def _ledger_cli(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "batchplane.cli", "ledger", *args, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _bucket_sources(s3: S3Server, root: pathlib.Path) -> tuple[list, list[dict[str, str]]]:
    """Three sources uploaded to the bucket and named as a user would: a folder, a glob and a
    single file (the glob's and the file's sources are one file each in their own folder). 40
    steps of 8: longer than the planning window (`bounds.plan_lead`, 25 steps by default), so the
    ledger's records say where the ranks stood mid-run (a job within one window is planned and
    written whole before any rank was handed a step)."""
    sources = [
        write_source(root / "data", "a", skewed_lengths(250, seed=5), row_group_size=10, seed=5),
        write_source(root / "data", "b", skewed_lengths(40, seed=6), files=1, row_group_size=10, seed=6),
        write_source(root / "data", "c", skewed_lengths(30, seed=7), files=1, row_group_size=10, seed=7),
    ]
    for s in sources:
        s3.upload_folder(s.path, BUCKET, f"killed/data/{s.name}")
    paths = [
        f"s3://{BUCKET}/killed/data/a/",
        f"s3://{BUCKET}/killed/data/b/*.parquet",
        f"s3://{BUCKET}/killed/data/c/part-00000.parquet",
    ]
    return sources, [{"name": s.name, "path": path} for s, path in zip(sources, paths)]


def test_a_planner_killed_mid_run_resumes_from_the_bucket_with_every_row_once(s3: S3Server, tmp_path: pathlib.Path) -> None:
    """Sources and ledger in one bucket: nothing of the job but its configuration on local disk."""
    sources, entries = _bucket_sources(s3, tmp_path)
    for s in sources:
        shutil.rmtree(s.path)  # the rows stay in memory as ground truth; the loaders read the bucket
    location = f"s3://{BUCKET}/killed/ledger"
    config = write_job(
        tmp_path / "job.yaml",
        sources,
        sources=entries,
        run_dir=str(tmp_path / "run"),
        ledger={"location": location},
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
    )
    with running_cluster(config) as cluster:
        run = disturb(cluster, [0, 1], [Kill(12, "planner")], step_s=0.03)  # past the first steps, whose records say nothing was handed yet
    got, (restarted,) = run.batches, run.killed
    planner_log = restarted.process.log_path.read_text()

    last = len(got[0]) - 1
    assert restarted.at < last - 1, "the kill came after the last step"
    assert f"ledger in object store {location} (writer epoch 1)" in planner_log
    assert f"ledger in object store {location} (writer epoch 2)" in planner_log
    resumed = re.search(r"job resumes at step (\d+) from the ledger's record of step (\d+) \(generation 1\)", planner_log)
    assert resumed and 0 < int(resumed.group(1)) <= last, "the restarted planner did not resume from the bucket's ledger"

    # Every Parquet row exactly once, byte for byte.
    seen = collections.Counter()
    for rank, batches in got.items():
        assert [b["step"] for b in batches] == list(range(last + 1)), f"rank {rank} took other steps"
        for batch in batches:
            for mb in batch["microbatches"]:
                for i, (source, row) in enumerate(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())):
                    seen[(source, row)] += 1
                    length = int(mb["sample_length"][i])
                    assert mb["input_ids"][i, :length].tobytes() == sources[source].rows[row].tobytes()
    assert max(seen.values()) == 1, "a row was delivered twice"
    assert set(seen) == {(k, row) for k, s in enumerate(sources) for row in range(len(s.rows))}, "a row was lost"

    # The ledger lies in the bucket only, and says what the trainers got.
    assert not (tmp_path / "run" / "ledger").exists(), "the ledger was written to the run folder too"
    keys = s3.keys(BUCKET, "killed/ledger/")
    assert [k for k in keys if "/epochs/" in k] == ["killed/ledger/epochs/000000000001", "killed/ledger/epochs/000000000002"]
    assert {"killed/ledger/gen-000001/head.json", "killed/ledger/gen-000002/head.json"} <= set(keys)
    assert not [k for k in keys if PROBE_PREFIX in k]
    reader = LedgerReader(ObjectStorage.from_url(location))
    assert reader.last_step() == last
    for rank, batches in got.items():
        for batch, ids in zip(batches, sample_ids(batches)):
            record = reader.record(batch["step"])
            assert [[(s, row) for s, row, _ in mb] for mb in record["ranks"][rank]] == ids, (rank, batch["step"])

    # `batchplane ledger` reads it from the bucket, by URL and through the job's ledger.location.
    for where in (["--ledger", location], ["-c", str(config)]):
        stats = _ledger_cli("stats", *where)
        assert (stats["first"], stats["last"], stats["steps"]) == (0, last, last + 1)
        assert stats["samples"] == sum(len(s.rows) for s in sources)
        assert {r["source"]: r["samples"] for r in stats["sources"]} == {s.name: len(s.rows) for s in sources}
    step = int(resumed.group(1))  # the first step the restarted planner's generation owns
    shown = _ledger_cli("show", "--ledger", location, "--step", str(step))
    assert shown["generation"] == reader.owner(step).gen
    source, row = next(iter(sample_ids(got[0])[step][0]))
    found = _ledger_cli("find", "--ledger", location, f"{sources[source].name}:{row}")
    assert [(s["step"], s["bucket"]) for s in found["seen"]] == [(step, 0)]


# --- Fencing ---------------------------------------------------------------------------------


class Trainer(threading.Thread):
    """One rank's loop: takes batches until it has `hold_after`, then waits for `go`; halted by
    closing its client."""

    def __init__(self, rank: int, *, hold_after: int, go: threading.Event) -> None:
        super().__init__(name=f"trainer-{rank}", daemon=True)
        self.client = Client(rank=rank, timeout_s=30)
        self.hold_after = hold_after
        self.go = go
        self.batches: list[Batch] = []
        self.error: BaseException | None = None
        self._halted = False

    def run(self) -> None:
        try:
            for batch in self.client:
                self.batches.append(to_numpy(batch))
                if len(self.batches) == self.hold_after:
                    self.go.wait(timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported by halt()
            if not self._halted:
                self.error = exc

    def halt(self) -> None:
        self._halted = True
        self.client.close()
        self.join(timeout=30)


def _stable(read, *, quiet_s: float, timeout_s: float):
    """Waits until `read()` gives the same value for `quiet_s`; returns it."""
    give_up = time.monotonic() + timeout_s
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < give_up, "it kept changing"
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def test_a_second_planner_on_the_ledger_fences_the_first(s3: S3Server, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainers take a few steps and hold; once the first planner has planned all it will, a
    second planner opens the same ledger; the trainers go on, and the first planner, at its next
    step's record, is fenced: it exits with EXIT_FENCED and writes nothing more."""
    sources = _sources(tmp_path)
    location = f"s3://{BUCKET}/fenced/ledger"
    config = _job(tmp_path, sources, location)
    cluster = start_cluster(config)
    second = None
    go = threading.Event()
    try:
        monkeypatch.setenv("BATCHPLANE_ENDPOINTS", str(cluster.endpoints_path))
        trainers = [Trainer(rank, hold_after=3, go=go) for rank in (0, 1)]
        for t in trainers:
            t.start()
        wait_until(lambda: all(len(t.batches) >= 3 for t in trainers), timeout_s=60, what="the trainers to take 3 steps")
        records = _stable(lambda: s3.keys(BUCKET, "fenced/ledger/gen-"), quiet_s=1.5, timeout_s=30)
        assert records and all(k.startswith("fenced/ledger/gen-000001/") for k in records)

        ready = tmp_path / "second.ready"
        with open(tmp_path / "second-planner.log", "wb") as out:
            second = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "batchplane.planner",
                    "-c",
                    str(config),
                    "--ready-file",
                    str(ready),
                    "--run-dir",
                    str(tmp_path / "second"),
                    "--tls-dir",
                    str(cluster.tls_dir / "planner"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(lambda: ready.exists() or second.poll() is not None, timeout_s=60, what="the second planner to serve")
        assert second.poll() is None, (tmp_path / "second-planner.log").read_text()
        assert f"ledger in object store {location} (writer epoch 2)" in (tmp_path / "second-planner.log").read_text()

        go.set()  # the trainers go on: the first planner plans its next step
        first = cluster.planner
        assert first.popen.wait(timeout=60) == EXIT_FENCED
        for t in trainers:
            t.halt()
    finally:
        cluster.stop()
        if second is not None and second.poll() is None:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=30)

    log = first.log_path.read_text()
    assert re.search(
        rf"this planner \(writer epoch 1\) is fenced: another planner claimed the ledger at object store {re.escape(location)} "
        rf"as writer epoch 2 \(host \S+, pid {second.pid}\)",
        log,
    ), log[-2000:]
    assert s3.keys(BUCKET, "fenced/ledger/gen-") == records, "the fenced planner wrote to the ledger after the claim"
    assert [k for k in s3.keys(BUCKET, "fenced/ledger/epochs/")] == [
        "fenced/ledger/epochs/000000000001",
        "fenced/ledger/epochs/000000000002",
    ]
    # What the trainers got was recorded before the claim.
    reader = LedgerReader(ObjectStorage.from_url(location))
    assert max(b["step"] for t in trainers for b in t.batches) <= reader.last_step()


def test_a_fenced_planner_is_not_started_again_by_batchplane_up(
    s3: S3Server, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`batchplane up` restarts a process that exits, but not a planner that was fenced: started
    again, it would fence the newer one in turn. It stops, naming the cause."""
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(100, seed=2), seed=2)]
    location = f"s3://{BUCKET}/up/ledger"
    config = write_job(tmp_path / "job.yaml", sources, ledger={"location": location})
    endpoints = tmp_path / "run" / "endpoints.json"
    up = subprocess.Popen(
        [sys.executable, "-m", "batchplane.cli", "up", "-c", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    intruder = None
    try:
        wait_until(lambda: endpoints.exists() or up.poll() is not None, timeout_s=60, what="batchplane up to serve")
        assert up.poll() is None
        ready = tmp_path / "intruder.ready"
        intruder = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchplane.planner",
                "-c",
                str(config),
                "--ready-file",
                str(ready),
                "--run-dir",
                str(tmp_path / "intruder"),
                "--tls-dir",
                str(tmp_path / "run" / "tls" / "planner"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: ready.exists() or intruder.poll() is not None, timeout_s=60, what="the second planner to serve")
        assert intruder.poll() is None
        # A trainer asks for its first step: the first planner opens its generation, and is fenced.
        monkeypatch.setenv("BATCHPLANE_ENDPOINTS", str(endpoints))
        with Client(rank=0, timeout_s=5) as client, pytest.raises(DataPlaneError):  # its data plane goes away
            next(iter(client))
        out, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=30)
        if intruder is not None and intruder.poll() is None:
            intruder.send_signal(signal.SIGTERM)
            intruder.wait(timeout=30)
    assert up.returncode == 1, out
    assert "batchplane up: the planner was fenced: another planner took over the job's ledger" in out
    assert "restarting it" not in out
    assert s3.keys(BUCKET, "up/ledger/epochs/") == ["up/ledger/epochs/000000000001", "up/ledger/epochs/000000000002"]
    assert s3.keys(BUCKET, "up/ledger/gen-") == [], "the fenced planner opened a generation"


# --- The ledger follows --run-dir ------------------------------------------------------------


def test_without_a_location_the_ledger_follows_the_run_folder(tmp_path: pathlib.Path) -> None:
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(48, seed=3), seed=3)]
    config = write_job(tmp_path / "job.yaml", sources, run_dir=str(tmp_path / "configured"))
    moved = tmp_path / "moved"
    cluster = LocalCluster(config, run_dir=moved, log_level="INFO").start()
    try:
        got, _ = collect(cluster.endpoints_path, [0, 1])
    finally:
        cluster.stop()
    assert not (tmp_path / "configured").exists(), "something was written to the job's own run_dir"
    reader = LedgerReader(LocalStorage(moved / "ledger"))
    assert reader.last_step() == len(got[0]) - 1
    assert LocalStorage(moved / "ledger").list("epochs/") == ["epochs/000000000001"]
    stats = _ledger_cli("stats", "--ledger", str(moved / "ledger"))
    assert stats["samples"] == len(sources[0].rows)
