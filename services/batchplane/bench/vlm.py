"""`batchplane bench vlm`: the vision-language demo path against a colocated torch DataLoader
doing the same JPEG decode and patchify in each rank (issue 17, point 5): samples per second,
the trainer's data wait and memory per rank.

Data: the demo's image-text source (`--image-rows`, default 1,500: 0 to 4 JPEGs a sample at mixed
resolutions) and one text source (`--text-rows`, default 1,500, chat-like lengths), one epoch,
`--global-batch` samples a step (default 32) in 2 microbatches per rank, at `--ranks` ranks
(default 2). Every rank is one process (`batchplane.examples.vlm_rank`, in the client package:
services never import torch) that waits for its batch, reads every pixel byte it got, then spends
`--step-seconds` (default 0.05) on its "forward and backward"; ranks are not in lockstep (no
collective per step) in either system.

- batchplane: a job run by `LocalCluster` with the image source's transform
  `batchplane.demo.images:image_text` (`pixels: true`), `batch.payload` = `demo.images.PAYLOAD`,
  the strategy `examples/strategies/vlm.py` (`--strategy`; each rank receives the pixels of the
  images it encodes), the sources weighted by their rows (as a uniform shuffle mixes them),
  dp = ranks, one constructor for all ranks (one pod), loader groups by default (here one per
  source: the image source's transform runs in one loader process), and `network.tls` on, so
  the constructor serves the trainers on a Unix socket with shared-memory slabs beside it (the
  record's `transport` says what the ranks got; shared slab pages count in the RSS of both the
  constructor and the rank, once in PSS).
- dataloader: `torch.utils.data.DataLoader(num_workers=W, prefetch_factor=2,
  persistent_workers=True)` per rank for each W of `--workers` (repeatable; default 1 and 2)
  over the same Parquet rows, sharded by a seeded `DistributedSampler`; each worker runs the same
  transform (imported by name) on its microbatch's image rows and pads and concatenates as the
  constructor does.

Runs alternate the systems (`--repeats` rounds, default 3; about a minute and a half on 2
cores). Each run's times go from the moment every rank has its first step (the start-up behind
it; batchplane's constructor and the DataLoader's workers prefetch meanwhile) to the last step
received.

Record fields: system (batchplane | dataloader), workers (the DataLoader's; null for
batchplane), ranks, samples (received after each rank's first step), steps, images, seconds,
samples_per_s, data_wait_s_per_step_mean and data_wait_s_per_step_p95 (time a rank was blocked
on its next batch, over every rank's steps after its first), cpu_s_per_1k_samples (user + system
of every process involved over the window: the ranks and their DataLoader workers; the ranks,
planner, loaders and constructor), rss_mb_per_rank and pss_mb_per_rank (the peak, sampled every
`--memory-interval-s`, of each rank's process tree, averaged over ranks; for batchplane, the
rank's (`trainer_rss_mb_per_rank`) plus the services' total over the ranks
(`services_rss_mb_per_rank`): RSS counts the pages forked DataLoader workers share with their
rank once per process, PSS splits them), processes, transport (batchplane: "shm" or "grpc" as
the ranks' client reports it; null for the DataLoader). `summary` holds, per system and worker
count, the medians of the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import yaml

from batchplane.bench import positive_int, working_folder
from batchplane.bench.dataloader import close_ranks, tree_cpu_s

HELP = "samples/s, data wait and memory per rank of the vision-language demo path against a colocated DataLoader doing the same JPEG decode (1 and 2 workers)"

#: The demo's image-text transform, as a job names it and the DataLoader ranks import it.
TRANSFORM = "batchplane.demo.images:image_text"
TRANSFORM_ARGS = {"pixels": True}
#: The example vision-language strategy, in the repository beside the services.
STRATEGY = pathlib.Path(__file__).resolve().parents[3] / "examples" / "strategies" / "vlm.py"
MIB = 1 << 20
#: Summary keys: the medians of these record fields.
SUMMARY_FIELDS = (
    "samples_per_s",
    "data_wait_s_per_step_mean",
    "data_wait_s_per_step_p95",
    "cpu_s_per_1k_samples",
    "rss_mb_per_rank",
    "pss_mb_per_rank",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image-rows", type=positive_int, default=1500, help="rows of the image-text source (default 1,500)")
    parser.add_argument("--text-rows", type=positive_int, default=1500, help="rows of the text source (default 1,500)")
    parser.add_argument("--global-batch", type=positive_int, default=32, help="samples a step over all ranks (default 32)")
    parser.add_argument("--ranks", type=positive_int, default=2, help="data-parallel ranks, one process each (default 2)")
    parser.add_argument(
        "--workers",
        action="append",
        type=positive_int,
        default=None,
        metavar="W",
        help="DataLoader workers per rank (repeatable; default 1 and 2)",
    )
    parser.add_argument("--step-seconds", type=float, default=0.05, help="each rank's compute per step, seconds (default 0.05)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds, the systems alternating (default 3)")
    parser.add_argument("--memory-interval-s", type=float, default=0.2, help="how often memory is sampled, seconds (default 0.2)")
    parser.add_argument(
        "--strategy", default=str(STRATEGY), help="the vision-language strategy file (default: the repository's examples/strategies/vlm.py)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data (default 0)")
    parser.add_argument("--dir", type=working_folder, default=None, help="working folder (default: a temporary one, removed after)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    microbatch, rest = divmod(args.global_batch, args.ranks * 2)
    if rest or not microbatch:
        raise ValueError(f"--global-batch {args.global_batch} must be a positive multiple of 2 x --ranks = {2 * args.ranks}")
    if not pathlib.Path(args.strategy).is_file():
        raise ValueError(f"--strategy {args.strategy}: no such file")
    workers = args.workers or [1, 2]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = pathlib.Path(tmp)
        data = write_data(folder / "data", image_rows=args.image_rows, text_rows=args.text_rows, seed=args.seed)
        records = []
        for repeat in range(args.repeats):
            for system in ("batchplane", *(f"dataloader-{w}" for w in workers)):
                progress(f"{system}, {args.ranks} ranks, round {repeat + 1} of {args.repeats}")
                where = folder / f"{system}-{repeat}"
                if system == "batchplane":
                    record = run_batchplane(
                        where,
                        data,
                        ranks=args.ranks,
                        batch=args.global_batch,
                        step_seconds=args.step_seconds,
                        strategy=pathlib.Path(args.strategy),
                        memory_interval_s=args.memory_interval_s,
                    )
                    if record["transport"] != "shm":
                        progress(f"  the ranks got their batches over {record['transport']}, not shared memory")
                else:
                    record = run_dataloader(
                        where,
                        data,
                        ranks=args.ranks,
                        workers=int(system.split("-")[1]),
                        microbatch=microbatch,
                        step_seconds=args.step_seconds,
                        memory_interval_s=args.memory_interval_s,
                    )
                records.append(record)
                progress(
                    f"  {record['samples_per_s']:,.1f} samples/s, data wait {record['data_wait_s_per_step_mean'] * 1000:.1f} ms/step "
                    f"(p95 {record['data_wait_s_per_step_p95'] * 1000:.1f}), {record['rss_mb_per_rank']:.0f} MB RSS per rank, "
                    f"{record['cpu_s_per_1k_samples']:.2f} CPU s per 1,000 samples"
                )
    return {
        "records": records,
        "summary": summarize(records),
        "settings": {
            "image_rows": args.image_rows,
            "text_rows": args.text_rows,
            "global_batch": args.global_batch,
            "ranks": args.ranks,
            "step_seconds": args.step_seconds,
            "repeats": args.repeats,
            "cpus": os.cpu_count(),
        },
    }


def write_data(folder: pathlib.Path, *, image_rows: int, text_rows: int, seed: int) -> dict[str, pathlib.Path]:
    """The demo image-text source ("images") and one text source ("chat") under `folder`."""
    from batchplane.demo.dataset import DemoSource, ImageTextSource, LogNormal, write_demo_dataset

    return write_demo_dataset(
        folder,
        sources=[
            ImageTextSource("images", "image-text", image_rows, 2, 100),
            DemoSource("chat", "chat", text_rows, 2, 100, (LogNormal(median=48, sigma=0.5),), min_length=4, max_length=512),
        ],
        vocab_size=1024,
        seed=seed,
    )


def summarize(records: Sequence[dict]) -> dict:
    """Per system ("batchplane", "dataloader_w1", ...): the runs' medians of `SUMMARY_FIELDS`."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["system"] if r["workers"] is None else f"{r['system']}_w{r['workers']}", []).append(r)
    return {
        name: {"runs": len(runs), **{key: round(statistics.median(r[key] for r in runs), 5) for key in SUMMARY_FIELDS}}
        for name, runs in groups.items()
    }


# ---- the two systems -----------------------------------------------------------------------


def run_dataloader(
    folder: pathlib.Path,
    data: dict[str, pathlib.Path],
    *,
    ranks: int,
    workers: int,
    microbatch: int,
    step_seconds: float,
    memory_interval_s: float = 0.2,
) -> dict:
    """One run of the DataLoader ranks (see the module docstring)."""
    folder.mkdir(parents=True)
    commands = [
        [
            "--system",
            "dataloader",
            "--rank",
            str(r),
            "--world",
            str(ranks),
            "--microbatch",
            str(microbatch),
            "--microbatches",
            "2",
            "--workers",
            str(workers),
            "--step-seconds",
            str(step_seconds),
            "--images",
            str(data["images"]),
            "--text",
            str(data["chat"]),
            "--transform",
            TRANSFORM,
            "--transform-args",
            json.dumps(TRANSFORM_ARGS),
        ]
        for r in range(ranks)
    ]
    record = _drive(folder, commands, env={}, services=[], memory_interval_s=memory_interval_s)
    return {"system": "dataloader", "workers": workers, **record, "transport": None}


def run_batchplane(
    folder: pathlib.Path,
    data: dict[str, pathlib.Path],
    *,
    ranks: int,
    batch: int,
    step_seconds: float,
    strategy: pathlib.Path = STRATEGY,
    memory_interval_s: float = 0.2,
) -> dict:
    """One run of a batchplane job with one rank process per rank (see the module docstring)."""
    from batchplane.demo.images import IMAGE_TOKEN_ID, PAYLOAD
    from batchplane.launcher.local import LocalCluster

    folder.mkdir(parents=True)
    config = folder / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "job": f"vlm-{ranks}",
                "run_dir": str(folder / "run"),
                "seed": 0,
                "epochs": 1,
                "strategy": str(strategy),
                "sources": [
                    {
                        "name": "images",
                        "path": str(data["images"]),
                        "transform": TRANSFORM,
                        "columns": ["caption", "images"],
                        "transform_args": {"patch": 14, "max_side": 448, "image_token_id": IMAGE_TOKEN_ID, **TRANSFORM_ARGS},
                    },
                    {"name": "chat", "path": str(data["chat"])},
                ],
                "mixture": {
                    "weights": {name: _rows(path) for name, path in data.items()}
                },  # as the DataLoader's uniform shuffle mixes them
                "mesh": {"dp": ranks},
                "batch": {"global_batch_size": batch, "microbatches": 2, "payload": [dict(c) for c in PAYLOAD]},
                "constructors": {"ranks_per_constructor": ranks},
                "network": {"tls": True},
            }
        )
    )
    with LocalCluster(config) as cluster:
        commands = [["--system", "batchplane", "--rank", str(r), "--step-seconds", str(step_seconds)] for r in range(ranks)]
        record = _drive(
            folder,
            commands,
            env={"BATCHPLANE_ENDPOINTS": str(cluster.endpoints_path)},
            services=[p.pid for p in cluster.processes],
            memory_interval_s=memory_interval_s,
        )
    return {"system": "batchplane", "workers": None, **record}


def _rows(folder: pathlib.Path) -> int:
    """Rows of a source's Parquet files, from their footers."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in folder.glob("*.parquet"))


# ---- driving the ranks ---------------------------------------------------------------------


def _drive(folder: pathlib.Path, commands: list[list[str]], *, env: dict[str, str], services: list[int], memory_interval_s: float) -> dict:
    """Starts one `vlm_rank` process per command, releases them once each has its first step,
    reads their steps, and measures CPU over that window and memory throughout."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "batchplane.examples.vlm_rank", *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(folder / f"rank-{r}.log", "wb"),
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},  # as torchrun sets it for several processes a node
        )
        for r, command in enumerate(commands)
    ]
    memory = MemorySampler([p.pid for p in procs], services, interval_s=memory_interval_s).start()
    try:
        first = [_line(p, folder, r) for r, p in enumerate(procs)]  # every rank's first step
        ranks_and_services = [*(p.pid for p in procs), *services]
        cpu_at_first = tree_cpu_s(ranks_and_services)
        start = time.time()
        for p in procs:
            p.stdin.write(b"go\n")
            p.stdin.flush()
        steps: list[list[dict]] = [[] for _ in procs]
        transports = []
        for r, (p, mine) in enumerate(zip(procs, steps)):
            while "done" not in (line := _line(p, folder, r)):
                mine.append(line)
            transports.append(line["transport"])
        cpu_at_last = tree_cpu_s(ranks_and_services)
    finally:
        memory.stop()
        close_ranks(procs)
    after = [s for mine in steps for s in mine]
    if not after:
        raise RuntimeError("the ranks received no step after their first: more data or a smaller --global-batch is needed")
    samples = sum(s["samples"] for s in after)
    seconds = max(s["received"] for s in after) - start
    waits = sorted(s["wait_s"] for s in after)
    cpu = sum(value - cpu_at_first.get(pid, 0.0) for pid, value in cpu_at_last.items())
    peaks = memory.peaks()
    record = {
        "ranks": len(procs),
        "samples": samples,
        "steps": len(after) + len(first),
        "images": sum(s["images"] for s in [*first, *after]),
        "seconds": round(seconds, 4),
        "samples_per_s": round(samples / seconds, 2),
        "data_wait_s_per_step_mean": round(statistics.fmean(waits), 5),
        "data_wait_s_per_step_p95": round(waits[min(len(waits) - 1, int(0.95 * len(waits)))], 5),
        "cpu_s_per_1k_samples": round(cpu / samples * 1000, 4),
        "processes": len(cpu_at_last),
    }
    per_rank = {key: statistics.fmean(peak[key] for peak in peaks["ranks"]) / MIB for key in ("rss", "pss")}
    if services:
        shared = {key: peaks["services"][key] / len(procs) / MIB for key in ("rss", "pss")}
        record.update(
            {
                "rss_mb_per_rank": round(per_rank["rss"] + shared["rss"], 1),
                "pss_mb_per_rank": round(per_rank["pss"] + shared["pss"], 1),
                "trainer_rss_mb_per_rank": round(per_rank["rss"], 1),
                "services_rss_mb_per_rank": round(shared["rss"], 1),
                "transport": transports[0] if len(set(transports)) == 1 else ",".join(map(str, transports)),
            }
        )
    else:
        record.update({"rss_mb_per_rank": round(per_rank["rss"], 1), "pss_mb_per_rank": round(per_rank["pss"], 1)})
    return record


def _line(proc: subprocess.Popen, folder: pathlib.Path, rank: int) -> dict:
    """The next JSON line of a rank; raises with its log when it ended instead."""
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"rank {rank} ended (exit {proc.returncode}): {(folder / f'rank-{rank}.log').read_text()[-2000:]}")
    return json.loads(line)


class MemorySampler:
    """Samples, every `interval_s` in a thread, the RSS and PSS (bytes, from /proc) of each rank's
    process tree and of all the services' trees together, keeping the peak of each."""

    def __init__(self, ranks: Sequence[int], services: Sequence[int], *, interval_s: float) -> None:
        self._ranks, self._services, self._interval_s = list(ranks), list(services), interval_s
        self._peaks = {"ranks": [{"rss": 0, "pss": 0} for _ in self._ranks], "services": {"rss": 0, "pss": 0}}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def peaks(self) -> dict:
        """{"ranks": [{"rss", "pss"} per rank], "services": {"rss", "pss"}}, bytes."""
        return self._peaks

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stopped.wait(self._interval_s):
                return

    def sample(self) -> None:
        """One sample: each tree's memory now, raising the peaks."""
        children = _children()
        for peak, pid in zip(self._peaks["ranks"], self._ranks):
            _raise(peak, tree_memory(pid, children))
        if self._services:
            total = {"rss": 0, "pss": 0}
            for pid in self._services:
                for key, value in tree_memory(pid, children).items():
                    total[key] += value
            _raise(self._peaks["services"], total)


def _raise(peak: dict[str, int], now: dict[str, int]) -> None:
    for key, value in now.items():
        peak[key] = max(peak[key], value)


def _children() -> dict[int, list[int]]:
    """Every live process's children, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            out.setdefault(parent, []).append(int(entry.name))
    return out


def tree_memory(pid: int, children: dict[int, list[int]] | None = None) -> dict[str, int]:
    """RSS and PSS in bytes of process `pid` and all its descendants (0 for those gone)."""
    children = _children() if children is None else children
    total = {"rss": 0, "pss": 0}
    todo = [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, ()))
        try:
            text = pathlib.Path(f"/proc/{current}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name in ("Rss", "Pss"):
                total[name.lower()] += int(value.split()[0]) * 1024
    return total
