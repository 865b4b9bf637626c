"""`batchplane bench journal`'s commit policies under contention (BatchWeave §7.3, Figure 7): the
records of kind `commit`, one per store, policy and producer count.

Producers are processes (started from a forkserver), each opening the store itself with its own
`ManifestStore` and `commit.Producer`, as the paper's producers are: a producer's fragile window
is then its own I/O and CPU, not a wait for the interpreter lock behind the other producers
(with threads of one process, W was mostly that wait, and DAC's estimate of it was noise).
Each registers its id (p000, p001, ... in turn: a storm of registrations would wait out DAC's
gaps), then, once all have, builds synthetic TGBs of `--payload-kb` (default 100) over a logical
world of 32 slices, one every `--build-ms` (default 20: the preprocessing, slept, so it costs no
CPU here), writes the object (`tgb/<step>.tgb`), adds it and attempts commits while its policy says so (a policy with no gap retries a conflict
at once; every attempt carries every pending step). Producer i builds steps first + i,
first + i + P, ... (disjoint). The manifest starts pre-grown with `--pregrown-steps` (default
2,000) committed steps in one checkpoint version, standing in for the paper's five hours of
growth, and grows over the run. Nothing reads the objects, so a producer deletes those of the
steps it committed (an unlink each, the same for every policy): a long point at 64 producers
would otherwise fill tens of GB.

Steady state, measured in attempt cycles rather than fixed seconds: the warm-up lasts until
every producer has completed `--warmup-attempts` attempts (default 2; at least `--warmup-s`,
default 1, at most `--max-warmup-s`, default 400: DAC at 64 producers waits minutes between
attempts on 2 cores), so each policy has adapted; the measured window then lasts until the
median producer has completed `--cycles` attempts in it (default 20), within [`--duration-s`,
`--max-duration-s`] (default 4, 400), so a policy with long gaps is measured over enough puts
to tell 95 % from 99 % (each record carries the 95 % interval of its success rate). Counted
are the attempts that end in the window; the steps they commit are its throughput (the backlog
carried in balances the one left out).

Fields: store, policy, producers, payload_kb, commit_success_rate (puts that won / puts tried),
commit_success_rate_ci95 (its Wilson score interval, [low, high]),
committed_mb_per_s (MB = 1e6 bytes), commit_latency_s (mean, from the first attempt of a batch
to the end of the attempt that committed it, retries and gaps included), step_visible_latency_s
(mean, object written to step committed), attempts, conflicts, errors (storage failures, counted
as failed attempts), object_errors (step objects' writes and deletes the store failed, each
retried with backoff: moto's server answers 500 when the machine is overloaded), reprepared
(versions another producer committed between an attempt's prepare and its final probe: each a
race lost before any put, so not in the success rate),
deferred (attempts DAC put off after catching up on such a version, without a put: not in
attempts nor in the success rate), stale (attempts whose prepared version grew too old to put,
`Attempt.stale`: no put, not in attempts nor in the success rate),
commit_success_rate_counting_reprepares (commits / (attempts + reprepared): the success rate had
each of those been a lost put, as in the paper's protocol, which has no final probe), commits, steps_committed, offered_mb_per_s (what the producers wrote),
fragile_window_s (mean, from the start of the final probe, the GET that found no version after
the one the commit was prepared on, to the end of the put; the rebase, apply and encoding come
before it), gap_s (the policy's wait after an attempt, mean: DAC's g* (1 + xi)), cycle_s (the
median time between a producer's last two warm-up attempts), warmup_s, measured_s (the window's
length), attempts_per_producer (in the window), manifest_versions (committed in the window),
manifest_version_start, manifest_version_end, exactly_once (every step committed once, by its
builder), cpu_util (CPU seconds of the producer processes per second of the run: 2.0 is two
cores busy), load_avg (the machine's 1-minute load average at the end: other work shares the
cores), paper_commit_success_rate and paper_committed_mb_per_s (Figure 7, at 32 producers only).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import random
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from batchplane.bench import positive_int
from batchplane.bench.journal_steps import Place, fill, pregrow, step_key, synthetic_tgb, write_step
from batchplane.core.errors import Unavailable
from batchplane.core.object_storage import check_conditional_puts
from batchplane.journal.commit import ManifestSettings, ManifestStore, Producer
from batchplane.journal.policy import make_policy

T = TypeVar("T")

#: The paper's Figure 7 at 32 producers: policy -> (commit success rate, MB/s).
PAPER_FIGURE7 = {
    "dac": (0.963, 431.9),
    "incr": (0.642, 110.5),
    "fixed100": (0.643, 107.5),
    "aimd": (0.955, 79.0),
    "fixed10": (0.131, 50.0),
    "naive": (0.090, 7.1),
}
COMMIT_WORLD = 32
_MB = 1e6
#: The outcome of an attempt that tried no put (DAC deferred it after catching up).
_NO_PUT = 2
#: The outcome of an attempt that tried no put because its prepared version grew too old.
_STALE = 3
_START_TIMEOUT_S = 300.0
#: Tries of a step object's write or delete before a producer gives up.
_OBJECT_TRIES = 10
# The clock slots shared with the producers (monotonic seconds; 0 or inf until set).
_START, _WINDOW_START, _WINDOW_END = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the commit part's flags (see the module docstring)."""
    add = parser.add_argument
    add("--duration-s", type=float, default=4.0, help="least measured seconds per commit point (default 4)")
    add("--cycles", type=float, default=20.0, help="attempts the median producer completes in the measured window (default 20)")
    add("--max-duration-s", type=float, default=400.0, help="most measured seconds per commit point (default 400)")
    add("--warmup-s", type=float, default=1.0, help="least unmeasured seconds before the window (default 1)")
    add(
        "--warmup-attempts",
        type=positive_int,
        default=2,
        help="attempts every producer completes before the window opens (default 2: the policy has adapted)",
    )
    add("--max-warmup-s", type=float, default=400.0, help="most unmeasured seconds before the window (default 400)")
    add("--build-ms", type=float, default=20.0, help="ms each producer spends building a TGB, slept (default 20)")
    add("--pregrown-steps", type=int, default=2000, help="committed steps the manifest starts with (default 2,000)")


def check_arguments(args: argparse.Namespace) -> None:
    """Raises ValueError for a duration, warm-up or count out of range."""
    if not args.duration_s > 0 or not args.warmup_s >= 0 or args.build_ms < 0 or args.pregrown_steps < 0:
        raise ValueError("--duration-s must be > 0; --warmup-s, --build-ms and --pregrown-steps must be >= 0")
    if not args.max_duration_s >= args.duration_s or not args.max_warmup_s >= args.warmup_s or not args.cycles >= 0:
        raise ValueError("--max-duration-s must be >= --duration-s, --max-warmup-s >= --warmup-s, --cycles >= 0")


def commit_records(store: str, fresh: Callable[[str], Place], args: argparse.Namespace, progress: Callable[[str], None]) -> list[dict]:
    """One record per producer count and policy on `store` (`fresh(name)`: an empty store)."""
    out = []
    for producers in args.producers:
        for policy in args.policies:
            out.append(commit_point(store, fresh(f"commit-{policy}-{producers}"), policy=policy, producers=producers, args=args))
            r = out[-1]
            progress(
                f"journal: {store} {policy} x{producers}: {r['commit_success_rate']:.1%} success, "
                f"{r['committed_mb_per_s']:.1f} MB/s, {r['commit_latency_s']:.3f} s per commit, "
                f"W {r['fragile_window_s'] * 1e3:.1f} ms, cpu {r['cpu_util']:.2f}, load {r['load_avg']:.1f}"
            )
    return out


@dataclasses.dataclass(frozen=True)
class _Job:
    """What one producer process is told."""

    place: Place
    index: int
    policy: str
    seed: int
    first: int
    stride: int
    build_s: float
    slice_bytes: int

    @property
    def producer_id(self) -> str:
        return f"p{self.index:03d}"


@dataclasses.dataclass
class _Shared:
    """Shared memory between the coordinator and the producers: the clock slots, each
    producer's readiness, attempt count and last two attempt ends."""

    clock: Any
    ready: Any
    attempts: Any
    ends: Any

    @classmethod
    def make(cls, ctx: Any, producers: int) -> _Shared:
        return cls(
            clock=ctx.Array("d", [0.0, float("inf"), float("inf")], lock=False),
            ready=ctx.Array("i", producers, lock=False),
            attempts=ctx.Array("i", producers, lock=False),
            ends=ctx.Array("d", 2 * producers, lock=False),
        )


def commit_point(store: str, place: Place, *, policy: str, producers: int, args: argparse.Namespace) -> dict:
    """Runs `producers` producer processes of `policy` on the empty store at `place`."""
    settings = ManifestSettings()
    tgb_bytes = args.payload_kb * 1000
    slice_bytes = -(-tgb_bytes // COMMIT_WORLD)
    storage = place.open()
    check_conditional_puts(storage)
    pregrow(storage, args.pregrown_steps, settings, tgb_bytes=tgb_bytes)
    ctx = _context()
    shared = _Shared.make(ctx, producers)
    jobs = [
        _Job(
            place=place,
            index=i,
            policy=policy,
            seed=args.seed,
            first=args.pregrown_steps + i,
            stride=producers,
            build_s=args.build_ms / 1000,
            slice_bytes=slice_bytes,
        )
        for i in range(producers)
    ]
    procs, conns = [], []
    try:
        for job in jobs:
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_producer_process, args=(job, shared, send), name=f"producer-{job.index}", daemon=True)
            proc.start()
            send.close()
            procs.append(proc)
            conns.append(receive)
        _wait(lambda: all(shared.ready), procs, timeout_s=_START_TIMEOUT_S, what="register")
        version_start = ManifestStore(storage, settings=settings, check_writes=False).latest().version
        start = time.monotonic() + 0.1
        shared.clock[_START] = start
        cycle_s, window_start, window_end = _run_window(shared, procs, start=start, args=args)
        results = [conn.recv() for conn in conns]
    finally:
        shared.clock[_WINDOW_END] = min(shared.clock[_WINDOW_END], time.monotonic())
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    failed = [r["failure"] for r in results if "failure" in r]
    if failed:
        raise RuntimeError(f"a producer failed in {store} {policy} x{producers}:\n{failed[0]}")
    final = ManifestStore(storage, settings=settings, check_writes=False).latest()
    return _record(
        store,
        policy,
        producers,
        args,
        results,
        final=final,
        version_start=version_start,
        start=start,
        window=(window_start, window_end),
        cycle_s=cycle_s,
    )


def _record(
    store: str,
    policy: str,
    producers: int,
    args: argparse.Namespace,
    results: list[dict],
    *,
    final: Any,
    version_start: int,
    start: float,
    window: tuple[float, float],
    cycle_s: float,
) -> dict:
    """The commit record from the producers' raw attempts, counting what ends in `window`."""
    lo, hi = window
    measured = hi - lo
    attempts = conflicts = errors = commits = committed_bytes = written = reprepared = deferred = stale = 0
    latencies, visible, windows, gaps = [], [], [], []
    steps: list[tuple[int, int]] = []  # (step, producer index)
    for index, r in enumerate(results):
        written += sum(size for at, size in r["built"] if lo <= at < hi)
        for end, batch_start, outcome, fragile, gap, committed, caught_up in r["attempts"]:
            if not lo <= end < hi:
                continue
            reprepared += caught_up
            if outcome == _NO_PUT:  # deferred after catching up: no put, not in the success rate
                deferred += 1
                continue
            if outcome == _STALE:  # too old to put: no put, not in the success rate
                stale += 1
                continue
            attempts += 1
            windows.append(fragile)
            gaps.append(gap)
            conflicts += outcome == 0
            errors += outcome < 0
            if outcome > 0:
                commits += 1
                latencies.append(end - batch_start)
                for step, size, built_at in committed:
                    steps.append((step, index))
                    committed_bytes += size
                    visible.append(end - built_at)
    exactly_once = len({s for s, _ in steps}) == len(steps) and all(
        (c := final.step(s)) is not None and c.producer == f"p{i:03d}" for s, i in steps
    )
    cpu = sum(r["cpu_s"] for r in results)
    paper = PAPER_FIGURE7.get(policy) if producers == 32 else None
    return {
        "kind": "commit",
        "store": store,
        "policy": policy,
        "producers": producers,
        "payload_kb": args.payload_kb,
        "commit_success_rate": commits / attempts if attempts else 0.0,
        "commit_success_rate_ci95": wilson_interval(commits, attempts),
        "committed_mb_per_s": committed_bytes / _MB / measured,
        "commit_latency_s": _mean(latencies),
        "step_visible_latency_s": _mean(visible),
        "attempts": attempts,
        "conflicts": conflicts,
        "reprepared": reprepared,
        "deferred": deferred,
        "stale": stale,
        "commit_success_rate_counting_reprepares": commits / (attempts + reprepared) if attempts else 0.0,
        "errors": errors,
        "object_errors": sum(r["object_errors"] for r in results),
        "commits": commits,
        "steps_committed": len(steps),
        "offered_mb_per_s": written / _MB / measured,
        "fragile_window_s": _mean(windows),
        "gap_s": _mean(gaps),
        "cycle_s": cycle_s,
        "warmup_s": lo - start,
        "measured_s": measured,
        "attempts_per_producer": attempts / producers,
        "manifest_versions": commits,
        "manifest_version_start": version_start,
        "manifest_version_end": final.version,
        "exactly_once": exactly_once,
        "cpu_util": cpu / max(1e-9, hi - start),
        "load_avg": os.getloadavg()[0],
        "paper_commit_success_rate": paper[0] if paper else None,
        "paper_committed_mb_per_s": paper[1] if paper else None,
    }


def wilson_interval(successes: int, trials: int, *, z: float = 1.96) -> list[float]:
    """The Wilson score interval of a success rate (95 % for z = 1.96): [0, 1] without trials.
    A policy with long gaps makes few puts in a window, so its rate comes with its uncertainty."""
    if trials <= 0:
        return [0.0, 1.0]
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def _context() -> Any:
    """The forkserver context, preloading this module (a fork per producer is then cheap, and
    no producer inherits the coordinator's threads or storage clients)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _wait(done: Callable[[], bool], procs: list, *, timeout_s: float, what: str) -> None:
    """Waits until `done()`, or until a producer exited (its failure is read afterwards)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if any(not p.is_alive() for p in procs):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"producers did not {what} within {timeout_s} s")
        time.sleep(0.02)


def _run_window(shared: _Shared, procs: list, *, start: float, args: argparse.Namespace) -> tuple[float, float, float]:
    """Waits out the warm-up, opens the measured window, and closes it after --cycles attempts
    of the median producer (see the module docstring); returns (cycle seen in the warm-up,
    window start, window end)."""
    n = len(procs)
    while True:
        now = time.monotonic()
        warm = min(shared.attempts) >= args.warmup_attempts
        if now >= start + args.max_warmup_s or (warm and now >= start + args.warmup_s):
            break
        if any(not p.is_alive() for p in procs):
            break
        time.sleep(0.02)
    intervals = sorted(shared.ends[2 * i + 1] - shared.ends[2 * i] for i in range(n) if shared.attempts[i] >= 2)
    cycle_s = intervals[len(intervals) // 2] if intervals else now - start
    base = list(shared.attempts)
    shared.clock[_WINDOW_START] = now
    while True:
        end = time.monotonic()
        done = sorted(a - b for a, b in zip(shared.attempts, base))[n // 2] >= args.cycles
        if end - now >= args.max_duration_s or (done and end - now >= args.duration_s):
            break
        if any(not p.is_alive() for p in procs):
            break
        time.sleep(0.02)
    shared.clock[_WINDOW_END] = end
    return cycle_s, now, end


def _producer_process(job: _Job, shared: _Shared, conn: Connection) -> None:
    """A producer process: runs `_produce` and sends its raw attempts (or its failure)."""
    try:
        result = _produce(job, shared)
    except BaseException:  # reported by the coordinator
        result = {"failure": traceback.format_exc()}
    conn.send(result)
    conn.close()


def _produce(job: _Job, shared: _Shared) -> dict:
    """Registers, waits for the start, then builds, writes and adds a step every `build_s` and
    attempts while due, until the window closes. Returns {"attempts": [(end, batch start,
    outcome 1 won / 0 lost / -1 storage error / 2 no put, fragile window, gap after,
    ((step, bytes, built at), ...), versions caught up on before the put)],
    "built": [(built at, bytes)], "cpu_s"}."""
    storage = job.place.open()
    while job.index > 0 and not shared.ready[job.index - 1]:
        time.sleep(0.005)  # register in turn (see the module docstring)
    producer = Producer(
        ManifestStore(storage, settings=ManifestSettings(), check_writes=False),
        job.producer_id,
        policy=make_policy(job.policy, random=random.Random(job.seed * 1000 + job.index).random),
    )
    producer.register(max_attempts=100_000)
    data_fill = fill(job.slice_bytes, job.seed + job.index)
    shared.ready[job.index] = 1
    while (start := shared.clock[_START]) == 0:
        time.sleep(0.005)
    cpu = time.process_time()
    attempts: list[tuple] = []
    built: list[tuple[float, int]] = []
    built_at: dict[int, tuple[float, int]] = {}
    failures = [0]  # object writes and deletes the store failed, each retried
    step, next_at, batch_start = job.first, start, None
    while (now := time.monotonic()) < shared.clock[_WINDOW_END]:
        if next_at > now:
            time.sleep(min(next_at - now, 0.05))
            continue
        next_at = max(next_at, now) + job.build_s
        data = synthetic_tgb(step, world=COMMIT_WORLD, slice_bytes=job.slice_bytes, fill=data_fill)
        producer.add(_retrying(lambda: write_step(storage, step, data), failures))
        built_at[step] = (time.monotonic(), len(data))
        built.append(built_at[step])
        step += job.stride
        while producer.pending and producer.due() and (begin := time.monotonic()) < shared.clock[_WINDOW_END]:
            batch_start = begin if batch_start is None else batch_start
            try:
                attempt = producer.attempt()
                outcome = (1 if attempt.success else 0) if attempt.wrote else _STALE if attempt.stale else _NO_PUT
                fragile, caught_up = attempt.fragile_window_s, attempt.caught_up
                committed = tuple((s, built_at[s][1], built_at[s][0]) for s in attempt.committed)
            except Unavailable:
                outcome, fragile, committed, caught_up = -1, time.monotonic() - begin, (), 0
            end = time.monotonic()
            attempts.append((end, batch_start, outcome, fragile, producer.policy.gap_s(), committed, caught_up))
            shared.ends[2 * job.index] = shared.ends[2 * job.index + 1]
            shared.ends[2 * job.index + 1] = end
            shared.attempts[job.index] += 1
            for s, _, _ in committed:
                built_at.pop(s, None)
                _retrying(lambda: storage.delete(step_key(s)), failures)  # nothing reads it: the disk a long point fills stays bounded
            if outcome > 0:
                batch_start = None
    return {"attempts": attempts, "built": built, "cpu_s": time.process_time() - cpu, "object_errors": failures[0]}


def _retrying(call: Callable[[], T], failures: list[int]) -> T:
    """`call()`, retried with backoff while the store is unavailable (moto's server answers 500
    when the machine is overloaded), each failure counted in failures[0]; the last failure of
    `_OBJECT_TRIES` is raised."""
    for attempt in range(_OBJECT_TRIES - 1):
        try:
            return call()
        except Unavailable:
            failures[0] += 1
            time.sleep(min(0.1 * 2**attempt, 5.0))
    return call()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
