"""`batchplane bench mixture`: how faithfully the mixture allocator follows each kind of schedule.

For every schedule kind (`--kind`, default all five) and granularity (`--granularity`, default
"step" and "microbatch"), a `Mixture` of K = `--sources` endless sources (default 4), global
batch B = `--batch` (default 256) and `--microbatches` sub-steps (default 8, used by the
"microbatch" granularity only) allocates N = `--steps` steps (default 10,000). Only
`Mixture.allocate` runs: no data, no plans. The schedules, k being a source's index:

- "static": weights K - k (4:3:2:1 for K = 4);
- "staged": three stages starting at steps 0, N // 3 and 2N // 3, weights K - k, then k + 1,
  then 2**-k (each stage's shares differ from the previous one's for every K > 1);
- "curriculum": anchors at steps 0, N // 2 and N; every source has weight 1, plus 6 (1 - f) on
  the first source and 6 f on the last, f = 0, 1/2, 1: weight moves linearly from the first
  source to the last over the run;
- "callable": `FromCallable` of t -> 1 + 0.9 cos(2 pi (t / P + k / K)), P = N / 2 (two smooth
  cycles over the run, every source's weight between 0.1 and 1.9);
- "adaptive": metric-driven mixing (`batchplane.planner.adaptive`, default rule: equal initial
  weights, shares in [0.05, 0.7], max_change 0.02, delay 8 steps) fed by a synthetic trainer
  whose loss on source k falls with the samples it has taken, slower for larger k:
  L_k = 1 + 2 exp(-taken_k / (200 (k + 1) B / K)). The planner's loop is reproduced: the report
  of step s - D is applied, step s's weights are set, step s is allocated. Its target is the
  weights each step was planned with; "final_weights" gives the last ones (source 0 plateaus
  first, so its loss then falls slowest and the rule moves weight to it, up to its maximum).
Anchors or stage starts that coincide (N < 3) keep the first.

The target of a step is what its allocation reports: `Allocation.shares` times the step's
samples (the expected count, as the ledger's `target_samples` counts it). Record fields:

- kind, granularity, steps (N), batch (B), sources (K);
- max_drift_samples: the largest |cumulative taken - cumulative target| of any source after
  any step, in samples; max_drift_over_batch: that over B. The allocator's bounds (see
  `batchplane.planner.mixture`): at most `drift_bound(K)` (Tijdeman's bound, below 1) for
  "static", at most (K - 1) * drift_bound(K) for every schedule while the active sources hold
  (they do here: every weight stays > 0, every stream is endless);
- max_window_share_error: over every window of W = `--window` consecutive steps (default 100;
  min(W, N); every start, sliding), the largest |taken / samples - target / samples| of any
  source; at most 2 max_drift_samples / (W B);
- final_share_error: the largest |realized share - target share| of any source over the whole
  run; at most max_drift_samples / (N B);
- realized_shares, target_shares: per source, its share of the run's samples and its target;
- share_changes: steps whose shares differ from the step before;
- changes_exact: every step's shares are those of the schedule, computed here independently
  (the weights at the step's position, or at each sub-step's position weighted by the sub-step's
  size, normalized), so every change - e.g. a stage's new normalized weights - lands exactly
  at its step and at no other;
- seconds: wall time of the N allocations (the loop that calls `Mixture.allocate` and keeps the
  counts and shares; the measuring afterwards is not timed).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import numpy as np

from batchplane.bench import positive_int
from batchplane.planner.adaptive import AdaptiveRule, AdaptiveSchedule, AdaptiveState, update
from batchplane.planner.mixture import Mixture, MixtureState, drift_bound
from batchplane.core.schedule import GRANULARITIES, Curriculum, FromCallable, Schedule, Static, Staged

HELP = "mixture fidelity per schedule kind: drift from the target counts, windowed share error, exact share changes"

#: The schedule kinds measured: those whose targets are a function of the step alone.
KINDS = ("static", "staged", "curriculum", "callable", "adaptive")
#: Shares that differ by no more than this are the same (the allocator's sub-step mean and ours
#: add the same terms in another order).
SHARE_TOLERANCE = 1e-9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's flags.

    Args:
        parser: The benchmark's argument parser.
    """
    parser.add_argument("--steps", type=positive_int, default=10_000, help="steps allocated per record (default 10,000)")
    parser.add_argument("--sources", type=positive_int, default=4, help="number of sources, all endless (default 4)")
    parser.add_argument("--batch", type=positive_int, default=256, help="global batch size in samples (default 256)")
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=8,
        help="sub-steps per step with microbatch granularity (default 8)",
    )
    parser.add_argument("--window", type=positive_int, default=100, help="steps per window of the windowed share error (default 100)")
    parser.add_argument("--kind", action="append", choices=KINDS, default=None, help="schedule kind (repeatable; default all five)")
    parser.add_argument(
        "--granularity",
        action="append",
        choices=GRANULARITIES,
        default=None,
        help="how often the schedule is read (repeatable; default both)",
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    """Runs every (kind, granularity).

    Args:
        args: Parsed flags (see `add_arguments`).
        progress: Called once per record.
    Returns:
        {"benchmark", "steps", "batch", "sources", "microbatches", "window", "drift_bound",
        "schedules" (kind -> description), "records"}.
    """
    kinds = list(dict.fromkeys(args.kind or KINDS))
    granularities = list(dict.fromkeys(args.granularity or GRANULARITIES))
    records: list[dict] = []
    schedules: dict[str, str] = {}
    for kind in kinds:
        schedule = default_schedule(kind, sources=args.sources, steps=args.steps)
        schedules[kind] = schedule.describe()
        for granularity in granularities:
            mixture = Mixture(
                schedule,
                global_batch_size=args.batch,
                stream_ends=[None] * args.sources,
                granularity=granularity,
                microbatches=args.microbatches,
            )
            extra: dict = {}
            if isinstance(schedule, AdaptiveSchedule):
                counts, shares, seconds, expected = allocate_adaptive(mixture, schedule, steps=args.steps)
                extra["final_weights"] = expected[-1].tolist()
            else:
                counts, shares, seconds = allocate(mixture, steps=args.steps)
                expected = expected_shares(schedule, steps=args.steps, batch=args.batch, microbatches=mixture.microbatches)
            records.append(
                {
                    "kind": kind,
                    "granularity": granularity,
                    "steps": args.steps,
                    "batch": args.batch,
                    "sources": args.sources,
                    **fidelity(counts, shares, expected, window=args.window),
                    "seconds": seconds,
                    **extra,
                }
            )
            progress(f"mixture: {kind} per {granularity} done ({len(records)}/{len(kinds) * len(granularities)})")
    return {
        "benchmark": "mixture",
        "steps": args.steps,
        "batch": args.batch,
        "sources": args.sources,
        "microbatches": args.microbatches,
        "window": min(args.window, args.steps),
        "drift_bound": drift_bound(args.sources),
        "schedules": schedules,
        "records": records,
    }


def default_schedule(kind: str, *, sources: int, steps: int) -> Schedule:
    """The benchmark's schedule of `kind` (see the module docstring).

    Args:
        kind: One of `KINDS`.
        sources: K.
        steps: N, the run's length, which places the stages, anchors and cycles.
    Returns:
        The schedule.
    """
    names = tuple(f"s{k}" for k in range(sources))
    if kind == "static":
        return Static(tuple(float(sources - k) for k in range(sources)), source_names=names)
    if kind == "staged":
        stages = (
            (0, tuple(float(sources - k) for k in range(sources))),
            (steps // 3, tuple(float(k + 1) for k in range(sources))),
            (2 * steps // 3, tuple(2.0**-k for k in range(sources))),
        )
        return Staged(_distinct(stages), source_names=names)
    if kind == "curriculum":
        anchors = []
        for step, f in ((0, 0.0), (steps // 2, 0.5), (steps, 1.0)):
            weights = [1.0] * sources
            weights[0] += 6 * (1 - f)
            weights[-1] += 6 * f
            anchors.append((step, tuple(weights)))
        return Curriculum(_distinct(anchors), source_names=names)
    if kind == "callable":
        period = max(steps / 2, 1.0)

        def cosine(t: float) -> tuple[float, ...]:
            return tuple(1 + 0.9 * math.cos(2 * math.pi * (t / period + k / sources)) for k in range(sources))

        return FromCallable(cosine, f"cosine, period {period:g} steps", names)
    if kind == "adaptive":
        rule = AdaptiveRule(
            source_names=names,
            initial=(1.0,) * sources,
            minimum=(min(0.05, 1 / sources),) * sources,
            maximum=(max(0.7, 1 / sources),) * sources,
            max_change=0.02,
        )
        return AdaptiveSchedule(rule)
    raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def allocate(mixture: Mixture, *, steps: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Allocates `steps` steps from the initial state.

    Args:
        mixture: The mixture.
        steps: N.
    Returns:
        (counts int64 [N, K], shares float64 [N, K], seconds of the loop).
    """
    state = MixtureState.initial(mixture.num_sources)
    counts, shares = [], []
    start = time.perf_counter()
    for _ in range(steps):
        allocation, state = mixture.allocate(state)
        counts.append(allocation.counts)
        shares.append(allocation.shares)
    seconds = time.perf_counter() - start
    return np.array(counts, dtype=np.int64), np.array(shares, dtype=np.float64), seconds


def allocate_adaptive(mixture: Mixture, schedule: AdaptiveSchedule, *, steps: int) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """Allocates `steps` steps as the planner does with metric-driven mixing, the reports coming
    from the synthetic trainer of the module docstring.

    Returns:
        (counts int64 [N, K], shares float64 [N, K], seconds of the loop, the weights each step
        was planned with float64 [N, K]).
    """
    rule, k = schedule.rule, mixture.num_sources
    scale = np.array([200 * (i + 1) * mixture.global_batch_size / k for i in range(k)])
    state, adaptive = MixtureState.initial(k), AdaptiveState.initial(rule)
    taken = np.zeros(k)
    reports: dict[int, dict[str, float]] = {}
    counts, shares, weights = [], [], []
    start = time.perf_counter()
    for s in range(steps):
        if s - rule.delay_steps in reports:
            adaptive = update(rule, adaptive, reports.pop(s - rule.delay_steps))
        schedule.set(s, adaptive.weights)
        schedule.forget_before(s)
        allocation, state = mixture.allocate(state)
        taken += allocation.counts
        losses = 1 + 2 * np.exp(-taken / scale)
        reports[s] = {name: float(losses[i]) for i, name in enumerate(rule.source_names)}
        counts.append(allocation.counts)
        shares.append(allocation.shares)
        weights.append(adaptive.weights)
    seconds = time.perf_counter() - start
    return np.array(counts, dtype=np.int64), np.array(shares, dtype=np.float64), seconds, np.array(weights, dtype=np.float64)


def expected_shares(schedule: Schedule, *, steps: int, batch: int, microbatches: int) -> np.ndarray:
    """Each step's target shares straight from the schedule, for endless sources whose weights
    stay > 0: the normalized weights at the step's position, or with `microbatches` > 1 the mean
    of those at each sub-step's position weighted by its size (sizes as equal as possible, the
    first ones one larger, as the mixture cuts them).

    Args:
        schedule: The schedule.
        steps: N.
        batch: Samples per step.
        microbatches: Sub-steps per step (1 for granularity "step").
    Returns:
        float64 [N, K].
    """
    size, extra = divmod(batch, microbatches)
    sizes = [size + (m < extra) for m in range(microbatches)]
    out = np.zeros((steps, schedule.num_sources))
    for s in range(steps):
        for m, n in enumerate(sizes):
            if n:
                w = np.asarray(schedule.weights_at(s + m / microbatches), dtype=np.float64)
                out[s] += n * w / w.sum()
    return out / batch


def fidelity(counts: np.ndarray, shares: np.ndarray, expected: np.ndarray, *, window: int) -> dict:
    """The fidelity figures of a run (the record fields from max_drift_samples to changes_exact).

    Args:
        counts: int64 [N, K], the samples each step took from each source.
        shares: float64 [N, K], the shares each allocation reported.
        expected: float64 [N, K], the shares the schedule asks for (`expected_shares`).
        window: W; min(W, N) is used.
    Returns:
        {"max_drift_samples", "max_drift_over_batch", "max_window_share_error",
        "final_share_error", "realized_shares", "target_shares", "share_changes",
        "changes_exact"}; B is the largest step's total.
    """
    steps = len(counts)
    totals = counts.sum(axis=1)
    taken = np.vstack([np.zeros((1, counts.shape[1])), np.cumsum(counts, axis=0)])
    target = np.vstack([np.zeros((1, counts.shape[1])), np.cumsum(shares * totals[:, None], axis=0)])
    samples = np.concatenate([[0], np.cumsum(totals)])
    drift = float(np.abs(taken - target).max())
    w = min(window, steps)
    in_window = (samples[w:] - samples[:-w])[:, None]
    window_error = np.abs((taken[w:] - taken[:-w]) - (target[w:] - target[:-w])) / np.maximum(in_window, 1)
    batch = int(totals.max())
    changed = np.abs(np.diff(shares, axis=0)).max(axis=1) > SHARE_TOLERANCE
    due = np.abs(np.diff(expected, axis=0)).max(axis=1) > SHARE_TOLERANCE
    matches = bool(np.abs(shares - expected).max() <= SHARE_TOLERANCE)
    return {
        "max_drift_samples": drift,
        "max_drift_over_batch": drift / batch,
        "max_window_share_error": float(window_error.max()),
        "final_share_error": float(np.abs(taken[-1] - target[-1]).max() / samples[-1]),
        "realized_shares": (taken[-1] / samples[-1]).tolist(),
        "target_shares": (target[-1] / samples[-1]).tolist(),
        "share_changes": int(changed.sum()),
        "changes_exact": matches and bool(np.array_equal(changed, due)),
    }


def _distinct(points: list | tuple) -> tuple:
    """(step, weights) pairs, keeping the first of those at the same step."""
    out: list = []
    for step, weights in points:
        if not out or step > out[-1][0]:
            out.append((step, weights))
    return tuple(out)
