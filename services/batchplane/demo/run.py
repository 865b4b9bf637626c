"""`batchplane demo`: writes a five-source Parquet dataset (four text sources, one image-text),
starts the data plane as local processes, trains a tiny model on two data-parallel ranks (two
trainer processes) against it and prints a summary: throughput, the configured and realized
mixture per source, the per-rank step cost spread of each balancing method on the same samples,
and each process's memory.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

from batchplane.demo.dataset import DEMO_SOURCES, write_demo_dataset
from batchplane.demo.images import IMAGE_TOKEN_ID, PAYLOAD
from batchplane.launcher.local import LaunchError, LocalCluster

DP = 2
WEIGHTS = {"captions": 0.3, "docs": 0.2, "code": 0.2, "chat": 0.2, "images": 0.1}
#: Loader transform settings by source name; the other sources use the default transform.
#: "images" decodes its JPEGs into 14x14 patches (longer side at most 448 pixels) and puts one
#: IMAGE_TOKEN_ID (1023, the last id of the tiny model's 1024-token vocabulary) per patch in
#: front of the caption, and ships the pixels (uint8 patch rows, `pixels`) with their grids as the
#: job's payload columns (`batch.payload` = `batchplane.demo.images.PAYLOAD`).
TRANSFORMS = {
    "images": {
        "transform": "batchplane.demo.images:image_text",
        "transform_args": {"patch": 14, "max_side": 448, "image_token_id": IMAGE_TOKEN_ID, "pixels": True},
        "columns": ["caption", "images"],
    },
}
JOB_TEMPLATE = """\
# Written by `batchplane demo`. Four text sources and an image-text one, mixed 30/20/20/20/10,
# balanced by Karmarkar-Karp over two data-parallel ranks with two microbatches each.
job: demo
seed: 1234
epochs: infinite
sources:
{sources}
mixture:
  weights: {weights}
batch:
  global_batch_size: 32
  microbatches: 2
  # the image source's pixels and grids, in each microbatch as blobs beside their samples
  payload: {payload}
mesh:
  dp: {dp}
balance:
  method: karmarkar_karp
  cost: {{kind: quadratic}}
loaders:
  count: 2
constructors:
  ranks_per_constructor: 1
  prefetch_steps: 2
ledger:
  compare_methods: true
run_dir: run
"""


def write_job(workdir: pathlib.Path) -> pathlib.Path:
    """Writes the demo's job configuration; returns its path."""
    sources = "\n".join("  - " + json.dumps({"name": s.name, "path": f"data/{s.name}", **TRANSFORMS.get(s.name, {})}) for s in DEMO_SOURCES)
    path = workdir / "job.yaml"
    payload = json.dumps([dict(c) for c in PAYLOAD])
    path.write_text(JOB_TEMPLATE.format(sources=sources, weights=json.dumps(WEIGHTS), dp=DP, payload=payload))
    return path


def ensure_dataset(workdir: pathlib.Path) -> None:
    """Writes the demo dataset once: a marker file records that it is complete and what it
    holds, so a dataset written by another version is written again."""
    marker = workdir / "data" / ".complete"
    spec = repr(DEMO_SOURCES)
    if marker.exists() and marker.read_text() == spec:
        print(f"demo dataset: {workdir / 'data'} (already written)")
        return
    shutil.rmtree(workdir / "data", ignore_errors=True)
    total = sum(s.num_rows for s in DEMO_SOURCES)
    done: dict[str, int] = {}

    def progress(name: str, rows: int, _rows_total: int) -> None:
        done[name] = rows
        _bar("writing demo dataset", sum(done.values()), total)

    write_demo_dataset(workdir / "data", progress=progress)
    print()
    marker.write_text(spec)


def _bar(label: str, done: int, total: int, width: int = 30) -> None:
    filled = int(width * done / max(total, 1))
    print(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} rows", end="", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(*, workdir: pathlib.Path, steps: int, log_every: int) -> int:
    """Runs the demo in `workdir`; returns the exit status."""
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ensure_dataset(workdir)
    config = write_job(workdir)
    shutil.rmtree(workdir / "run", ignore_errors=True)
    try:
        cluster = LocalCluster(config).start()
    except LaunchError as exc:
        print(f"batchplane demo: {exc}", file=sys.stderr)
        return 1
    try:
        print(
            f"data plane up: planner {cluster.planner.address}, {len(cluster.loaders)} loaders, "
            f"{len(cluster.constructors)} constructors; logs in {cluster.run_dir / 'logs'}"
        )
        stats = _train(cluster, workdir, steps=steps, log_every=log_every)
        if stats is None:
            return 1
        status = cluster.status()
        memory = {p.name: p.rss_bytes() for p in cluster.processes}
    finally:
        cluster.stop()
    print(summary(stats, status, memory))
    return 0


def _train(cluster: LocalCluster, workdir: pathlib.Path, *, steps: int, log_every: int) -> list[dict] | None:
    env = {**os.environ, "BATCHPLANE_ENDPOINTS": str(cluster.endpoints_path)}
    port = _free_port()
    trainers = []
    for rank in range(DP):
        command = [
            sys.executable,
            "-m",
            "batchplane.examples.tiny_lm",
            "--rank",
            str(rank),
            "--world-size",
            str(DP),
            "--master-port",
            str(port),
            "--steps",
            str(steps),
            "--log-every",
            str(log_every),
            "--stats",
            str(workdir / f"trainer-{rank}.json"),
        ]
        output = None if rank == 0 else open(workdir / f"trainer-{rank}.log", "w")  # noqa: SIM115
        trainers.append(subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None))
    print(f"training a tiny model for {steps} steps on {DP} data-parallel ranks ...", flush=True)
    while any(t.poll() is None for t in trainers):
        try:
            cluster.check_alive()
        except LaunchError as exc:
            print(f"batchplane demo: {exc}", file=sys.stderr)
            for t in trainers:
                t.kill()
            return None
        time.sleep(0.2)
    failed = [rank for rank, t in enumerate(trainers) if t.returncode != 0]
    if failed:
        print(f"batchplane demo: trainer rank(s) {failed} failed; see {workdir}/trainer-*.log", file=sys.stderr)
        for rank in failed:
            log = workdir / f"trainer-{rank}.log"
            if log.exists():  # rank 0 writes to the terminal
                tail = log.read_text(errors="replace").splitlines()[-25:]
                print(f"--- the end of trainer-{rank}.log ---", *tail, sep="\n", file=sys.stderr)
        return None
    return [json.loads((workdir / f"trainer-{rank}.json").read_text()) for rank in range(DP)]


def summary(stats: list[dict], status, memory: dict[str, int | None]) -> str:
    """The closing summary the demo prints."""
    elapsed = max(s["elapsed_s"] for s in stats)
    steps = stats[0]["steps"]
    samples = sum(s["samples"] for s in stats)
    tokens = sum(s["tokens"] for s in stats)
    wait = sum(s["data_wait_s"] for s in stats) / len(stats)
    received = {}
    for s in stats:
        for name, n in s["per_source"].items():
            received[name] = received.get(name, 0) + n
    planned_total = sum(src.samples for src in status.sources) or 1
    planned_tokens = sum(src.tokens for src in status.sources) or 1
    lines = [
        "",
        "=== batchplane demo summary ===",
        f"steps {steps} on {len(stats)} ranks in {elapsed:.1f} s: {steps / elapsed:.1f} steps/s, "
        f"{samples / elapsed:.0f} samples/s, {tokens / elapsed:.0f} tokens/s",
        f"loss {stats[0]['first_loss']:.3f} -> {stats[0]['last_loss']:.3f}; trainers waited for data "
        f"{wait:.2f} s each ({100 * wait / elapsed:.1f}% of the run)",
        "mixture fidelity: source  target  planned (samples)  drift  received by trainers  planned (tokens)",
    ]
    for src in status.sources:
        lines.append(
            f"  {src.name:<10} {src.target_samples / planned_total:>7.3f} {src.samples / planned_total:>10.3f} "
            f"{(src.samples - src.target_samples) / planned_total:>+14.4f} {received.get(src.name, 0) / max(samples, 1):>8.3f} "
            f"{src.tokens / planned_tokens:>22.3f}"
        )
    lines.append(
        f"per-rank step cost of the microbatches as built (padded; quadratic in length), max/min averaged over "
        f"{status.steps_planned} planned steps:"
    )
    for figure in status.balance:
        configured = "  (configured)" if figure.method == status.balance[0].method else ""
        lines.append(
            f"  {figure.method:<15} max/min {figure.mean_max_over_min:8.3f}   max/mean {figure.mean_max_over_mean:6.3f}{configured}"
        )
    lines.append("resident memory: " + ", ".join(f"{name} {rss / 2**20:.0f} MiB" for name, rss in memory.items() if rss is not None))
    return "\n".join(lines)
