"""`batchplane bench chaos`: what one failure costs the trainer, per kind of failure and prefetch
depth: the longest wait for data, the time until fresh batches flow again, and whether any
sample was lost or delivered twice.

Unlike the other benchmarks, this one runs a whole job on this machine: a planner, two loaders
(two sources each) and two constructors as processes (`LocalCluster`), and a stand-in trainer
process (`batchplane.examples.timed_trainer`) with two data-parallel ranks in lockstep that
spend `--step-seconds` (default 0.05) computing per step. The four sources are synthetic
(`demo.dataset` length distributions, `--rows` rows in all, default 4,000, row groups of 50),
one epoch, 32 samples a step in 2 microbatches per rank.

For every failure kind (`--failure`, repeatable; default loader, constructor, planner), with and
without shadow loaders (`--shadow on|off`, repeatable; default both: `loaders.shadow`, failover
with the default `loaders.failover`) and prefetch depth (`--prefetch`, repeatable; default 1,
2, 4: `constructors.prefetch_steps`), a fresh job runs to its end; when both ranks have received
step `--kill-at` (default 40) the harness SIGKILLs loader 0 (the primary, not its shadow),
constructor 0 or the planner and at once restarts it on its address with its arguments, as
`batchplane up` does (which polls every 0.5 s: add up to that). The restarted part rebuilds its
state: a loader reads again the windows constructors may still fetch (the planner's replay of
its ledger) or, with a shadow, the planner promotes the shadow and the restarted loader becomes
the new shadow; a constructor builds its ranks' steps again from the kept plans; the planner
resumes from its ledger where the constructors are.

Record fields:

- failure, shadow, prefetch;
- steps: steps each rank received; killed_at_step: the slowest rank's step when killed;
- max_data_wait_s: the longest a rank waited for a batch after the kill; baseline_wait_s: the
  longest before it (step 0, the job's start, excluded);
- recovery_s: from the kill until every rank received a step the data plane could not have
  built before the kill (killed_at_step + prefetch + 2: a rank that received step k has asked
  for k + 1 at most, and constructors build `prefetch` steps past their slowest rank's
  request), i.e. until fresh batches reach the trainer again;
- restart_s: from the kill until the restarted process served again;
- lost: samples of the epoch no rank received; duplicated: deliveries beyond the first of a
  sample (both must be 0);
- promoted: the planner promoted a shadow (loader failures with a shadow);
- replayed_samples: samples the restarted loader and the shadows read again because they did
  not hold them (`batchplane_loader_samples_replayed_total`): the cost of rebuilding a loader's
  position from the planner's ledger instead of a checkpoint of its own;
- seconds: the run's wall time.

Beside the records, `shadow_memory`: the resident memory of loader 0 and of its shadow just
before the kill, averaged over the runs with shadows: what one shadow loader costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import signal
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable

import pyarrow.parquet as pq

from batchplane.bench import positive_int, working_folder
from batchplane.bench.jobs import start_trainer, write_job
from batchplane.demo.dataset import DemoSource, LogNormal, Pareto, write_demo_dataset
from batchplane.launcher.local import LocalCluster, ServiceProcess

HELP = "the trainer's longest data wait, recovery time, lost and duplicated samples after a loader, constructor or planner is killed"

FAILURES = ("loader", "constructor", "planner")
RANKS = (0, 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--failure", action="append", choices=FAILURES, default=None, help="part to kill (repeatable; default all)")
    parser.add_argument("--shadow", action="append", choices=("off", "on"), default=None, help="shadow loaders (repeatable; default both)")
    parser.add_argument(
        "--prefetch", action="append", type=positive_int, default=None, help="constructors.prefetch_steps (repeatable; default 1, 2, 4)"
    )
    parser.add_argument("--kill-at", type=positive_int, default=40, help="step at which the part is killed (default 40)")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="the trainer's compute time per step (default 0.05)")
    parser.add_argument("--rows", type=positive_int, default=4000, help="rows over the four sources (default 4,000)")
    parser.add_argument("--dir", type=working_folder, default=None, help="working folder (default: a temporary one, removed after)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    failures = args.failure or list(FAILURES)
    prefetches = args.prefetch or [1, 2, 4]
    shadows = [s == "on" for s in (args.shadow or ["off", "on"])]
    memory: list[tuple[int, int]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = pathlib.Path(tmp)
        data = write_demo_dataset(root / "data", sources=_sources(args.rows), vocab_size=4096, seed=0)
        records = []
        for failure in failures:
            for shadow in shadows:
                for prefetch in prefetches:
                    progress(f"{failure} killed at step {args.kill_at}, {'with' if shadow else 'without'} shadows, prefetch {prefetch}")
                    record, rss = _run(
                        root / f"{failure}-{shadow}-{prefetch}", data, failure=failure, shadow=shadow, prefetch=prefetch, args=args
                    )
                    records.append(record)
                    if rss is not None:
                        memory.append(rss)
                    progress(f"  longest wait {record['max_data_wait_s']:.3f} s, recovery {record['recovery_s']:.3f} s")
    return {
        "records": records,
        "shadow_memory": {
            "runs": len(memory),
            "loader_rss_bytes": round(sum(m[0] for m in memory) / len(memory)) if memory else None,
            "shadow_rss_bytes": round(sum(m[1] for m in memory) / len(memory)) if memory else None,
        },
        "trainer": {"ranks": len(RANKS), "step_seconds": args.step_seconds, "global_batch_size": 32},
        "restart": "immediately on the kill, by the harness (batchplane up polls every 0.5 s)",
    }


def _sources(rows: int) -> list[DemoSource]:
    share = max(rows // 4, 50)
    return [
        DemoSource("web", "web text", share, 2, 50, (LogNormal(median=300, sigma=0.6),), min_length=8, max_length=1024),
        DemoSource("code", "code", share, 2, 50, (Pareto(minimum=64, alpha=1.1),), min_length=16, max_length=1024),
        DemoSource("chat", "chat", share, 2, 50, (LogNormal(median=48, sigma=0.5),), min_length=4, max_length=512),
        DemoSource("math", "math", share, 2, 50, (LogNormal(median=160, sigma=0.4),), min_length=8, max_length=1024),
    ]


@dataclasses.dataclass
class _Step:
    rank: int
    step: int
    wait_s: float
    received: float
    samples: list[list[int]]


def _run(
    folder: pathlib.Path, data: dict[str, pathlib.Path], *, failure: str, shadow: bool, prefetch: int, args: argparse.Namespace
) -> tuple[dict, tuple[int, int] | None]:
    """One run: its record, and (loader 0's, its shadow's) resident bytes before the kill."""
    config = write_job(
        folder,
        f"chaos-{failure}-{'shadow' if shadow else 'plain'}-{prefetch}",
        data,
        ranks=len(RANKS),
        batch=32,
        loaders={"count": 2, "shadow": shadow},
        constructors={"prefetch_steps": prefetch},
    )
    begin = time.monotonic()
    steps_path = folder / "steps.jsonl"
    with LocalCluster(config) as cluster:  # started on entering
        trainer = start_trainer(cluster, RANKS, step_seconds=args.step_seconds, out=steps_path)
        try:
            while _slowest(steps_path) < args.kill_at:
                if trainer.poll() is not None:
                    raise RuntimeError(f"the trainer ended before step {args.kill_at}: {trainer.stdout.read().decode()[-2000:]}")
                time.sleep(0.005)
            victim = _victim(cluster, failure)
            rss = (_rss(cluster, "loader-0"), _rss(cluster, "loader-0-shadow")) if shadow else None
            killed = time.time()
            killed_at = _slowest(steps_path)
            victim.popen.send_signal(signal.SIGKILL)
            victim.popen.wait()
            cluster.restart(victim)
            restart_s = time.time() - killed
            output = trainer.communicate(timeout=600)[0].decode()
            if trainer.returncode:
                raise RuntimeError(f"the trainer failed after the {failure} was killed: {output[-2000:]}")
            promoted = "promoted its shadow" in cluster.planner.log_path.read_text()
            replayed = sum(_replayed(p) for p in cluster.loaders)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    steps = [_Step(**json.loads(line)) for line in steps_path.read_text().splitlines()]
    before = [s.wait_s for s in steps if 0 < s.step <= killed_at]
    after = [s.wait_s for s in steps if s.step > killed_at]
    fresh = killed_at + prefetch + 2
    fresh_at = [min((s.received for s in steps if s.rank == r and s.step >= fresh), default=float("nan")) for r in RANKS]
    delivered = Counter(tuple(sample) for s in steps for sample in s.samples)
    expected = _rows(data)
    return {
        "failure": failure,
        "shadow": shadow,
        "prefetch": prefetch,
        "steps": max(s.step for s in steps) + 1,
        "killed_at_step": killed_at,
        "max_data_wait_s": round(max(after), 4),
        "baseline_wait_s": round(max(before, default=0.0), 4),
        "recovery_s": round(max(fresh_at) - killed, 4),
        "restart_s": round(restart_s, 4),
        "lost": expected - len(delivered),
        "duplicated": sum(delivered.values()) - len(delivered),
        "promoted": promoted,
        "replayed_samples": replayed,
        "seconds": round(time.monotonic() - begin, 2),
    }, rss


def _replayed(process: ServiceProcess) -> int:
    """batchplane_loader_samples_replayed_total of a loader, over its sources."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).read().decode()
    return int(
        sum(float(line.rpartition(" ")[2]) for line in page.splitlines() if line.startswith("batchplane_loader_samples_replayed_total{"))
    )


def _rss(cluster: LocalCluster, name: str) -> int:
    """Resident bytes of process `name` of the cluster."""
    return next(p for p in cluster.processes if p.name == name).rss_bytes() or 0


def _rows(data: dict[str, pathlib.Path]) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for path in data.values() for f in sorted(path.glob("*.parquet")))


def _slowest(steps_path: pathlib.Path) -> int:
    """The step the slowest rank has received so far (-1 before any)."""
    if not steps_path.exists():
        return -1
    latest = dict.fromkeys(RANKS, -1)
    for line in steps_path.read_text().splitlines():
        if line.endswith("}"):
            s = json.loads(line)
            latest[s["rank"]] = max(latest[s["rank"]], s["step"])
    return min(latest.values())


def _victim(cluster: LocalCluster, failure: str) -> ServiceProcess:
    return {"loader": cluster.loaders[0], "constructor": cluster.constructors[0], "planner": cluster.planner}[failure]
