"""Shared pieces of the integration tests: Parquet sources with known contents, job files, a
running data plane (real processes on 127.0.0.1) and clients that collect every rank's batches."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchplane.client import Client
from batchplane.core.identity import Identity
from batchplane.core.tls import CertificateFolder, Security
from batchplane.local_transport import local_channel
from batchplane.core.storage import LocalStorage
from batchplane.launcher.local import LocalCluster
from batchplane.planner.journal import RUNTIME_FIELDS, LedgerReader

#: How long a test waits for a trainer it started (torchrun and its ranks, a framework's fit) to
#: end before failing it as hung. A hang guard, not a speed check: such a run takes 10 to 50 s on
#: two idle cores and several times that on two cores shared with a loaded test run (the
#: torchtitan test's reference-and-first run took 93 s under six workers).
TRAINER_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class SourceData:
    """A written source: its folder and the token ids of every row, in source row order."""

    name: str
    path: pathlib.Path
    rows: list[np.ndarray]


def write_source(
    root: pathlib.Path,
    name: str,
    lengths: Sequence[int],
    *,
    files: int = 2,
    row_group_size: int = 40,
    seed: int = 0,
) -> SourceData:
    """Writes a source of len(lengths) rows (int32 token lists) over `files` files."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 50_000, n).astype(np.int32) for n in lengths]
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(rows), files + 1).astype(int)
    for f in range(files):
        part = rows[bounds[f] : bounds[f + 1]]
        table = pa.table(
            {
                "input_ids": pa.array(part, type=pa.list_(pa.int32())),
                "doc_id": pa.array(np.arange(bounds[f], bounds[f + 1]), pa.int64()),
            }
        )
        pq.write_table(table, folder / f"part-{f:05d}.parquet", row_group_size=row_group_size, compression="zstd", write_page_checksum=True)
    return SourceData(name, folder, rows)


def corrupt_row_group(path: pathlib.Path, index: int) -> int:
    """Flips bytes inside the data pages of one row group; returns its row count."""
    meta = pq.ParquetFile(path).metadata
    column = meta.row_group(index).column(0)
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data = bytearray(path.read_bytes())
    for i in range(start + 20, start + column.total_compressed_size - 4, 7):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return meta.row_group(index).num_rows


def skewed_lengths(n: int, *, seed: int, long_share: float = 0.1, short: int = 48, long: int = 600) -> list[int]:
    """Mostly short samples with a long tail."""
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < long_share, rng.integers(short, long, n), rng.integers(2, short, n)).tolist()


def write_job(path: pathlib.Path, sources: Sequence[SourceData], /, **settings: Any) -> pathlib.Path:
    """Writes a job file; `settings` replace top-level sections of the defaults (`sources=` too)."""
    job = {
        "job": "test",
        "seed": 11,
        "epochs": 1,
        "sources": [{"name": s.name, "path": str(s.path)} for s in sources],
        "batch": {"global_batch_size": 12, "microbatches": 2, "token_dtype": "int32"},
        "mesh": {"dp": 2},
        "run_dir": str(path.parent / "run"),
    }
    job.update(settings)
    path.write_text(yaml.safe_dump(job))
    return path


Batch = dict[str, Any]


def to_numpy(batch: dict[str, Any]) -> Batch:
    """A client batch with its tensors as numpy arrays (copied, so they outlive the client)."""
    return {
        "step": batch["step"],
        "global_loss_tokens": batch["global_loss_tokens"],
        "microbatches": [{k: (v.numpy().copy() if hasattr(v, "numpy") else v) for k, v in mb.items()} for mb in batch["microbatches"]],
    }


def collect(
    endpoints: pathlib.Path,
    ranks: Sequence[int],
    *,
    states: dict[int, dict] | None = None,
    stop_after: int | None = None,
    on_batch: Callable[[int, Batch], None] | None = None,
) -> tuple[dict[int, list[Batch]], dict[int, dict]]:
    """Runs one client per rank concurrently (as trainers do) until the end of data or until
    `stop_after` batches each; `on_batch(rank, batch)` runs after each batch (a trainer's step).

    Returns:
        (batches per rank, each client's state_dict at the end).
    """
    import os

    os.environ["BATCHPLANE_ENDPOINTS"] = str(endpoints)
    results: dict[int, list[Batch]] = {}
    final_states: dict[int, dict] = {}

    def run(rank: int) -> None:
        with Client(rank=rank, timeout_s=60) as client:
            if states and rank in states:
                client.load_state_dict(states[rank])
            out = []
            for batch in client:
                out.append(to_numpy(batch))
                if on_batch is not None:
                    on_batch(rank, batch)
                if stop_after is not None and len(out) >= stop_after:
                    break
            results[rank] = out
            final_states[rank] = client.state_dict()

    run_ranks(run, ranks)
    return results, final_states


def run_ranks(fn: Callable[[int], None], ranks: Sequence[int]) -> None:
    """Runs `fn(rank)` for every rank at once, one thread each (as trainers run), and re-raises
    the first failure in the calling thread."""
    failures: list[BaseException] = []

    def guarded(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if failures:
        raise failures[0]


def sample_ids(batches: list[Batch]) -> list[list[list[tuple[int, int]]]]:
    """Per step, per microbatch: (source, row) of each sample."""
    return [[list(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())) for mb in b["microbatches"]] for b in batches]


def assert_rows_as_written(got: dict[int, list[Batch]], sources: Sequence[SourceData]) -> int:
    """Every sample the ranks received has the token ids of its (source, row) as written to
    Parquet; returns how many samples were checked."""
    checked = 0
    for batches in got.values():
        for batch in batches:
            for mb in batch["microbatches"]:
                for i, (k, r) in enumerate(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())):
                    length = int(mb["sample_length"][i])
                    assert mb["input_ids"][i, :length].tobytes() == sources[k].rows[r].tobytes(), (k, r)
                    checked += 1
    return checked


def assert_same_batches(got: dict[int, list[Batch]], expected: dict[int, list[Batch]]) -> None:
    """Every rank received the same steps as in `expected`, with byte-identical tensors (I2, I4)."""
    assert got.keys() == expected.keys()
    for rank in expected:
        assert [b["step"] for b in got[rank]] == [b["step"] for b in expected[rank]], f"rank {rank} took other steps"
        for mine, theirs in zip(got[rank], expected[rank]):
            assert len(mine["microbatches"]) == len(theirs["microbatches"])
            for a, b in zip(mine["microbatches"], theirs["microbatches"]):
                assert a.keys() == b.keys()
                for name in a:
                    if isinstance(a[name], np.ndarray):
                        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), (rank, mine["step"], name)


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as {'name{labels}': value}."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def start_steps(cluster: LocalCluster, name: str) -> dict[str, float]:
    """The start-step gauges of cluster process `name` (running): one for a planner or a
    constructor (0 for a fresh job), one per source a loader joined mid-job (none for a loader
    that started with the job)."""
    process = next(p for p in cluster.processes if p.name == name)
    metrics = scrape(f"http://{cluster.job.network.host}:{process.metrics_port}/metrics")
    return {key: value for key, value in metrics.items() if key.startswith(f"batchplane_{name.split('-')[0]}_start_step")}


def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """Polls `condition` until true; fails the test after `timeout_s`."""
    give_up = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def start_cluster(config: pathlib.Path) -> LocalCluster:
    """Starts the data plane of job file `config` (stopping what it started where one part fails
    to start); the caller stops it."""
    return LocalCluster(config, log_level="INFO").start()


@contextlib.contextmanager
def running_cluster(config: pathlib.Path) -> Iterator[LocalCluster]:
    """The data plane of job file `config`, running for the block and stopped after it however
    the block ends: every process it holds then (restarted ones too) by its pid, SIGTERM, then
    SIGKILL after 10 s."""
    cluster = start_cluster(config)
    try:
        yield cluster
    finally:
        cluster.stop()


def ledger_records(run_dir: pathlib.Path) -> list[dict]:
    """The authoritative record of every step in a run folder's durable ledger, in step order:
    what was planned (without the fields that depend on the run's timing, RUNTIME_FIELDS)."""
    return [
        {k: v for k, v in record.items() if k not in RUNTIME_FIELDS} for record in LedgerReader(LocalStorage(run_dir / "ledger")).records()
    ]


def peer_channel(cluster: LocalCluster, address: str, *, role: str, index: int | None = None, replica: str | None = None) -> grpc.Channel:
    """A channel to one of `cluster`'s parts as a peer of `role` would open it ("planner",
    "loader", "constructor", "operator", "trainer"; `index`/`replica`: the identity a loader or constructor
    has): over mutual TLS with a certificate of that identity from the run's CA (plaintext when
    the job turned TLS off). A constructor's trainer socket is reached with local credentials,
    as a trainer reaches it. Tests acting as a hostile but authorized peer call parts through it."""
    if role == "trainer":
        return local_channel(address)
    if cluster.ca is None:
        return grpc.insecure_channel(address)
    identity = Identity(role, index, replica)
    folder = cluster.ca.issue(identity, cluster.tls_dir / "peers" / identity.uri().replace("/", "_").replace(":", ""))
    return Security(CertificateFolder(folder)).channel(address, peer=_role_at(cluster, address))


def _role_at(cluster: LocalCluster, address: str) -> str:
    """The role of the part of `cluster` serving at `address`."""
    for p in cluster.processes:
        if p.address == address:
            return p.module.rsplit(".", 1)[-1]
    raise AssertionError(f"no part of the cluster serves at {address}")
