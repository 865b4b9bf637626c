"""`batchplane bench journal`: the journal of transactional global batches (BatchWeave, issue 18)
on the local directory and on an S3 endpoint (moto's server): commit policies under contention
(the paper's Figure 7), slice range reads against whole-object reads (§7.4), storage over a run
with and without reclamation (Figure 9) and the per-commit cost of durable producer state
(Figure 8).

Stores (`--stores`, default local,s3): `local` is a `LocalStorage` in a fresh temporary folder
(under `--dir`); `s3` is moto's S3 server started here as its own process on 127.0.0.1
(`batchplane.bench.moto_server`, a dev dependency: without it the s3 store is skipped, saying
why), opened with `open_storage("s3://bench/<point>")` while the AWS variables point this
process (and the producer processes) at it; moto's state is reset between points. Every point
starts on an empty store.

With `--s3-url s3://<bucket>/<prefix>`, the s3 store is that bucket instead, on the endpoint and
with the credentials the standard AWS variables of this process name (a real object store: moto
sharing this machine's cores is what bounds the s3 figures here). Each point writes under
`<prefix>/<run>/<point>/` (`<run>` new per run) and the objects a point left are deleted before
the next point starts and at the end (the bucket's other objects are not touched).

Kinds of record (field `kind`):

- `commit`, per store, policy (`--policies`, default every one of `journal.policy.POLICIES`)
  and producer count (`--producers`, default 32 as in the paper's Figure 7; 8,32,64 for the
  sweep): producer processes under a commit policy (`batchplane.bench.journal_commit`, which
  describes the run and the fields).
- `read`, per store, world (`--worlds`, default 8,32,128) and read (`slice`, `dense`): steps of
  a world of world / `--read-cp` x `--read-cp` slices of `--slice-kb` (default 100) each are
  committed, then ranks (evenly spaced, at most `--read-ranks`, default 32) read their slice of
  each of `--read-steps` (default 3) steps, `--read-threads` (default 8) at a time: `slice` with
  `tgb.load_footer` and `tgb.load_slice` over `get_range` (trailer, footer, slice), `dense` with
  one `get` of the whole object, filtered locally. Fields: bytes_per_rank (fetched per rank and
  step), slice_bytes, read_amplification, latency_p50_s, latency_p95_s, ranks.
- `storage`, per store and reclaim (true, false): one producer and one consumer over
  `--trace-steps` (default 300) steps of `--payload-kb`; every `--checkpoint-every` (default 10)
  steps the consumer checkpoints its cursor as a watermark (the last `--live-checkpoints`,
  default 2, are live), the watermark is committed (logical trim), and with reclaim on what
  `retention.reclaim` allows is deleted; the producer pauses at `--max-lag` (default 80).
  Fields: store, reclaim, step, bytes_stored (every byte written and not deleted, manifest
  included), sampled at about `--trace-points` checkpoints (default 12) and at the end.
- `producer_state`, per store and payload size (`--state-payload-kb`, default 100,1000):
  `--state-commits` (default 20) pairs of commits of one TGB each (after one untimed pair),
  alternating: through
  `Producer` (the producer's epoch and last step committed with the step, fencing checked) and
  a control that appends the same entry with dummy metadata of the same size with the same
  storage requests (a probe GET, then the conditional put) and no state machine. Fields:
  commit_latency_s and control_latency_s (object write and commit, mean), manifest_latency_s
  and control_manifest_latency_s (the commit alone), delta_pct (of the means), delta_median_pct
  (of the medians: steadier on a shared machine).

Beside the records: `paper` (the paper's Figure 7 and 9 figures), `skipped` (stores not run
and why), `settings`, `storage_summary` (peak and final bytes per store and reclaim).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from batchplane.bench import journal_commit, moto_server, positive_int, working_folder
from batchplane.bench.journal_commit import PAPER_FIGURE7
from batchplane.bench.journal_steps import Place, synthetic_tgb, write_step
from batchplane.bench.journal_steps import fill as make_fill
from batchplane.core.errors import NotFound
from batchplane.core.storage import Storage
from batchplane.journal import retention, tgb
from batchplane.journal.commit import MANIFEST_FOLDER, ManifestSettings, ManifestStore, Producer, version_key
from batchplane.journal.manifest import ManifestState, Retain, StepObject
from batchplane.journal.policy import POLICIES

HELP = "journal commit policies (Figure 7), slice vs dense reads, storage with reclamation, producer-state cost"

STORES = ("local", "s3")
#: The paper's Figure 9 (1,010 steps, checkpoints every 10, max_lag 80): peak GiB stored.
PAPER_FIGURE9 = {"no_reclaim_gib": 34.85, "reclaim_gib": 9.76, "reduction": 0.720}
BUCKET = "bench"
_MB = 1e6


def _int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"want comma-separated integers >= 1, got {text!r}")
    return values


def _names(allowed: tuple[str, ...] | list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"want a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(values))

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's flags.

    Args:
        parser: The benchmark's argument parser.
    """
    add = parser.add_argument
    add("--stores", type=_names(STORES), default=list(STORES), help="stores to run on (default local,s3)")
    add(
        "--policies",
        type=_names(sorted(POLICIES)),
        default=list(PAPER_FIGURE7)[::-1],
        help="commit policies (default naive,fixed10,fixed100,aimd,incr,dac)",
    )
    add("--producers", type=_int_list, default=[32], help="producer counts (default 32, the paper's Figure 7; e.g. 8,32,64 for the sweep)")
    journal_commit.add_arguments(parser)
    add("--payload-kb", type=positive_int, default=100, help="KB per TGB in the commit and storage runs (default 100)")
    add("--checkpoint-every", type=positive_int, default=10, help="storage run: steps per checkpoint (default 10)")
    add("--worlds", type=_int_list, default=[8, 32, 128], help="read: logical world sizes (default 8,32,128)")
    add("--read-cp", type=positive_int, default=1, help="read: context-parallel size, dp = world / cp (default 1)")
    add("--slice-kb", type=positive_int, default=100, help="read: KB per rank's slice (default 100)")
    add("--read-steps", type=positive_int, default=3, help="read: steps read per rank (default 3)")
    add("--read-ranks", type=positive_int, default=32, help="read: most ranks simulated per world (default 32)")
    add("--read-threads", type=positive_int, default=8, help="read: ranks reading at once (default 8)")
    add("--trace-steps", type=positive_int, default=300, help="storage run: steps (default 300)")
    add("--live-checkpoints", type=positive_int, default=2, help="storage run: live checkpoints (default 2)")
    add("--max-lag", type=positive_int, default=80, help="storage run: producers' max_lag in steps (default 80)")
    add("--trace-points", type=positive_int, default=12, help="storage run: samples per run (default 12)")
    add("--state-payload-kb", type=_int_list, default=[100, 1000], help="producer state: KB per TGB (default 100,1000)")
    add("--state-commits", type=positive_int, default=20, help="producer state: commit pairs per size (default 20)")
    add("--seed", type=int, default=0, help="seed of the payloads and DAC's jitter (default 0)")
    add("--dir", type=working_folder, default=None, help="where the local stores go (default: the system's temp folder)")
    add(
        "--s3-url",
        type=_s3_url,
        default=None,
        help="the s3 store: this bucket and prefix (s3://bucket/prefix) on the endpoint the AWS_* variables name, "
        "instead of moto's server here",
    )


def _s3_url(text: str) -> str:
    """An argparse type: "s3://<bucket>[/<prefix>]", returned without a trailing '/'."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"want s3://<bucket>[/<prefix>], got {text!r}")
    return text.rstrip("/")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    """Runs every part on every store.

    Args:
        args: Parsed flags (see `add_arguments`).
        progress: Called once per measured point.
    Returns:
        {"benchmark", "settings", "paper", "skipped", "storage_summary", "records"}.
    Raises:
        ValueError: a duration or warm-up that is not a number > 0 (>= 0), a negative
            --pregrown-steps or --build-ms, a world not divisible by --read-cp, a --max-lag
            not above --checkpoint-every x --live-checkpoints.
    """
    journal_commit.check_arguments(args)
    if args.max_lag <= args.checkpoint_every * args.live_checkpoints:
        raise ValueError(
            f"--max-lag {args.max_lag} must exceed --checkpoint-every x --live-checkpoints "
            f"({args.checkpoint_every * args.live_checkpoints}): the producer would wait for a checkpoint "
            "that waits for it"
        )
    bad = [w for w in args.worlds if w % args.read_cp]
    if bad:
        raise ValueError(f"--worlds {bad} are not multiples of --read-cp {args.read_cp}")
    records: list[dict] = []
    skipped: dict[str, str] = {}
    summary: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="batchplane-bench-journal-", dir=args.dir) as folder:
        for store in args.stores:
            with _open_stores(store, pathlib.Path(folder), progress, s3_url=args.s3_url) as fresh:
                if fresh is None:
                    skipped[store] = "moto is not installed (pip install 'moto[server]'): the s3 store needs its server"
                    progress(f"journal: skipping {store}: {skipped[store]}")
                    continue
                records += journal_commit.commit_records(store, fresh, args, progress)
                records += _read_records(store, fresh, args, progress)
                for reclaim in (False, True):
                    trace = _storage_trace(store, fresh(f"trace-{int(reclaim)}").open(), reclaim=reclaim, args=args)
                    records += trace
                    peak = max(r["bytes_stored"] for r in trace)
                    summary.append({"store": store, "reclaim": reclaim, "peak_bytes": peak, "final_bytes": trace[-1]["bytes_stored"]})
                    progress(f"journal: {store} storage trace, reclaim {reclaim}: peak {peak / _MB:.1f} MB")
                for kb in args.state_payload_kb:
                    records.append(_producer_state(store, fresh(f"state-{kb}").open(), payload_kb=kb, args=args))
                    r = records[-1]
                    progress(f"journal: {store} producer state at {kb} KB: {r['delta_pct']:+.1f} % commit latency")
    return {
        "benchmark": "journal",
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items() if k not in ("json", "benchmark")},
        "paper": {
            "figure7_at_32_producers": {p: {"commit_success_rate": s, "committed_mb_per_s": m} for p, (s, m) in PAPER_FIGURE7.items()},
            "figure9": PAPER_FIGURE9,
        },
        "skipped": skipped,
        "storage_summary": summary,
        "records": records,
    }


# --- stores -------------------------------------------------------------------------------


@contextlib.contextmanager
def _open_stores(
    store: str, folder: pathlib.Path, progress: Callable[[str], None], *, s3_url: str | None = None
) -> Iterator[Callable[[str], Place] | None]:
    """Yields `fresh(name)`, an empty store per point (None: the store cannot run here); it
    drops the stores of the earlier points (a commit point writes gigabytes). `s3_url`: the s3
    store is that bucket and prefix (`_bucket_points`) instead of moto's server."""
    if store == "s3" and s3_url is not None:
        with _bucket_points(s3_url, progress) as fresh:
            yield fresh
        return
    if store == "local":

        def fresh_local(name: str) -> Place:
            shutil.rmtree(folder / "local", ignore_errors=True)
            return Place(str(folder / "local" / name))

        try:
            yield fresh_local
        finally:
            shutil.rmtree(folder / "local", ignore_errors=True)
        return
    if not moto_server.available():
        yield None
        return
    with moto_server.MotoServer(folder / "moto") as server, _environ(server.env()):
        progress(f"journal: moto's S3 server at {server.endpoint}")

        def fresh_s3(name: str) -> Place:
            server.reset()
            server.create_bucket(BUCKET)
            return Place(f"s3://{BUCKET}/{name}", server.env())

        yield fresh_s3


@contextlib.contextmanager
def _bucket_points(url: str, progress: Callable[[str], None]) -> Iterator[Callable[[str], Place]]:
    """Yields `fresh(name)` over an existing bucket: each point under `<url>/<run>/<name>`, the
    objects of the point before deleted first (and those of the last one at the end)."""
    run = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
    environ = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}  # for the producer processes
    progress(f"journal: s3 store {url}/{run}/ ({os.environ.get('AWS_ENDPOINT_URL', 'the default AWS endpoint')})")
    current: Place | None = None

    def empty(place: Place) -> None:
        storage = place.open()
        keys = storage.list()
        for key in keys:
            storage.delete(key)
        progress(f"journal: deleted {len(keys)} objects under {place.location}/")

    def fresh(name: str) -> Place:
        nonlocal current
        if current is not None:
            empty(current)
        current = Place(f"{url}/{run}/{name}", environ)
        return current

    try:
        yield fresh
    finally:
        if current is not None:
            empty(current)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the block (obstore reads the AWS ones itself)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _SizedStorage:
    """A storage that keeps the size of every object written through it and not deleted (the
    `Storage` protocol has no size listing)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.sizes: dict[str, int] = {}

    def put_if_absent(self, key: str, data: bytes) -> bool:
        done = self.inner.put_if_absent(key, data)
        if done:
            self.sizes[key] = len(data)
        return done

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        self.sizes.pop(key, None)

    def __getattr__(self, name: str):  # get, get_range, list, describe
        return getattr(self.inner, name)


# --- reads (§7.4) ---------------------------------------------------------------------------


def _read_records(store: str, fresh: Callable[[str], Place], args: argparse.Namespace, progress: Callable[[str], None]) -> list[dict]:
    out = []
    slice_bytes = args.slice_kb * 1000
    for world in args.worlds:
        storage = fresh(f"read-{world}").open()
        cp = args.read_cp
        fill = make_fill(slice_bytes, args.seed)
        producer = Producer(ManifestStore(storage), "writer")
        producer.register()
        producer.commit(
            [
                write_step(storage, s, synthetic_tgb(s, world=world, slice_bytes=slice_bytes, cp=cp, fill=fill))
                for s in range(args.read_steps)
            ]
        )
        state = ManifestStore(storage, check_writes=False).latest()
        objects = [state.step(s).entry.objects[0] for s in range(args.read_steps)]
        count = min(world, args.read_ranks)
        ranks = sorted({r * world // count for r in range(count)})
        for mode in ("slice", "dense"):
            reads = [(rank, obj) for obj in objects for rank in ranks]
            with ThreadPoolExecutor(args.read_threads) as pool:
                results = list(pool.map(lambda ro: _read_one(storage, ro[1], rank=ro[0], cp=cp, mode=mode, slice_bytes=slice_bytes), reads))
            latencies = sorted(r[0] for r in results)
            fetched = _mean([r[1] for r in results])
            out.append(
                {
                    "kind": "read",
                    "store": store,
                    "world": world,
                    "read": mode,
                    "dp": world // cp,
                    "cp": cp,
                    "bytes_per_rank": fetched,
                    "slice_bytes": slice_bytes,
                    "read_amplification": fetched / slice_bytes,
                    "latency_p50_s": _quantile(latencies, 0.50),
                    "latency_p95_s": _quantile(latencies, 0.95),
                    "ranks": len(ranks),
                    "steps": args.read_steps,
                }
            )
            progress(
                f"journal: {store} {mode} reads at world {world}: {fetched / 1e3:.1f} KB per rank, "
                f"p50 {out[-1]['latency_p50_s'] * 1e3:.1f} ms"
            )
    return out


def _read_one(storage: Storage, obj: StepObject, *, rank: int, cp: int, mode: str, slice_bytes: int) -> tuple[float, int]:
    """One rank's read of its slice of one step: (seconds, bytes fetched)."""
    fetched = 0

    def fetch(lo: int, hi: int) -> bytes:
        nonlocal fetched
        data = storage.get_range(obj.key, lo, hi)
        fetched += len(data)
        return data

    begin = time.perf_counter()
    dp, c = divmod(rank, cp)
    if mode == "slice":
        footer = tgb.load_footer(fetch, object_size=obj.size)
        batch = tgb.load_slice(fetch, footer, dp=dp, cp=c)
    else:
        whole = storage.get(obj.key)
        fetched = len(whole)
        view = memoryview(whole)
        trailer = tgb.read_trailer(view[slice(*tgb.trailer_range(len(whole)))], object_size=len(whole))
        footer = tgb.read_footer(view[slice(*tgb.footer_range(trailer))], trailer)
        entry = footer.slice(dp, c)
        batch = tgb.decode_slice(view[entry.offset : entry.offset + entry.length], entry)
    seconds = time.perf_counter() - begin
    if batch["payload"].nbytes != slice_bytes:
        raise RuntimeError(f"rank {rank} read {batch['payload'].nbytes} bytes of {obj.key}, expected {slice_bytes}")
    return seconds, fetched


# --- storage over a run (Figure 9) ----------------------------------------------------------


def _storage_trace(store: str, storage: Storage, *, reclaim: bool, args: argparse.Namespace) -> list[dict]:
    sized = _SizedStorage(storage)
    settings = ManifestSettings(checkpoint_every=16)
    policy = retention.RetentionPolicy(min_age_s=0.0, max_lag=args.max_lag)
    producer = Producer(ManifestStore(sized, settings=settings), "producer")
    producer.register()
    consumer = ManifestStore(sized, settings=settings, check_writes=False)
    fill = make_fill(-(-args.payload_kb * 1000 // 8), args.seed)
    marks: deque[retention.Watermark] = deque(maxlen=args.live_checkpoints)
    steps, every = args.trace_steps, args.checkpoint_every
    sample_every = max(1, steps // every // args.trace_points)
    built, out = 0, []
    for consumed in range(1, steps + 1):
        while built < steps and not retention.backpressure(watermarks=marks, next_step=built, policy=policy).pause:
            producer.add(write_step(sized, built, synthetic_tgb(built, world=8, slice_bytes=len(fill) - 65536, fill=fill)))
            built += 1
        producer.flush()
        state = consumer.latest()
        sized.get(state.step(consumed - 1).entry.objects[0].key)  # the consumer's read: never reclaimed early
        if consumed % every and consumed != steps:
            continue
        marks.append(retention.Watermark(manifest_version=state.version, step=consumed))
        floor = min(m.step for m in marks)
        if reclaim:
            _reclaim(sized, consumer.latest(), marks, policy, settings)
        while floor > (head := consumer.latest()).watermark and consumer.put(consumer.prepare(head, Retain(floor))) is None:
            pass  # the producer committed in between: read again
        if consumed // every % sample_every == 0 or consumed == steps:
            out.append({"kind": "storage", "store": store, "reclaim": reclaim, "step": consumed, "bytes_stored": sum(sized.sizes.values())})
    oldest = marks[0].step
    if oldest < steps:  # a rollback to the oldest live checkpoint still finds its step
        sized.get(consumer.latest().step(oldest).entry.objects[0].key)
    return out


def _reclaim(
    sized: _SizedStorage, state: ManifestState, marks: deque, policy: retention.RetentionPolicy, settings: ManifestSettings
) -> None:
    """Deletes what `retention.reclaim` allows: objects of steps below the floor, old versions."""
    k = settings.checkpoint_every
    prefix = MANIFEST_FOLDER
    versions = sorted(int(key[len(prefix) :].split(".")[0]) for key in sized.sizes if key.startswith(prefix))
    decision = retention.reclaim(
        watermarks=list(marks),
        steps=[retention.StepInfo(c.step, c.version, 0.0, tuple(o.key for o in c.entry.objects)) for c in state.steps],
        versions=[retention.VersionInfo(v, 0.0, (v // k) * k) for v in versions],
        now_s=1.0,
        policy=policy,
    )
    for key in decision.objects:
        sized.delete(key)
    for v in decision.versions:  # ascending, below the newest checkpoint (the contract of commit)
        sized.delete(version_key(v))


# --- producer state (Figure 8) --------------------------------------------------------------


def _producer_state(store: str, storage: Storage, *, payload_kb: int, args: argparse.Namespace) -> dict:
    tgb_bytes = payload_kb * 1000
    fill = make_fill(-(-tgb_bytes // 8), args.seed)
    producer = Producer(ManifestStore(storage), "producer")
    producer.register()
    control_version = 0
    timed: dict[str, list[tuple[float, float]]] = {"state": [], "control": []}
    for i in range(2 * args.state_commits + 2):  # the first pair warms up (folders, connections): not timed
        step = i
        data = synthetic_tgb(step, world=8, slice_bytes=len(fill) - 65536, fill=fill)
        begin = time.perf_counter()
        entry = write_step(storage, step, data)
        written = time.perf_counter()
        if i % 2 == 0:
            producer.commit([entry])
            kind = "state"
        else:
            # The control: the same entry, dummy metadata in place of the producer's state, the
            # same requests (probe the next version, put it), no state machine.
            state = producer.store.cached
            meta = json.dumps(
                {"producer": "producer", "epoch": producer.epoch, "last_step": producer.last_step, "version": state.version if state else 0}
            )
            while True:
                key = f"control/{control_version + 1:012d}.json"
                try:
                    storage.get(key)
                except NotFound:
                    pass
                else:
                    control_version += 1  # taken: probe on
                    continue
                doc = {"step": step, "objects": [dataclasses.asdict(o) for o in entry.objects], "meta": "x" * len(meta)}
                if storage.put_if_absent(key, json.dumps(doc, sort_keys=True).encode()):
                    control_version += 1
                    break
            kind = "control"
        end = time.perf_counter()
        if i >= 2:
            timed[kind].append((end - begin, end - written))
    state, control = [t[0] for t in timed["state"]], [t[0] for t in timed["control"]]
    state_s, control_s = _mean(state), _mean(control)
    return {
        "kind": "producer_state",
        "store": store,
        "payload_kb": payload_kb,
        "commits": args.state_commits,
        "commit_latency_s": state_s,
        "control_latency_s": control_s,
        "manifest_latency_s": _mean([t[1] for t in timed["state"]]),
        "control_manifest_latency_s": _mean([t[1] for t in timed["control"]]),
        "delta_pct": 100.0 * (state_s - control_s) / control_s if control_s else 0.0,
        "delta_median_pct": 100.0 * (float(np.median(state)) / float(np.median(control)) - 1.0),
    }


# --- helpers ------------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _quantile(sorted_values: list[float], q: float) -> float:
    return float(np.quantile(sorted_values, q)) if sorted_values else 0.0
