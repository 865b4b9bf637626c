"""Profiling a job's sources for the partitioner (`batchplane profile`).

For each source of a job, on a sample of its first rows, this measures what
`batchplane.operator.partition` needs: the memory of the source's file-access state (per
source and per file), the decode and transform time per sample (mean and 95th percentile), the
decoded bytes, buffered bytes and tokens per sample, and the row count. It opens sources and
runs transforms exactly as a loader does (`ParquetSource`, `bind_transform`), local or remote
(s3://, gs://, ...: `batchplane.loader.filesystems`, with the same environment), so a source
that a loader would refuse fails here with the same `SourceError` or `ConfigError`, naming the
source and the file.

How state memory is measured, and why: a source's file-access state is its open Parquet files,
and nearly all of it is the C++ side of each file's reader (the decoded footer: schema, row
group and column chunk metadata, statistics), which pyarrow allocates with the C library's
malloc, not from Arrow's memory pool and not through Python. So `pyarrow.total_allocated_bytes()`
misses it (its delta is 0: the footer buffer is freed after decoding), `tracemalloc` sees only the
Python wrappers (8 KiB of the 2.6 MB a file with a 330 KB footer keeps), and the resident set
size moves in pages and arena steps (0 for most small files, then megabytes at once). What is
counted instead is the malloc heap's bytes in use (glibc's `mallinfo2()`: `uordblks + hblkhd`,
over all arenas) plus Arrow's pool where it is a separate allocator (mimalloc or jemalloc),
before and after opening each file, with garbage collection held off: exact to the byte for
what the reader keeps, whatever the page size. Checked against the resident set's growth over
2,000 readers of one file: 2.625 vs 2.633 MB per reader for that footer; for a 16 KiB state,
21 KiB of resident memory, the rest being the wrappers counted below. The Python objects a loader keeps per source (its row-group index, the file list,
the handles' wrappers, mostly small blocks that Python serves from its own arenas) are added
from `tracemalloc` around building the `ParquetSource`. Where `mallinfo2` does not exist (not
glibc, or glibc < 2.33) the resident set size is used instead and `state_method` says so.
Not counted: per-read scratch (a few KiB per handle after its first read, which the sample read
would only blur) and the read-ahead buffer, which `buffer_bytes_per_sample` sizes.

No grpc and no server: this runs in the `batchplane profile` process.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchplane.core.config import JobSettings, SourceSettings
from batchplane.core.errors import SourceError
from batchplane.loader.source import ParquetSource
from batchplane.loader.transforms import BoundTransform, TransformOutput, bind_transform, lengths_of

#: Called as progress(source name, stage, done, total); stage is "open", "read", "transform"
#: or "done".
Progress = Callable[[str, str, int, int], None]


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """How much of each source is profiled."""

    #: Rows profiled per source, from its first row groups (fewer when it has fewer).
    samples: int = 256
    #: Rows per timed transform call; the per-sample time of a call is its time / its rows.
    batch_rows: int = 16

    def __post_init__(self) -> None:
        for name in ("samples", "batch_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


class HeapMeter:
    """Bytes held by native allocations, for deltas (see the module docstring).

    `method` is "mallinfo2" (glibc's malloc bytes in use, plus Arrow's pool unless the pool is
    the system allocator) or "rss" (resident set size).
    """

    def __init__(self) -> None:
        self._mallinfo2 = None
        name = ctypes.util.find_library("c")
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(name or "libc.so.6")
            fn = libc.mallinfo2
            fn.restype = _Mallinfo2
            fn.argtypes = []
            self._mallinfo2 = fn
        self._pool = pa.default_memory_pool().backend_name != "system"
        self.method = "mallinfo2" if self._mallinfo2 is not None else "rss"

    def __call__(self) -> int:
        if self._mallinfo2 is not None:
            info = self._mallinfo2()
            return int(info.uordblks + info.hblkhd) + (pa.total_allocated_bytes() if self._pool else 0)
        return _resident_bytes()


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource  # peak, not current: the best there is without /proc

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Collects garbage, then holds collection off (a collection mid-measurement frees memory
    the measurement did not allocate)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def profile_job(job: JobSettings, *, settings: ProfileSettings = ProfileSettings(), progress: Progress | None = None) -> dict:
    """Profiles every source of `job`, in its order.

    Returns:
        {"version", "job", "samples", "batch_rows", "state_method", "mixture" (as in the job
        file), "mesh" {"dp", "cp", "tp", "pp"}, "batch" {"global_batch_size", "microbatches"},
        "sources": [per source: see `profile_source`]}.
    Raises:
        ConfigError: a source's transform cannot be imported.
        SourceError: a source cannot be opened or read, or its transform fails; the message
            names the source and the file.
    """
    meter = HeapMeter()
    sources = [profile_source(job, i, settings=settings, meter=meter, progress=progress) for i in range(len(job.sources))]
    return {
        "version": 1,
        "job": job.job,
        "samples": settings.samples,
        "batch_rows": settings.batch_rows,
        "state_method": meter.method,
        "mixture": {
            "weights": dict(zip(job.source_names, job.weights)),
            **({"schedule": job.mixture.schedule} if job.mixture.schedule else {}),
        },
        "mesh": {"dp": job.mesh.dp, "cp": job.mesh.cp, "tp": job.mesh.tp, "pp": job.mesh.pp},
        "batch": {"global_batch_size": job.batch.global_batch_size, "microbatches": job.batch.microbatches},
        "sources": sources,
    }


def profile_source(
    job: JobSettings,
    index: int,
    *,
    settings: ProfileSettings = ProfileSettings(),
    meter: HeapMeter | None = None,
    progress: Progress | None = None,
) -> dict:
    """Profiles source `index` of `job`.

    Returns:
        {"name", "path", "token_column", "transform" (None: the default), "transform_args",
        "columns", "repeat" (all as configured), "weight" (its configured mixture weight), "files":
        [{"path", "rows", "row_groups", "state_bytes"}], "rows", "row_groups", "state_bytes"
        (the files' plus the loader's Python objects), "samples" (rows profiled),
        "read_s_per_sample" (decoding, mean over the row groups read), "transform_s_per_sample"
        (mean), "transform_p95_s" (95th percentile over the timed calls of the per-sample
        time), "bytes_per_sample" (decoded columns the transform reads), "buffer_bytes_per_sample"
        (what a loader buffers per transformed sample), "tokens_per_sample" (mean over the
        samples the transform accepts), "rejected_samples" (null or empty token lists)}.
    Raises:
        as `profile_job`.
    """
    config = job.sources[index]
    meter = meter or HeapMeter()
    report = progress or (lambda *_: None)
    transform = bind_transform(index, config, payload=job.batch.payload)
    source, python_bytes = _open(job, index, transform.columns or ())
    nfiles = len(source.files)
    files = _file_states(source, meter, lambda done: report(config.name, "open", done, nfiles))

    sample, read_s, rows_read, starts = _read_sample(
        source, transform.columns, settings.samples, lambda n: report(config.name, "read", n, settings.samples)
    )
    n = sample.num_rows
    seconds, per_sample, token_counts, rejected, buffered = 0.0, [], [], 0, 0
    batches = [(i, sample.slice(i, settings.batch_rows)) for i in range(0, n, settings.batch_rows)]
    _run_transform(transform, batches[0], source, starts, config)  # warm-up: imports, caches
    for done, (first, batch) in enumerate(batches, start=1):
        t0 = time.perf_counter()
        out = _run_transform(transform, (first, batch), source, starts, config)
        ids, features = out.ids, out.features
        elapsed = time.perf_counter() - t0
        seconds += elapsed
        per_sample.append(elapsed / batch.num_rows)
        lengths = lengths_of(ids)
        good = lengths > 0
        rejected += int(np.count_nonzero(~good))
        token_counts.append(lengths[good])
        buffered += (
            ids.nbytes + 12 * batch.num_rows + sum(f.nbytes for f in features.values()) + sum(c.nbytes for c in out.columns.values())
        )
        report(config.name, "transform", min(done * settings.batch_rows, n), n)
    tokens = np.concatenate(token_counts)
    result = {
        "name": config.name,
        "path": config.path,
        "token_column": config.token_column,
        "transform": config.transform,
        "transform_args": dict(config.transform_args),
        "columns": None if config.columns is None else list(config.columns),
        "repeat": config.repeat,
        "weight": job.weights[index],
        "files": files,
        "rows": source.num_rows,
        "row_groups": len(source.row_groups),
        "state_bytes": sum(f["state_bytes"] for f in files) + python_bytes,
        "samples": n,
        "read_s_per_sample": read_s / rows_read,
        "transform_s_per_sample": seconds / n,
        "transform_p95_s": float(np.percentile(per_sample, 95)),
        "bytes_per_sample": sample.nbytes / n,
        "buffer_bytes_per_sample": buffered / n,
        "tokens_per_sample": float(tokens.mean()) if len(tokens) else 0.0,
        "rejected_samples": rejected,
    }
    report(config.name, "done", n, n)
    return result


def _open(job: JobSettings, index: int, columns: tuple[str, ...]) -> tuple[ParquetSource, int]:
    """The source opened as a loader opens it, and the bytes of Python objects that took."""
    config = job.sources[index]
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        with _no_gc():
            before = tracemalloc.get_traced_memory()[0]
            source = ParquetSource(
                config.name,
                job.locate(config.path),
                required_columns=columns,
                token_column=config.token_column if config.transform is None else None,
            )
            python_bytes = max(tracemalloc.get_traced_memory()[0] - before, 0)
    finally:
        if not tracing:
            tracemalloc.stop()
    return source, python_bytes


def _file_states(source: ParquetSource, meter: HeapMeter, report: Callable[[int], None]) -> list[dict]:
    """Each file's state: the heap bytes one more reader of it keeps, opened as a loader does
    (`ParquetSource.open_file`: for a remote file that includes its client's input file)."""
    handles: list[pq.ParquetFile | None] = [None] * len(source.files)  # sized first: no list growth below
    files = []
    for i, path in enumerate(source.files):
        with _no_gc():
            before = meter()
            handles[i] = source.open_file(i)  # SourceError if it changed since the source was opened
            after = meter()
        meta = handles[i].metadata
        files.append({"path": path, "rows": meta.num_rows, "row_groups": meta.num_row_groups, "state_bytes": max(after - before, 0)})
        report(i + 1)
    return files


def _read_sample(
    source: ParquetSource, columns: tuple[str, ...] | None, samples: int, report: Callable[[int], None]
) -> tuple[pa.Table, float, int, list[int]]:
    """The first `samples` rows (whole row groups read, as a loader reads them), the seconds
    reading took, the rows read, and the sample row where each row group read starts."""
    tables, starts, rows, seconds = [], [], 0, 0.0
    for row_group in source.row_groups:
        if rows >= samples:
            break
        t0 = time.perf_counter()
        try:
            table = source.read(row_group, columns)
        except (OSError, pa.ArrowException) as exc:
            raise SourceError(f"source {source.name!r}: cannot read {source.describe(row_group)}: {exc}") from exc
        seconds += time.perf_counter() - t0
        starts.append(rows)
        tables.append(table)
        rows += table.num_rows
        report(min(rows, samples))
    sample = pa.concat_tables(tables).combine_chunks().slice(0, samples)
    return sample, seconds, rows, starts


def _run_transform(
    transform: BoundTransform, batch: tuple[int, pa.Table], source: ParquetSource, starts: list[int], config: SourceSettings
) -> TransformOutput:
    """The transform's checked output; SourceError naming the file and row group on failure."""
    first, table = batch
    try:
        return transform.apply(table)
    except Exception as exc:  # noqa: BLE001 - user code: any failure is the source's
        group = source.row_groups[int(np.searchsorted(starts, first, side="right")) - 1]
        raise SourceError(
            f"source {config.name!r}: transform {config.transform or 'token_ids'!r} failed on "
            f"{source.describe(group)}: {type(exc).__name__}: {exc}"
        ) from exc
