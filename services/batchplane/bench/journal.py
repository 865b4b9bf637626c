"""`batchplane bench journal`: the journal of transactional global batches (BatchWeave, issue 18)
on the local directory and on an S3 endpoint (moto's server): commit policies under contention
(the paper's Figure 7), slice range reads against whole-object reads (§7.4), storage over a run
with and without reclamation (Figure 9) and the per-commit cost of durable producer state
(Figure 8).

Stores (`--stores`, default local,s3): `local` is a `LocalStorage` in a fresh temporary folder
(under `--dir`); `s3` is moto's S3 server started here as its own process on 127.0.0.1
(`python -m moto.server`, a dev dependency: without it the s3 store is skipped, saying why),
opened with `open_storage("s3://bench/<point>")` while the AWS variables point this process at
it; moto's state is reset between points. Every point starts on an empty store.

Kinds of record (field `kind`):

- `commit`, per store, policy (`--policies`, default every one of `journal.policy.POLICIES`)
  and producer count (`--producers`, default 32 as in the paper's Figure 7; 8,32,64 for the
  sweep). Producers are threads of this process, each with its own `ManifestStore` and
  `commit.Producer` (registered one after another before the clock starts). Each builds
  synthetic TGBs of `--payload-kb` (default 100) over a logical world of 32 slices, one every
  `--build-ms` (default 20: the preprocessing, slept, so it costs no CPU here), writes the object
  (`tgb/<step>.tgb`), adds it and attempts commits while the policy says so (a policy with no
  gap retries a conflict at once; every attempt carries every pending step). Producer i builds
  steps first + i, first + i + P, ... (disjoint). The manifest starts pre-grown with
  `--pregrown-steps` (default 2,000) committed steps in one checkpoint version, standing in for
  the paper's five hours of growth, and grows over the run.
  Steady state, measured by cycles rather than fixed seconds: the warm-up lasts until every
  producer has completed `--warmup-attempts` attempts (default 2; at least `--warmup-s`, default
  1, at most `--max-warmup-s`, default 40), so each policy has adapted; the attempt cycle is then
  the median over producers of the time between their last two attempts, and the measured
  window lasts `--cycles` (default 5) cycles, within [`--duration-s`, `--max-duration-s`]
  (default 4, 60). Counted are the attempts that end in the window; the steps they commit are
  its throughput (the backlog carried in balances the one left out).
  Fields: store, policy, producers, payload_kb, commit_success_rate (puts that won / puts
  tried), committed_mb_per_s (MB = 1e6 bytes), commit_latency_s (mean, from the first attempt
  of a batch to the end of the attempt that committed it, retries and gaps included),
  step_visible_latency_s (mean, object written to step committed), attempts, conflicts,
  errors (storage failures, counted as failed attempts), commits, steps_committed,
  offered_mb_per_s (what the producers wrote), fragile_window_s (mean, from the read that
  found the current version to the end of the put), gap_s (the policy's wait after an attempt,
  mean: DAC's g* (1 + xi)), cycle_s (the attempt cycle seen at the end of the warm-up),
  warmup_s, measured_s (the window's length), attempts_per_producer (in the window),
  manifest_versions (committed in the window), manifest_version_start, manifest_version_end,
  exactly_once (every step committed once, by its builder), cpu_util (this process's CPU
  seconds per second: 2.0 is both cores), paper_commit_success_rate and
  paper_committed_mb_per_s (Figure 7, at 32 producers only).
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
import importlib.util
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from batchplane.bench import positive_int
from batchplane.core.errors import NotFound, Unavailable
from batchplane.core.object_storage import check_conditional_puts, open_storage
from batchplane.core.storage import LocalStorage, Storage
from batchplane.journal import retention, tgb
from batchplane.journal.commit import MANIFEST_FOLDER, ManifestSettings, ManifestStore, Producer, version_key
from batchplane.journal.manifest import (
    Commit, ManifestState, Register, Retain, StepEntry, StepObject, VersionRecord, apply, encode_record,
)
from batchplane.journal.policy import POLICIES, make_policy

HELP = "journal commit policies (Figure 7), slice vs dense reads, storage with reclamation, producer-state cost"

STORES = ("local", "s3")
#: The paper's Figure 7 at 32 producers: policy -> (commit success rate, MB/s).
PAPER_FIGURE7 = {
    "dac": (0.963, 431.9), "incr": (0.642, 110.5), "fixed100": (0.643, 107.5),
    "aimd": (0.955, 79.0), "fixed10": (0.131, 50.0), "naive": (0.090, 7.1),
}
#: The paper's Figure 9 (1,010 steps, checkpoints every 10, max_lag 80): peak GiB stored.
PAPER_FIGURE9 = {"no_reclaim_gib": 34.85, "reclaim_gib": 9.76, "reduction": 0.720}
COMMIT_WORLD = 32
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
    add("--policies", type=_names(sorted(POLICIES)), default=list(PAPER_FIGURE7)[::-1],
        help="commit policies (default naive,fixed10,fixed100,aimd,incr,dac)")
    add("--producers", type=_int_list, default=[32],
        help="producer counts (default 32, the paper's Figure 7; e.g. 8,32,64 for the sweep)")
    add("--duration-s", type=float, default=4.0, help="least measured seconds per commit point (default 4)")
    add("--cycles", type=float, default=5.0,
        help="measured attempt cycles per producer: the window is at least this many of the cycles seen in the "
             "warm-up (default 5)")
    add("--max-duration-s", type=float, default=60.0, help="most measured seconds per commit point (default 60)")
    add("--warmup-s", type=float, default=1.0, help="least unmeasured seconds before the window (default 1)")
    add("--warmup-attempts", type=positive_int, default=2,
        help="attempts every producer completes before the window opens (default 2: the policy has adapted)")
    add("--max-warmup-s", type=float, default=40.0, help="most unmeasured seconds before the window (default 40)")
    add("--payload-kb", type=positive_int, default=100, help="KB per TGB in the commit and storage runs (default 100)")
    add("--build-ms", type=float, default=20.0, help="ms each producer spends building a TGB, slept (default 20)")
    add("--pregrown-steps", type=int, default=2000, help="committed steps the manifest starts with (default 2,000)")
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
    add("--dir", type=pathlib.Path, default=None, help="where the local stores go (default: the system's temp folder)")


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
    if not args.duration_s > 0 or not args.warmup_s >= 0 or args.build_ms < 0 or args.pregrown_steps < 0:
        raise ValueError("--duration-s must be > 0; --warmup-s, --build-ms and --pregrown-steps must be >= 0")
    if not args.max_duration_s >= args.duration_s or not args.max_warmup_s >= args.warmup_s or not args.cycles >= 0:
        raise ValueError("--max-duration-s must be >= --duration-s, --max-warmup-s >= --warmup-s, --cycles >= 0")
    if args.max_lag <= args.checkpoint_every * args.live_checkpoints:
        raise ValueError(f"--max-lag {args.max_lag} must exceed --checkpoint-every x --live-checkpoints "
                         f"({args.checkpoint_every * args.live_checkpoints}): the producer would wait for a checkpoint "
                         "that waits for it")
    bad = [w for w in args.worlds if w % args.read_cp]
    if bad:
        raise ValueError(f"--worlds {bad} are not multiples of --read-cp {args.read_cp}")
    records: list[dict] = []
    skipped: dict[str, str] = {}
    summary: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="batchplane-bench-journal-", dir=args.dir) as folder:
        for store in args.stores:
            with _open_stores(store, pathlib.Path(folder), progress) as fresh:
                if fresh is None:
                    skipped[store] = "moto is not installed (pip install 'moto[server]'): the s3 store needs its server"
                    progress(f"journal: skipping {store}: {skipped[store]}")
                    continue
                records += _commit_records(store, fresh, args, progress)
                records += _read_records(store, fresh, args, progress)
                for reclaim in (False, True):
                    trace = _storage_trace(store, fresh(f"trace-{int(reclaim)}"), reclaim=reclaim, args=args)
                    records += trace
                    peak = max(r["bytes_stored"] for r in trace)
                    summary.append({"store": store, "reclaim": reclaim, "peak_bytes": peak, "final_bytes": trace[-1]["bytes_stored"]})
                    progress(f"journal: {store} storage trace, reclaim {reclaim}: peak {peak / _MB:.1f} MB")
                for kb in args.state_payload_kb:
                    records.append(_producer_state(store, fresh(f"state-{kb}"), payload_kb=kb, args=args))
                    r = records[-1]
                    progress(f"journal: {store} producer state at {kb} KB: {r['delta_pct']:+.1f} % commit latency")
    return {
        "benchmark": "journal",
        "settings": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                     if k not in ("json", "benchmark")},
        "paper": {"figure7_at_32_producers": {p: {"commit_success_rate": s, "committed_mb_per_s": m}
                                              for p, (s, m) in PAPER_FIGURE7.items()},
                  "figure9": PAPER_FIGURE9},
        "skipped": skipped,
        "storage_summary": summary,
        "records": records,
    }


# --- stores -------------------------------------------------------------------------------


@contextlib.contextmanager
def _open_stores(store: str, folder: pathlib.Path, progress: Callable[[str], None]) -> Iterator[Callable[[str], Storage] | None]:
    """Yields `fresh(name)`, an empty storage per point (None: the store cannot run here)."""
    if store == "local":
        def fresh_local(name: str) -> Storage:
            path = folder / "local" / name
            shutil.rmtree(path, ignore_errors=True)
            return LocalStorage(path)
        try:
            yield fresh_local
        finally:
            shutil.rmtree(folder / "local", ignore_errors=True)
        return
    if importlib.util.find_spec("moto") is None:
        yield None
        return
    with _MotoServer(folder / "moto") as server, _environ(server.env()):
        progress(f"journal: moto's S3 server at {server.endpoint}")

        def fresh_s3(name: str) -> Storage:
            server.reset()
            return open_storage(f"s3://{BUCKET}/{name}")
        yield fresh_s3


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


class _MotoServer:
    """moto's S3 server as a child process on 127.0.0.1 with bucket `BUCKET`, stopped by its pid.

    Raises:
        RuntimeError: It exited or did not answer within 30 s (with its log's end).
    """

    def __init__(self, workdir: pathlib.Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        self._log_path = workdir / "moto.log"
        self._log = open(self._log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 30.0
        while True:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self._log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"moto's S3 server did not start (exit {self._proc.returncode}); its log ends: {tail}")
            try:
                self._call("GET", "/moto-api/")
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self._call("PUT", f"/{BUCKET}")

    def env(self) -> dict[str, str]:
        """The AWS variables that point a client here (moto accepts any key)."""
        return {
            "AWS_ACCESS_KEY_ID": "batchplane-bench", "AWS_SECRET_ACCESS_KEY": "batchplane-bench-secret",
            "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true", "AWS_EC2_METADATA_DISABLED": "true",
        }

    def reset(self) -> None:
        """Drops every object (moto's reset API) and creates the bucket again."""
        self._call("POST", "/moto-api/reset")
        self._call("PUT", f"/{BUCKET}")

    def _call(self, method: str, path: str) -> None:
        urllib.request.urlopen(urllib.request.Request(self.endpoint + path, method=method), timeout=30).close()

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> _MotoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


# --- TGBs ---------------------------------------------------------------------------------


def _tgb(step: int, *, world: int, slice_bytes: int, cp: int = 1, fill: np.ndarray) -> bytearray:
    """A synthetic TGB of world / cp x cp slices of `slice_bytes` each (views of `fill`)."""
    dp = world // cp
    slices = {(d, c): {"payload": fill[((d * cp + c) * 4096) % 65536:][:slice_bytes]} for d in range(dp) for c in range(cp)}
    return tgb.encode_tgb(slices, step=step, dp=dp, cp=cp)


def _fill(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes + 65536, dtype=np.uint8)


def _write_step(storage: Storage, step: int, data: bytearray) -> StepEntry:
    key = f"tgb/{step:012d}.tgb"
    storage.put_if_absent(key, data)
    return StepEntry(step, (StepObject(key, len(data), f"crc32:{zlib.crc32(data):08x}"),))


def _pregrow(storage: Storage, steps: int, settings: ManifestSettings, *, tgb_bytes: int) -> int:
    """Writes one checkpoint version listing `steps` committed steps (objects not written);
    returns its version (0 without steps)."""
    if steps == 0:
        return 0
    state = apply(ManifestState(), Register("pregrown"))
    entries = tuple(StepEntry(s, (StepObject(f"tgb/{s:012d}.tgb", tgb_bytes, "crc32:00000000"),)) for s in range(steps))
    state = apply(state, Commit("pregrown", 1, entries))
    k = settings.checkpoint_every
    version = k * -(-3 // k)  # the first checkpoint version above the two changes it stands for
    state = dataclasses.replace(state, version=version)
    record = VersionRecord(version=version, change=Register("pregrown"), written_at_s=time.time(), state=state)
    storage.put_if_absent(version_key(version), encode_record(record))
    return version


# --- commit policies (Figure 7) -----------------------------------------------------------


@dataclasses.dataclass
class _Tally:
    """One producer thread's counts within the window."""

    attempts: int = 0
    conflicts: int = 0
    errors: int = 0
    commits: int = 0
    steps: list[int] = dataclasses.field(default_factory=list)
    bytes: int = 0
    written_bytes: int = 0
    latencies: list[float] = dataclasses.field(default_factory=list)
    visible: list[float] = dataclasses.field(default_factory=list)
    windows: list[float] = dataclasses.field(default_factory=list)
    gaps: list[float] = dataclasses.field(default_factory=list)
    ends: list[float] = dataclasses.field(default_factory=list)  # every attempt's end, warm-up included
    failure: BaseException | None = None


def _commit_records(store: str, fresh: Callable[[str], Storage], args: argparse.Namespace,
                    progress: Callable[[str], None]) -> list[dict]:
    out = []
    for producers in args.producers:
        for policy in args.policies:
            out.append(_commit_point(store, fresh(f"commit-{policy}-{producers}"), policy=policy, producers=producers, args=args))
            r = out[-1]
            progress(f"journal: {store} {policy} x{producers}: {r['commit_success_rate']:.1%} success, "
                     f"{r['committed_mb_per_s']:.1f} MB/s, {r['commit_latency_s']:.3f} s per commit")
    return out


def _commit_point(store: str, storage: Storage, *, policy: str, producers: int, args: argparse.Namespace) -> dict:
    settings = ManifestSettings()
    tgb_bytes = args.payload_kb * 1000
    slice_bytes = -(-tgb_bytes // COMMIT_WORLD)
    check_conditional_puts(storage)
    _pregrow(storage, args.pregrown_steps, settings, tgb_bytes=tgb_bytes)
    team = []
    for i in range(producers):
        p = Producer(ManifestStore(storage, settings=settings, check_writes=False), f"p{i:03d}",
                     policy=make_policy(policy, random=random.Random(args.seed * 1000 + i).random))
        p.register()
        team.append(p)
    window = _Window()
    tallies = [_Tally() for _ in team]
    start = time.monotonic() + 0.05
    threads = [threading.Thread(target=_produce, name=f"producer-{i}", daemon=True,
                                args=(storage, p, tallies[i]),
                                kwargs=dict(first=args.pregrown_steps + i, stride=producers, start=start, window=window,
                                            build_s=args.build_ms / 1000, slice_bytes=slice_bytes,
                                            fill=_fill(slice_bytes, args.seed + i)))
               for i, p in enumerate(team)]
    cpu = time.process_time()
    version_start = team[0].store.latest().version
    for t in threads:
        t.start()
    cycle_s = _open_window(window, tallies, start=start, args=args)
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu
    failed = [t.failure for t in tallies if t.failure is not None]
    if failed:
        raise RuntimeError(f"a producer failed in {store} {policy} x{producers}: {failed[0]!r}") from failed[0]
    final = ManifestStore(storage, settings=settings, check_writes=False).latest()
    mine = {s for t in tallies for s in t.steps}
    exactly_once = all(
        (c := final.step(s)) is not None and c.producer == f"p{i:03d}" for i, t in enumerate(tallies) for s in t.steps
    ) and len(mine) == sum(len(t.steps) for t in tallies)
    attempts = sum(t.attempts for t in tallies)
    commits = sum(t.commits for t in tallies)
    measured = window.end - window.start
    paper = PAPER_FIGURE7.get(policy) if producers == 32 else None
    return {
        "kind": "commit", "store": store, "policy": policy, "producers": producers, "payload_kb": args.payload_kb,
        "commit_success_rate": commits / attempts if attempts else 0.0,
        "committed_mb_per_s": sum(t.bytes for t in tallies) / _MB / measured,
        "commit_latency_s": _mean([x for t in tallies for x in t.latencies]),
        "step_visible_latency_s": _mean([x for t in tallies for x in t.visible]),
        "attempts": attempts, "conflicts": sum(t.conflicts for t in tallies), "errors": sum(t.errors for t in tallies),
        "commits": commits, "steps_committed": len(mine),
        "offered_mb_per_s": sum(t.written_bytes for t in tallies) / _MB / measured,
        "fragile_window_s": _mean([x for t in tallies for x in t.windows]),
        "gap_s": _mean([x for t in tallies for x in t.gaps]),
        "cycle_s": cycle_s, "warmup_s": window.start - start, "measured_s": measured,
        "attempts_per_producer": attempts / producers,
        "manifest_versions": commits, "manifest_version_start": version_start, "manifest_version_end": final.version,
        "exactly_once": exactly_once, "cpu_util": cpu / (window.end - start),
        "paper_commit_success_rate": paper[0] if paper else None,
        "paper_committed_mb_per_s": paper[1] if paper else None,
    }


class _Window:
    """The measured window [start, end) in monotonic seconds, set by the coordinator once the
    producers have warmed up (both inf until then); the producer threads read it."""

    def __init__(self) -> None:
        self.start = float("inf")
        self.end = float("inf")


def _open_window(window: _Window, tallies: list[_Tally], *, start: float, args: argparse.Namespace) -> float:
    """Waits out the warm-up, then opens the measured window; returns the attempt cycle seen.

    The warm-up lasts at least --warmup-s and until every producer has completed
    --warmup-attempts attempts (at most --max-warmup-s): by then each policy has adapted (DAC's
    first attempt, with no window measured yet, has no gap). The cycle is the median over the
    producers of the time between their last two attempts; the window lasts --cycles of them,
    within [--duration-s, --max-duration-s], so a policy with long gaps is measured over
    several of its cycles and not over a fraction of one.
    """
    while True:
        now = time.monotonic()
        warm = all(len(t.ends) >= args.warmup_attempts for t in tallies)
        if now >= start + args.max_warmup_s or (warm and now >= start + args.warmup_s):
            break
        if any(t.failure is not None for t in tallies):
            break
        time.sleep(0.02)
    intervals = sorted(t.ends[-1] - t.ends[-2] for t in tallies if len(t.ends) >= 2)
    cycle_s = intervals[len(intervals) // 2] if intervals else now - start
    length = min(args.max_duration_s, max(args.duration_s, args.cycles * cycle_s))
    window.end = now + length
    window.start = now
    return cycle_s


def _produce(storage: Storage, producer: Producer, tally: _Tally, *, first: int, stride: int, start: float,
             window: _Window, build_s: float, slice_bytes: int, fill: np.ndarray) -> None:
    """One producer thread: build, write and add a step every `build_s`, attempt while due,
    until the window closes."""
    try:
        step, next_at, built_at, batch_start = first, start, {}, None
        while (now := time.monotonic()) < window.end:
            if next_at > now:
                time.sleep(min(next_at - now, window.end - now, 0.05))
                continue
            next_at = max(next_at, now) + build_s
            data = _tgb(step, world=COMMIT_WORLD, slice_bytes=slice_bytes, fill=fill)
            producer.add(_write_step(storage, step, data))
            built_at[step] = (time.monotonic(), len(data))
            if window.start <= built_at[step][0] < window.end:
                tally.written_bytes += len(data)
            step += stride
            while producer.pending and producer.due() and (begin := time.monotonic()) < window.end:
                batch_start = begin if batch_start is None else batch_start
                try:
                    attempt = producer.attempt()
                    won, fragile = attempt.success and attempt.wrote, attempt.fragile_window_s
                except Unavailable:
                    attempt, won, fragile = None, False, time.monotonic() - begin
                end = time.monotonic()
                tally.ends.append(end)
                counted = window.start <= end < window.end
                if counted:
                    tally.attempts += 1
                    tally.windows.append(fragile)
                    tally.gaps.append(producer.policy.gap_s())
                    tally.conflicts += attempt is not None and not won
                    tally.errors += attempt is None
                if won:
                    if counted:
                        tally.commits += 1
                        tally.latencies.append(end - batch_start)
                        for s in attempt.committed:
                            tally.steps.append(s)
                            tally.bytes += built_at[s][1]
                            tally.visible.append(end - built_at[s][0])
                    for s in attempt.committed:
                        built_at.pop(s, None)
                    batch_start = None
    except BaseException as exc:  # reported by the caller after join
        tally.failure = exc


# --- reads (§7.4) ---------------------------------------------------------------------------


def _read_records(store: str, fresh: Callable[[str], Storage], args: argparse.Namespace,
                  progress: Callable[[str], None]) -> list[dict]:
    out = []
    slice_bytes = args.slice_kb * 1000
    for world in args.worlds:
        storage = fresh(f"read-{world}")
        cp = args.read_cp
        fill = _fill(slice_bytes, args.seed)
        producer = Producer(ManifestStore(storage), "writer")
        producer.register()
        producer.commit([_write_step(storage, s, _tgb(s, world=world, slice_bytes=slice_bytes, cp=cp, fill=fill))
                         for s in range(args.read_steps)])
        state = ManifestStore(storage, check_writes=False).latest()
        objects = [state.step(s).entry.objects[0] for s in range(args.read_steps)]
        count = min(world, args.read_ranks)
        ranks = sorted({r * world // count for r in range(count)})
        for mode in ("slice", "dense"):
            reads = [(rank, obj) for obj in objects for rank in ranks]
            with ThreadPoolExecutor(args.read_threads) as pool:
                results = list(pool.map(lambda ro: _read_one(storage, ro[1], rank=ro[0], cp=cp, mode=mode,
                                                             slice_bytes=slice_bytes), reads))
            latencies = sorted(r[0] for r in results)
            fetched = _mean([r[1] for r in results])
            out.append({
                "kind": "read", "store": store, "world": world, "read": mode, "dp": world // cp, "cp": cp,
                "bytes_per_rank": fetched, "slice_bytes": slice_bytes, "read_amplification": fetched / slice_bytes,
                "latency_p50_s": _quantile(latencies, 0.50), "latency_p95_s": _quantile(latencies, 0.95),
                "ranks": len(ranks), "steps": args.read_steps,
            })
            progress(f"journal: {store} {mode} reads at world {world}: {fetched / 1e3:.1f} KB per rank, "
                     f"p50 {out[-1]['latency_p50_s'] * 1e3:.1f} ms")
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
        batch = tgb.decode_slice(view[entry.offset: entry.offset + entry.length], entry)
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
    fill = _fill(-(-args.payload_kb * 1000 // 8), args.seed)
    marks: deque[retention.Watermark] = deque(maxlen=args.live_checkpoints)
    steps, every = args.trace_steps, args.checkpoint_every
    sample_every = max(1, steps // every // args.trace_points)
    built, out = 0, []
    for consumed in range(1, steps + 1):
        while built < steps and not retention.backpressure(watermarks=marks, next_step=built, policy=policy).pause:
            producer.add(_write_step(sized, built, _tgb(built, world=8, slice_bytes=len(fill) - 65536, fill=fill)))
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
        while floor > (head := consumer.latest()).watermark and consumer.put(head, Retain(floor)) is None:
            pass  # the producer committed in between: read again
        if consumed // every % sample_every == 0 or consumed == steps:
            out.append({"kind": "storage", "store": store, "reclaim": reclaim, "step": consumed,
                        "bytes_stored": sum(sized.sizes.values())})
    oldest = marks[0].step
    if oldest < steps:  # a rollback to the oldest live checkpoint still finds its step
        sized.get(consumer.latest().step(oldest).entry.objects[0].key)
    return out


def _reclaim(sized: _SizedStorage, state: ManifestState, marks: deque, policy: retention.RetentionPolicy,
             settings: ManifestSettings) -> None:
    """Deletes what `retention.reclaim` allows: objects of steps below the floor, old versions."""
    k = settings.checkpoint_every
    prefix = MANIFEST_FOLDER
    versions = sorted(int(key[len(prefix):].split(".")[0]) for key in sized.sizes if key.startswith(prefix))
    decision = retention.reclaim(
        watermarks=list(marks),
        steps=[retention.StepInfo(c.step, c.version, 0.0, tuple(o.key for o in c.entry.objects)) for c in state.steps],
        versions=[retention.VersionInfo(v, 0.0, (v // k) * k) for v in versions],
        now_s=1.0, policy=policy,
    )
    for key in decision.objects:
        sized.delete(key)
    for v in decision.versions:  # ascending, below the newest checkpoint (the contract of commit)
        sized.delete(version_key(v))


# --- producer state (Figure 8) --------------------------------------------------------------


def _producer_state(store: str, storage: Storage, *, payload_kb: int, args: argparse.Namespace) -> dict:
    tgb_bytes = payload_kb * 1000
    fill = _fill(-(-tgb_bytes // 8), args.seed)
    producer = Producer(ManifestStore(storage), "producer")
    producer.register()
    control_version = 0
    timed: dict[str, list[tuple[float, float]]] = {"state": [], "control": []}
    for i in range(2 * args.state_commits + 2):  # the first pair warms up (folders, connections): not timed
        step = i
        data = _tgb(step, world=8, slice_bytes=len(fill) - 65536, fill=fill)
        begin = time.perf_counter()
        entry = _write_step(storage, step, data)
        written = time.perf_counter()
        if i % 2 == 0:
            producer.commit([entry])
            kind = "state"
        else:
            # The control: the same entry, dummy metadata in place of the producer's state, the
            # same requests (probe the next version, put it), no state machine.
            state = producer.store.cached
            meta = json.dumps({"producer": "producer", "epoch": producer.epoch, "last_step": producer.last_step,
                               "version": state.version if state else 0})
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
        "kind": "producer_state", "store": store, "payload_kb": payload_kb, "commits": args.state_commits,
        "commit_latency_s": state_s, "control_latency_s": control_s,
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

