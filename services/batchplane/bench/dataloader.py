"""Part B of `batchplane bench delivery`: samples/s and CPU per 1,000 samples of batchplane
against a colocated torch DataLoader, on the same Parquet data and microbatch shapes.

Data: four synthetic text sources of equal size (`demo.dataset` length distributions,
`--sample-rows` rows over the four, default 12,000), one epoch, no compute, at `--ranks` ranks
(repeatable; default 2 and 8), in each step shape `--shape GxM` (repeatable): G samples a step
over all ranks in M padded microbatches per rank. The default shapes are 64x2 (few, large
microbatches: each step's fixed costs weigh most) and 256x16 (gradient accumulation, as
trainers run it: 8 samples a microbatch at 2 ranks, 2 at 8). Runs alternate the two systems
(`--sample-repeats` pairs per rank count and shape, default 2); each record is one run,
`summarize_samples` gives the medians and ratios.

What each system pays per step and per microbatch differs, so the shape decides which is
cheaper: batchplane plans, balances and records each step once for the whole mesh (planner,
constructor, one fetch per loader), and builds every microbatch of a rank into one delivery;
the DataLoader's costs come per microbatch of each rank (a worker's `collate`, and its
tensors' trip to the rank through shared memory).

- batchplane: a job run by `LocalCluster` (planner, `--loaders` loader groups (default 2) and
  one constructor per `--ranks-per-constructor` ranks (default 8: one pod), plaintext, since
  `bench transport` measures TLS; the trainer takes its batches through shared memory beside
  its constructor's Unix socket, as in a pod) and the stand-in trainer (`batchplane.examples.timed_trainer
  --counts`, one process, its ranks as threads in lockstep, writing each step's sample count as
  the DataLoader ranks do), mesh dp = ranks.
- dataloader: one process per rank, as torchrun starts them (`batchplane.examples.dataloader_rank`, in the client package: services never import torch), each with a
  `torch.utils.data.DataLoader(num_workers=1, prefetch_factor=2, persistent_workers=True)` over
  its `ParquetTokens` (the same Parquet files read with pyarrow, all of them loaded by the worker on
  first use) and a `DistributedSampler` (seeded shuffle, drop_last), its batches the rank's
  microbatches, padded by `collate` as the constructor pads them (input_ids, labels: the next
  token, -100 on each row's last token and on padding; attention_mask; position_ids). Ranks are
  not in lockstep (no collective per step).

With `--journal`, a third system, batchplane-journal: the same job with `batch.delivery:
journal` (a producer commits every step to the journal in the run folder; each pod's constructor
reads its ranks' slices from there), its producer's CPU counted with the rest.

Record fields: system (batchplane | dataloader | batchplane-journal), ranks, global_batch,
dp_microbatches, samples, seconds, samples_per_s, cpu_s_per_1k_samples, cpu_ms_per_step,
processes. cpu_ms_per_step splits the CPU per step (global_batch samples) by part: planner,
loader (all loader groups), constructor, producer (journal delivery) and trainer for batchplane
(other: any process one of them started); rank (the rank processes) and worker (their DataLoader
workers) for the DataLoader. Times run
from the first batch to the last: batchplane's ranks are in lockstep, so from the step 0 the
first rank received; the DataLoader's ranks each wait after their first step until all have one
(start-up behind them, the workers prefetching). Samples count what arrived after each rank's
first step. CPU (user + system, from /proc) is that of every process involved over the same
window: the planner, loaders, constructors and the trainer (batchplane); the rank processes and
their DataLoader workers (dataloader).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from batchplane.bench import positive_int
from batchplane.bench.transport import text_sources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sample-rows", type=positive_int, default=12000, help="Part B: rows over the four sources (default 12,000)")
    parser.add_argument(
        "--shape",
        action="append",
        type=step_shape,
        default=None,
        metavar="GxM",
        help="Part B: G samples a step over all ranks in M microbatches per rank (repeatable; default 64x2 and 256x16)",
    )
    parser.add_argument(
        "--ranks", action="append", type=positive_int, default=None, metavar="N", help="Part B: ranks (repeatable; default 2 and 8)"
    )
    parser.add_argument(
        "--sample-repeats", type=positive_int, default=2, help="Part B: runs of each system per rank count, alternating (default 2)"
    )
    parser.add_argument("--loaders", type=positive_int, default=2, help="Part B: batchplane loader groups (default 2)")
    parser.add_argument(
        "--ranks-per-constructor", type=positive_int, default=8, help="Part B: ranks a batchplane constructor serves (default 8)"
    )
    parser.add_argument(
        "--journal", action="store_true", help="Part B: also run batchplane with journal delivery (batch.delivery: journal)"
    )


def step_shape(text: str) -> tuple[int, int]:
    """An argparse type: "GxM", G samples a step over all ranks in M microbatches per rank."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"a step shape is GxM with G, M >= 1 (e.g. 64x2), got {text!r}")
    return int(parts[0]), int(parts[1])


DEFAULT_SHAPES = ((64, 2), (256, 16))


def run_samples(args: argparse.Namespace, folder: pathlib.Path, progress: Callable[[str], None]) -> list[dict]:
    """Part B: the records, runs alternating batchplane and the DataLoader."""
    from batchplane.demo.dataset import write_demo_dataset

    grid = [(ranks, batch, microbatches) for ranks in args.ranks or (2, 8) for batch, microbatches in args.shape or DEFAULT_SHAPES]
    for ranks, batch, microbatches in grid:
        if batch % (ranks * microbatches):
            raise ValueError(
                f"--shape {batch}x{microbatches}: {batch} samples a step are not {ranks} ranks x {microbatches} whole microbatches"
            )
    data = write_demo_dataset(folder / "data", sources=text_sources(args.sample_rows), vocab_size=4096, seed=0)
    records = []
    for ranks, batch, microbatches in grid:
        for repeat in range(args.sample_repeats):
            for system in ("batchplane", "dataloader", *(["batchplane-journal"] if getattr(args, "journal", False) else [])):
                progress(f"{system}, {ranks} ranks, {batch}x{microbatches}, run {repeat + 1} of {args.sample_repeats}")
                where = folder / f"{system}-{ranks}-{batch}x{microbatches}-{repeat}"
                if system.startswith("batchplane"):
                    record = run_batchplane(
                        where,
                        data,
                        ranks=ranks,
                        batch=batch,
                        microbatches=microbatches,
                        loaders=args.loaders,
                        ranks_per_constructor=min(args.ranks_per_constructor, ranks),
                        delivery="journal" if system == "batchplane-journal" else "stream",
                    )
                else:
                    record = run_dataloader(where, data, ranks=ranks, batch=batch, microbatches=microbatches)
                records.append(record)
                progress(f"  {record['samples_per_s']:,.0f} samples/s, {record['cpu_s_per_1k_samples']:.3f} CPU s per 1,000 samples")
    return records


def summarize_samples(records: list[dict]) -> list[dict]:
    """Per rank count and step shape (in the records' order): each system's median samples/s,
    CPU s per 1,000 samples and CPU ms per step of each part, and batchplane's over the
    DataLoader's."""
    import statistics

    points: dict[tuple[int, int, int], list[dict]] = {}
    for r in records:
        if "system" in r:
            points.setdefault((r["ranks"], r["global_batch"], r["dp_microbatches"]), []).append(r)
    out = []
    for (ranks, batch, microbatches), runs in points.items():
        summary: dict = {"ranks": ranks, "global_batch": batch, "dp_microbatches": microbatches}
        for system in ("batchplane", "dataloader", "batchplane-journal"):
            mine = [r for r in runs if r["system"] == system]
            if mine:
                summary[system] = {
                    key: round(statistics.median(r[key] for r in mine), 5) for key in ("samples_per_s", "cpu_s_per_1k_samples")
                }
                parts = sorted({part for r in mine for part in r.get("cpu_ms_per_step", {})})
                if parts:
                    summary[system]["cpu_ms_per_step"] = {
                        part: round(statistics.median(r["cpu_ms_per_step"].get(part, 0.0) for r in mine), 3) for part in parts
                    }
        for system in ("batchplane", "batchplane-journal"):
            if system in summary and "dataloader" in summary:
                summary[f"{system.replace('-', '_')}_over_dataloader"] = {
                    key: round(summary[system][key] / summary["dataloader"][key], 4) for key in ("samples_per_s", "cpu_s_per_1k_samples")
                }
        out.append(summary)
    return out


# ---- the DataLoader side -------------------------------------------------------------------


def run_dataloader(folder: pathlib.Path, data: dict[str, pathlib.Path], *, ranks: int, batch: int, microbatches: int) -> dict:
    """One run of the DataLoader baseline at `ranks` ranks (see the module docstring)."""
    folder.mkdir(parents=True)
    microbatch = batch // (ranks * microbatches)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchplane.examples.dataloader_rank",
                "--rank",
                str(r),
                "--world",
                str(ranks),
                "--microbatch",
                str(microbatch),
                "--microbatches",
                str(microbatches),
                *map(str, data.values()),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(folder / f"rank-{r}.log", "wb"),
            env={**os.environ, "OMP_NUM_THREADS": "1"},  # as torchrun sets it for several processes a node
        )
        for r in range(ranks)
    ]
    try:
        lines: list[list[dict]] = [[] for _ in procs]
        first = [json.loads(p.stdout.readline() or "null") for p in procs]  # every rank's first step
        if any(f is None for f in first):
            raise RuntimeError(f"a DataLoader rank failed: {(folder / 'rank-0.log').read_text()[-2000:]}")
        cpu_at_first = tree_cpu_s([p.pid for p in procs])
        start = time.time()
        for p in procs:
            p.stdin.write(b"go\n")
            p.stdin.flush()
        for p, mine in zip(procs, lines):
            for line in p.stdout:
                if line.strip() == b"done":
                    break
                mine.append(json.loads(line))
            else:
                raise RuntimeError(f"a DataLoader rank failed: {(folder / 'rank-0.log').read_text()[-2000:]}")
        cpu_at_last = tree_cpu_s([p.pid for p in procs])
    finally:
        close_ranks(procs)
    end = max(line["received"] for mine in lines for line in mine)
    samples = sum(line["samples"] for mine in lines for line in mine)
    ranks_of = {p.pid: "rank" for p in procs}
    return _record(
        "dataloader", (ranks, batch, microbatches), samples, end - start, cpu_at_last, cpu_at_first, lambda pid: ranks_of.get(pid, "worker")
    )


# ---- the batchplane side -------------------------------------------------------------------


def run_batchplane(
    folder: pathlib.Path,
    data: dict[str, pathlib.Path],
    *,
    ranks: int,
    batch: int,
    microbatches: int,
    loaders: int,
    ranks_per_constructor: int,
    delivery: str = "stream",
) -> dict:
    """One run of a batchplane job at `ranks` ranks with the stand-in trainer (`delivery`:
    stream, or journal)."""
    from batchplane.bench.jobs import start_trainer, write_job
    from batchplane.launcher.local import LocalCluster

    config = write_job(
        folder,
        f"delivery-{ranks}",
        data,
        ranks=ranks,
        batch=batch,
        loaders={"count": loaders},
        constructors={"ranks_per_constructor": ranks_per_constructor},
        network={"tls": False},
    )
    _set_microbatches(config, microbatches, delivery=delivery)
    steps_path = folder / "steps.jsonl"
    with LocalCluster(config) as cluster:
        trainer = start_trainer(cluster, range(ranks), step_seconds=0, out=steps_path, counts=True)
        while not (steps_path.exists() and steps_path.stat().st_size) and trainer.poll() is None:
            time.sleep(0.001)
        services = [p.pid for p in cluster.processes]
        part_of = {p.pid: p.name.split("-")[0] for p in cluster.processes}
        part_of[trainer.pid] = "trainer"
        cpu_at_first = tree_cpu_s([*services, trainer.pid])
        trainer_at_first = cpu_at_first.get(trainer.pid, 0.0)
        _, status, usage = os.wait4(trainer.pid, 0)
        trainer.returncode = os.waitstatus_to_exitcode(status)
        if trainer.returncode:
            raise RuntimeError(f"the trainer failed: {trainer.stdout.read().decode()[-2000:]}")
        cpu_at_last = tree_cpu_s(services)
    cpu_at_last[trainer.pid] = usage.ru_utime + usage.ru_stime  # its whole life; minus its CPU at the first batch
    cpu_at_first[trainer.pid] = trainer_at_first
    steps = [json.loads(line) for line in steps_path.read_text().splitlines()]
    first = {}
    for s in steps:
        first.setdefault(s["rank"], s)
    start = min(s["received"] for s in first.values())
    end = max(s["received"] for s in steps)
    samples = sum(s["samples"] for s in steps) - sum(s["samples"] for s in first.values())
    system = "batchplane" if delivery == "stream" else f"batchplane-{delivery}"
    return _record(
        system, (ranks, batch, microbatches), samples, end - start, cpu_at_last, cpu_at_first, lambda pid: part_of.get(pid, "other")
    )


def _set_microbatches(config: pathlib.Path, microbatches: int, *, delivery: str = "stream") -> None:
    import yaml

    job = yaml.safe_load(config.read_text())
    job["batch"]["microbatches"] = microbatches
    job["batch"]["delivery"] = delivery
    config.write_text(yaml.safe_dump(job))


def _record(
    system: str,
    shape: tuple[int, int, int],
    samples: int,
    seconds: float,
    cpu_at_last: dict[int, float],
    cpu_at_first: dict[int, float],
    part_of: Callable[[int], str],
) -> dict:
    """One run's record; `shape`: (ranks, samples a step, microbatches per rank); `part_of`
    names the part each process is (planner, loader, ...), for `cpu_ms_per_step`."""
    ranks, batch, microbatches = shape
    steps = samples / batch
    by_part: dict[str, float] = {}
    for pid, value in cpu_at_last.items():
        part = part_of(pid)
        by_part[part] = by_part.get(part, 0.0) + value - cpu_at_first.get(pid, 0.0)
    cpu = sum(by_part.values())
    return {
        "system": system,
        "ranks": ranks,
        "global_batch": batch,
        "dp_microbatches": microbatches,
        "samples": samples,
        "seconds": round(seconds, 4),
        "samples_per_s": round(samples / seconds, 1),
        "cpu_s_per_1k_samples": round(cpu / samples * 1000, 5),
        "cpu_ms_per_step": {part: round(value / steps * 1000, 3) for part, value in sorted(by_part.items())},
        "processes": len(cpu_at_last),
    }


def close_ranks(procs: Sequence[subprocess.Popen]) -> None:
    """Closes each rank process's stdin (its signal to exit) and waits for it; one that does not
    exit within 30 s is killed."""
    for p in procs:
        if p.poll() is None:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def tree_cpu_s(pids: Sequence[int]) -> dict[int, float]:
    """User + system CPU seconds of each live process in the trees under `pids` (the processes
    and all their descendants), from /proc."""
    parent_of: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        parent_of[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    wanted = set(pids)
    grew = True
    while grew:
        more = {pid for pid, parent in parent_of.items() if parent in wanted} - wanted
        wanted |= more
        grew = bool(more)
    return {pid: cpu[pid] for pid in wanted if pid in cpu}
