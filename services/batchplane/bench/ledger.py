"""`batchplane bench ledger`: the durable ledger's size per 10,000 steps, and what writing,
compacting and reading it costs.

For every configuration `--config DP:BATCH:SOURCES` (default 2:32:2, 8:256:4 and 64:2048:8),
the planner's path from allocation to durable record runs for N = `--steps` steps (default
10,000), in process, on a `LocalStorage` in a fresh temporary folder (under `--dir`, default
the system's):

- the mixture: `Static` weights K - k over K = SOURCES endless sources, BATCH samples a step;
- the samples: each source is `--rows` rows (default 10,000,000) in row groups of 10,000,
  consumed in the loaders' order (`SampleOrder`, seed `--seed`, windows of 4 row groups: the
  configuration's default), so the rows a record names are as scattered as a job's; lengths
  lognormal (median e^6.5, about 665 tokens), at most 8,192, and digests (64 random bits, as a
  loader's `core.digest` looks), drawn per step from
  `numpy.random.default_rng([seed, dp, batch, sources, step])`;
- the plan: `default_strategy` with `--method` (default greedy), `--microbatches` (default 4)
  microbatches per rank, quadratic cost, over a mesh of DP data-parallel ranks. The method only
  decides which samples share a microbatch, not how many there are: measured on 8:256:4 over
  1,000 steps, karmarkar_karp (the job's default) and greedy segments differ by 0.01% in size,
  round_robin by 0.4%, while karmarkar_karp plans over ten times slower (30 ms a step against 2 ms at
  64:2048:8), which would dominate the run without changing a ledger figure;
- the record: `Ledger.record(allocation, plan, after)`, written with `LedgerWriter.append`;
  after step s, `compact(s - lag)` (`--lag`, default 8: the slowest rank is that many steps
  behind, as the plan book compacts below the slowest constructor); after the last step,
  `compact(steps written)`: every rank is past it, so the last whole segment folds too. With
  `--keep-detail-steps D` the writer thins the segments further than D steps behind (the job's
  `ledger.keep_detail_steps`; default: none, every sample kept, as a job keeps them by default).

A configuration that has run longer than `--budget-s` seconds (default 5) stops at the next
multiple of `journal.SEGMENT_STEPS` steps (1,000), so it always writes at least one segment, and
its per-10,000-step figures are extrapolated from the steps it wrote (linear: every segment
holds the same number of steps of the same shape).

Record fields:

- dp, batch, sources, microbatches, keep_detail_steps;
- steps_written; extrapolated: steps_written != 10,000, so bytes_per_10k_steps is scaled;
- records: steps a fresh `LedgerReader` finds; segments: segments written;
- step_json_bytes_per_step: mean size of a step's JSON record as written (before compaction);
- bytes_after_compaction: bytes of every object of the ledger folder after the last
  compaction (head, segments and the step records of a last partial segment);
  disk_bytes_after_compaction: what the folder's files occupy on disk (allocated blocks);
- bytes_per_10k_steps: bytes_after_compaction * 10,000 / steps_written;
- segment_bytes_per_step: bytes of the segments over the steps they hold (None without one);
  compaction_ratio: step_json_bytes_per_step / segment_bytes_per_step;
- record_ms_mean: `Ledger.record` per step; write_ms_mean, write_ms_p99: `LedgerWriter.append`
  per step (encoding and the durable, fsynced write);
- compaction_s: all `compact` calls together; compaction_ms_per_segment: that per segment;
- open_reader_ms: opening a `LedgerReader` on the storage; read_record_ms: then reading one
  record (a lineage lookup: step SEGMENT_STEPS // 2, from the first segment when there is one,
  which lists the generation and decompresses its segment); read_ok: that record equals the
  one written (without its detail fields when segments are thinned);
- seconds: the configuration's wall time, planning included.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import tempfile
import time
from collections.abc import Callable

import numpy as np

from batchplane.bench import positive_int, working_folder
from batchplane.core.mesh import ClientPlaceTree
from batchplane.core.storage import LocalStorage
from batchplane.core.order import SampleOrder, Window
from batchplane.planner import journal
from batchplane.planner.balance import METHODS
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.dgraph import default_strategy
from batchplane.planner.ledger import Ledger
from batchplane.planner.mixture import Mixture, MixtureState
from batchplane.planner.plan import SampleTable
from batchplane.core.schedule import Static

HELP = "durable ledger bytes per 10,000 steps, write, compaction and lookup times, by mesh and batch"

#: (dp, batch, sources) of the default configurations.
CONFIGS = ((2, 32, 2), (8, 256, 4), (64, 2048, 8))
#: The step count the size is reported per.
PER_STEPS = 10_000
ROW_GROUP_ROWS = 10_000
WINDOW_ROW_GROUPS = 4
CONTEXT = 8192


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured configuration."""

    dp: int
    batch: int
    sources: int


def parse_config(text: str) -> Config:
    """An argparse type: "DP:BATCH:SOURCES", three integers >= 1."""
    parts = text.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"want DP:BATCH:SOURCES, three integers >= 1, got {text!r}")
    return Config(*values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's flags.

    Args:
        parser: The benchmark's argument parser.
    """
    default = ", ".join(f"{dp}:{b}:{k}" for dp, b, k in CONFIGS)
    parser.add_argument(
        "--config",
        action="append",
        type=parse_config,
        default=None,
        metavar="DP:BATCH:SOURCES",
        help=f"a configuration (repeatable; default {default})",
    )
    parser.add_argument("--steps", type=positive_int, default=PER_STEPS, help="steps per configuration (default 10,000)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=5.0,
        help="seconds after which a configuration stops at the next whole segment and extrapolates (default 5)",
    )
    parser.add_argument("--microbatches", type=positive_int, default=4, help="microbatches per rank (default 4)")
    parser.add_argument("--method", choices=METHODS, default="greedy", help="balancing method (default greedy)")
    parser.add_argument("--lag", type=int, default=8, help="steps the slowest rank is behind when compacting (default 8)")
    parser.add_argument("--rows", type=positive_int, default=10_000_000, help="rows per source (default 10,000,000)")
    parser.add_argument(
        "--keep-detail-steps",
        type=int,
        default=None,
        metavar="D",
        help="thin segments further than D steps behind the slowest rank (default: keep every sample)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the orders and lengths (default 0)")
    parser.add_argument("--dir", type=working_folder, default=None, help="where the temporary ledger folders go (default: the system's)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    """Runs every configuration.

    Args:
        args: Parsed flags (see `add_arguments`).
        progress: Called at every segment and once per configuration.
    Returns:
        {"benchmark", "steps", "budget_s", "microbatches", "method", "lag", "rows",
        "segment_steps", "directory", "records"}.
    Raises:
        ValueError: a budget that is not a number > 0, a lag < 0 or a --keep-detail-steps < 0.
    """
    if not args.budget_s > 0:
        raise ValueError(f"--budget-s must be > 0, got {args.budget_s}")
    if args.lag < 0:
        raise ValueError(f"--lag must be >= 0, got {args.lag}")
    if args.keep_detail_steps is not None and args.keep_detail_steps < 0:
        raise ValueError(f"--keep-detail-steps must be >= 0, got {args.keep_detail_steps}")
    configs = list(dict.fromkeys(args.config or [Config(*c) for c in CONFIGS]))
    directory = args.dir if args.dir is not None else pathlib.Path(tempfile.gettempdir())
    records = []
    for config in configs:
        with tempfile.TemporaryDirectory(prefix="batchplane-bench-ledger-", dir=directory) as folder:
            records.append(_measure(config, pathlib.Path(folder), args, progress))
        r = records[-1]
        progress(
            f"ledger: dp {config.dp}, batch {config.batch}, {config.sources} sources done: {r['steps_written']} steps, "
            f"{r['bytes_per_10k_steps'] / 1e6:.1f} MB per {PER_STEPS} steps, {r['seconds']:.1f} s"
        )
    return {
        "benchmark": "ledger",
        "steps": args.steps,
        "budget_s": args.budget_s,
        "microbatches": args.microbatches,
        "method": args.method,
        "lag": args.lag,
        "keep_detail_steps": args.keep_detail_steps,
        "rows": args.rows,
        "segment_steps": journal.SEGMENT_STEPS,
        "directory": str(directory),
        "records": records,
    }


class _Rows:
    """The rows at a source's seqs, in the loaders' order, one window at a time."""

    def __init__(self, order: SampleOrder) -> None:
        self.order = order
        self._epoch = -1
        self._window = Window(index=-1, row_groups=(), start=0, size=0)
        self._rows = np.zeros(0, np.int64)

    def at(self, start: int, count: int) -> np.ndarray:
        """int64 rows of seqs start .. start + count - 1."""
        parts, seq, end = [], start, start + count
        while seq < end:
            epoch, position = divmod(seq, self.order.num_rows)
            window = self._window
            if epoch != self._epoch or not window.start <= position < window.start + window.size:
                window = self.order.window_at(epoch, position)
                self._epoch, self._window, self._rows = epoch, window, self.order.window_rows(epoch, window)
            take = min(end - seq, window.start + window.size - position)
            parts.append(self._rows[position - window.start : position - window.start + take])
            seq += take
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _measure(config: Config, folder: pathlib.Path, args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    """Writes, compacts and reads one configuration's ledger in `folder`; its record."""
    begin = time.perf_counter()
    segment_steps = journal.SEGMENT_STEPS
    k = config.sources
    names = tuple(f"source{i}" for i in range(k))
    sizes = [ROW_GROUP_ROWS] * (args.rows // ROW_GROUP_ROWS) + ([args.rows % ROW_GROUP_ROWS] if args.rows % ROW_GROUP_ROWS else [])
    rows = [_Rows(SampleOrder(sizes, seed=args.seed, source_name=n, window_row_groups=WINDOW_ROW_GROUPS)) for n in names]
    mixture = Mixture(Static(tuple(float(k - i) for i in range(k))), global_batch_size=config.batch, stream_ends=[None] * k)
    cost = make_cost_fn("quadratic")
    strategy = default_strategy(method=args.method, microbatches=args.microbatches, cost_fn=cost)
    mesh = ClientPlaceTree(dp=config.dp)
    storage = LocalStorage(folder)
    fingerprints = {"data": f"{args.seed:016x}", "mixture": "0" * 16, "topology": f"{config.dp:016x}", "batching": f"{config.batch:016x}"}
    writer = journal.LedgerWriter(
        journal.LedgerReader(storage), start_step=0, fingerprints=fingerprints, sources=names, keep_detail_steps=args.keep_detail_steps
    )
    ledger = Ledger(names, method=args.method)
    probe = segment_steps // 2 if args.steps >= segment_steps else args.steps // 2
    probe_record = None
    record_s, write_s, compaction_s = [], [], 0.0
    state = MixtureState.initial(k)
    steps = 0
    while steps < args.steps:
        step = steps
        allocation, after = mixture.allocate(state)
        rng = np.random.default_rng([args.seed, config.dp, config.batch, k, step])
        table = SampleTable.concat(
            [
                SampleTable(
                    source=np.full(count, i, np.int32),
                    seq=np.arange(start, start + count, dtype=np.int64),
                    row=rows[i].at(start, count),
                    length=np.minimum(np.rint(rng.lognormal(6.5, 1.0, count)) + 1, CONTEXT).astype(np.int32),
                    epoch=(np.arange(start, start + count) // args.rows).astype(np.int32),
                    digest=rng.integers(-(2**63), 2**63 - 1, count, dtype=np.int64),
                )
                for i, (start, count) in enumerate(zip(allocation.starts, allocation.counts))
                if count
            ]
        )
        plan = strategy.run(step, table, mesh, default_cost=cost)
        t0 = time.perf_counter()
        record = ledger.record(allocation, plan, after)
        t1 = time.perf_counter()
        writer.append([record])
        t2 = time.perf_counter()
        writer.compact(step - args.lag)
        compaction_s += time.perf_counter() - t2
        record_s.append(t1 - t0)
        write_s.append(t2 - t1)
        if step == probe:
            probe_record = json.loads(json.dumps(record))
        state, steps = after, steps + 1
        if steps % segment_steps == 0:
            progress(f"ledger: dp {config.dp}, batch {config.batch}, {k} sources: {steps} steps written")
            if time.perf_counter() - begin > args.budget_s:
                break
    t0 = time.perf_counter()
    writer.compact(steps)
    compaction_s += time.perf_counter() - t0
    keys = storage.list("gen-")
    segments = [key for key in keys if "/segments/" in key]
    segment_bytes = sum(len(storage.get(key)) for key in segments)
    apparent, allocated = _folder_bytes(folder)
    t0 = time.perf_counter()
    reader = journal.LedgerReader(storage)
    t1 = time.perf_counter()
    read = reader.record(probe)
    t2 = time.perf_counter()
    last = reader.last_step()
    found = 0 if last is None else sum(reader.owner(s) is not None for s in range(last + 1))
    if read is not None and args.keep_detail_steps is not None and "ranks" not in read:
        probe_record = {key: value for key, value in probe_record.items() if key not in journal.DETAIL_FIELDS}
    step_json = writer.bytes_written / steps
    per_segment_step = segment_bytes / (len(segments) * segment_steps) if segments else None
    return {
        "dp": config.dp,
        "batch": config.batch,
        "sources": k,
        "microbatches": args.microbatches,
        "keep_detail_steps": args.keep_detail_steps,
        "steps_written": steps,
        "extrapolated": steps != PER_STEPS,
        "records": found,
        "segments": len(segments),
        "step_json_bytes_per_step": step_json,
        "bytes_after_compaction": apparent,
        "disk_bytes_after_compaction": allocated,
        "bytes_per_10k_steps": apparent * PER_STEPS / steps,
        "segment_bytes_per_step": per_segment_step,
        "compaction_ratio": step_json / per_segment_step if per_segment_step else None,
        "record_ms_mean": 1e3 * float(np.mean(record_s)),
        "write_ms_mean": 1e3 * float(np.mean(write_s)),
        "write_ms_p99": 1e3 * float(np.percentile(write_s, 99)),
        "compaction_s": compaction_s,
        "compaction_ms_per_segment": 1e3 * compaction_s / len(segments) if segments else None,
        "open_reader_ms": 1e3 * (t1 - t0),
        "read_record_ms": 1e3 * (t2 - t1),
        "read_ok": read is not None and read == probe_record,
        "seconds": time.perf_counter() - begin,
    }


def _folder_bytes(folder: pathlib.Path) -> tuple[int, int]:
    """(sum of the files' sizes, bytes their blocks occupy) under `folder`."""
    apparent = allocated = 0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            st = os.stat(os.path.join(dirpath, name))
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated
