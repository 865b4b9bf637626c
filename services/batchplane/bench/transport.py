"""`batchplane bench transport`: what mutual TLS costs on the delivery path, measured side by
side with `network.tls: off` on the same data.

Like `chaos`, it runs whole jobs on this machine: a planner, two loaders and two constructors as
processes (`LocalCluster`), and the stand-in trainer (`batchplane.examples.timed_trainer`, two
data-parallel ranks in lockstep) with no compute time, so it asks for batches as fast as the data
plane delivers them. Four synthetic sources (`demo.dataset` length distributions, `--rows` rows,
default 24,000), one epoch, `--batch` samples a step (default 64) in 2 microbatches per rank.
Runs alternate TLS on and off (`--repeats` pairs, default 3), so drift of the machine falls on
both alike.

Record fields (one per run):

- tls: true (mutual TLS between the parts, local credentials on the trainers' sockets) or false
  (plaintext TCP between the parts, plaintext on the trainers' sockets); either way the
  trainers take their batches through shared memory beside their constructor's Unix socket;
- steps, tokens: what the trainer received (tokens: the samples' lengths, from the Parquet rows);
- seconds: from the trainer's first batch to its last;
- tokens_per_s: tokens / seconds;
- service_cpu_s_per_step: CPU time (user + system) of the planner, loaders and constructors from
  the trainer's first batch to its last, per step after the first (start-up excluded);
  trainer_cpu_s_per_step: the trainer process's whole CPU time (its start-up included), per step.

Beside the records, `summary`: per mode, the median of each figure, and the ratio TLS / off.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

import pyarrow.parquet as pq

from batchplane.bench import positive_int, working_folder
from batchplane.bench.jobs import start_trainer, write_job
from batchplane.demo.dataset import DemoSource, LogNormal, Pareto, write_demo_dataset
from batchplane.launcher.local import LocalCluster, ServiceProcess

HELP = "tokens/s and CPU per step with mutual TLS between the parts and without, side by side"
RANKS = (0, 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=positive_int, default=24000, help="rows over the four sources (default 24,000)")
    parser.add_argument("--batch", type=positive_int, default=64, help="global batch size in samples (default 64)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="pairs of runs, TLS on then off (default 3)")
    parser.add_argument("--dir", type=working_folder, default=None, help="working folder (default: a temporary one, removed after)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = pathlib.Path(tmp)
        data = write_demo_dataset(root / "data", sources=text_sources(args.rows), vocab_size=4096, seed=0)
        lengths = _lengths(data)
        records = []
        for repeat in range(args.repeats):
            for tls in (True, False):
                progress(f"run {repeat + 1} of {args.repeats}, TLS {'on' if tls else 'off'}")
                record = _run(root / f"{repeat}-{tls}", data, lengths, tls=tls, batch=args.batch)
                records.append(record)
                progress(f"  {record['tokens_per_s']:,.0f} tokens/s, {record['service_cpu_s_per_step'] * 1000:.1f} ms service CPU per step")
    summary = {}
    for tls in (True, False):
        mine = [r for r in records if r["tls"] is tls]
        summary["tls" if tls else "off"] = {
            key: round(statistics.median(r[key] for r in mine), 6)
            for key in ("tokens_per_s", "service_cpu_s_per_step", "trainer_cpu_s_per_step")
        }
    summary["tls_over_off"] = {key: round(summary["tls"][key] / summary["off"][key], 4) for key in summary["off"]}
    return {"records": records, "summary": summary, "trainer": {"ranks": len(RANKS), "global_batch_size": args.batch, "step_seconds": 0}}


def text_sources(rows: int) -> list[DemoSource]:
    """Four text sources of rows/4 rows each (at least 50), skewed lengths up to 1,024 tokens."""
    share = max(rows // 4, 50)
    return [
        DemoSource("web", "web text", share, 2, 100, (LogNormal(median=300, sigma=0.6),), min_length=8, max_length=1024),
        DemoSource("code", "code", share, 2, 100, (Pareto(minimum=64, alpha=1.1),), min_length=16, max_length=1024),
        DemoSource("chat", "chat", share, 2, 100, (LogNormal(median=48, sigma=0.5),), min_length=4, max_length=512),
        DemoSource("math", "math", share, 2, 100, (LogNormal(median=160, sigma=0.4),), min_length=8, max_length=1024),
    ]


def _lengths(data: dict[str, pathlib.Path]) -> list[list[int]]:
    """Per source (in job order), each row's token count."""
    out = []
    for path in data.values():
        rows: list[int] = []
        for f in sorted(path.glob("*.parquet")):
            column = pq.read_table(f, columns=["input_ids"]).column("input_ids")
            rows += [len(v) for v in column.to_pylist()]
        out.append(rows)
    return out


def _run(folder: pathlib.Path, data: dict[str, pathlib.Path], lengths: list[list[int]], *, tls: bool, batch: int) -> dict:
    config = write_job(
        folder, f"transport-{'tls' if tls else 'plain'}", data, ranks=len(RANKS), batch=batch, loaders={"count": 2}, network={"tls": tls}
    )
    steps_path = folder / "steps.jsonl"
    with LocalCluster(config) as cluster:
        trainer = start_trainer(cluster, RANKS, step_seconds=0, out=steps_path)
        while not (steps_path.exists() and steps_path.stat().st_size) and trainer.poll() is None:
            time.sleep(0.001)
        cpu_at_first = sum(_cpu_seconds(p) for p in cluster.processes)  # start-up excluded
        _, status, usage = os.wait4(trainer.pid, 0)
        trainer.returncode = os.waitstatus_to_exitcode(status)
        if trainer.returncode:
            raise RuntimeError(f"the trainer failed: {trainer.stdout.read().decode()[-2000:]}")
        service_cpu = sum(_cpu_seconds(p) for p in cluster.processes) - cpu_at_first
    steps = [json.loads(line) for line in steps_path.read_text().splitlines()]
    count = max(s["step"] for s in steps) + 1
    tokens = sum(lengths[source][row] for s in steps for source, row, *_ in s["samples"])
    received = [s["received"] for s in steps]
    seconds = max(received) - min(received)
    return {
        "tls": tls,
        "steps": count,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "service_cpu_s_per_step": round(service_cpu / (count - 1), 6),
        "trainer_cpu_s_per_step": round((usage.ru_utime + usage.ru_stime) / count, 6),
    }


def _cpu_seconds(process: ServiceProcess) -> float:
    """User + system CPU seconds a running service process has used (its /proc stat)."""
    fields = pathlib.Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
