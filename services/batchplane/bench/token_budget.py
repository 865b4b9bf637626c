"""`batchplane bench token-budget`: token-budget batching against fixed-size batches.

Reproduces the batch-shape side of Online Dynamic Batching (ODB, Li et al. 2026) on its six
1000-sample synthetic length distributions (App. I), as integer lengths, both ends included:

- "uniform-narrow": U[64, 512];
- "uniform-wide": U[64, 2048];
- "longtail": 900 samples U[64, 256] and 100 samples U[1024, 2048], shuffled;
- "bimodal": 500 samples U[64, 256] and 500 samples U[1536, 2048], shuffled;
- "all-long": U[1800, 2048];
- "all-short": U[32, 64].

Distribution number i is drawn from `numpy.random.default_rng([seed, i])`, so each is the same
whichever others run. `--lengths FILE` adds the lengths in a .npy file as a distribution named
after the file (alone, unless `--distribution` names synthetic ones too).

For every distribution, token budget Lmax (default 2048, 4096, 8192) and world size W (default
1, 2, 4, 8), the samples go through the planner in windows of `--window` samples (the planner's
per-step allocation; the last window may be shorter), and two batchings are measured:

- "token_budget": `token_budget(lengths, lengths**2, ranks=W, max_tokens=Lmax, padded=True)`
  per window;
- "fixed_batch": ODB's Standard baseline: bs = max(floor(Lmax / longest sample of the
  distribution), 1) samples per microbatch, the largest fixed batch that never exceeds the
  budget; a window's samples are dealt round-robin to the ranks (sample j to rank j % W, as a
  DistributedSampler does), and each rank cuts its share into microbatches of bs in order, the
  last one possibly short.

A step is one microbatch round, every rank training one microbatch, as in ODB (no gradient
accumulation). Record fields:

- distribution, lmax, world, batching;
- steps_per_rank: per rank, its steps: for token_budget every microbatch slot the planner gives
  it (filler slots included: the rank runs them, so alignment holds); for fixed_batch the
  microbatches it really has (a rank with fewer would have to pad with empty steps);
- aligned: every rank has the same number of steps;
- padding_rate: 1 - real tokens / padded tokens, a microbatch padded to its longest sample
  (empty microbatches count for neither);
- samples_per_step: samples / (W * max(steps_per_rank)): the mean samples a rank trains per
  step, a rank short of steps idling through the last ones;
- coverage_ok: every sample id delivered exactly once;
- max_padded_tokens: the largest len(b) * max length of any microbatch b (at most Lmax unless
  a single sample is longer than Lmax).

The summary gives, per distribution, the padding rate of each batching averaged over the
(Lmax, W) configurations, and the mean over them of the step ratio max(fixed_batch
steps_per_rank) / max(token_budget steps_per_rank): the speedup proxy ODB reports (the same
samples in fewer synchronized steps).
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable, Iterator

import numpy as np

from batchplane.bench import positive_int
from batchplane.planner.token_budget import token_budget

HELP = "token-budget batching vs fixed batches on ODB's synthetic length distributions"

SAMPLES = 1000
LMAX = (2048, 4096, 8192)
WORLD = (1, 2, 4, 8)

#: name -> list of (share of the samples, low, high), both ends included.
DISTRIBUTIONS: dict[str, tuple[tuple[float, int, int], ...]] = {
    "uniform-narrow": ((1.0, 64, 512),),
    "uniform-wide": ((1.0, 64, 2048),),
    "longtail": ((0.9, 64, 256), (0.1, 1024, 2048)),
    "bimodal": ((0.5, 64, 256), (0.5, 1536, 2048)),
    "all-long": ((1.0, 1800, 2048),),
    "all-short": ((1.0, 32, 64),),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's flags.

    Args:
        parser: The benchmark's argument parser.
    """
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic lengths (default 0)")
    parser.add_argument(
        "--window", type=positive_int, default=256,
        help="samples per planner step; the last window may be shorter (default 256)",
    )
    parser.add_argument(
        "--lengths", type=pathlib.Path, default=None, metavar="FILE",
        help="a .npy of integer lengths > 0, run as a distribution named after the file; "
        "alone unless --distribution is given too",
    )
    parser.add_argument(
        "--distribution", action="append", choices=tuple(DISTRIBUTIONS), default=None,
        help="a synthetic distribution to run (repeatable; default: all six, none with --lengths)",
    )
    parser.add_argument(
        "--lmax", action="append", type=positive_int, default=None, metavar="N",
        help=f"token budget per microbatch (repeatable; default {', '.join(map(str, LMAX))})",
    )
    parser.add_argument(
        "--world", action="append", type=positive_int, default=None, metavar="W",
        help=f"data-parallel world size (repeatable; default {', '.join(map(str, WORLD))})",
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    """Runs the sweep.

    Args:
        args: Parsed flags (see `add_arguments`).
        progress: Called once per distribution.
    Returns:
        {"benchmark", "window", "samples", "lmax", "world", "records", "summary"}.
    Raises:
        ValueError: A --lengths file that is not a one-dimensional array of integers > 0.
    """
    lmaxes = sorted(set(args.lmax)) if args.lmax else list(LMAX)
    worlds = sorted(set(args.world)) if args.world else list(WORLD)
    dists = list(_distributions(args))
    records: list[dict] = []
    summary: dict[str, dict] = {}
    for k, (name, lengths) in enumerate(dists):
        own = []
        for lmax in lmaxes:
            for world in worlds:
                tb = _measure(_token_budget_plan(lengths, lmax=lmax, world=world, window=args.window), lengths)
                fb = _measure(_fixed_batch_plan(lengths, lmax=lmax, world=world, window=args.window), lengths)
                for batching, rec in (("token_budget", tb), ("fixed_batch", fb)):
                    own.append({"distribution": name, "lmax": lmax, "world": world, "batching": batching, **rec})
        records.extend(own)
        summary[name] = _summarize(own, samples=len(lengths))
        progress(f"token-budget: {name} done ({k + 1}/{len(dists)})")
    return {
        "benchmark": "token-budget",
        "window": args.window,
        "samples": SAMPLES,
        "lmax": lmaxes,
        "world": worlds,
        "records": records,
        "summary": summary,
    }


def synthetic_lengths(name: str, *, seed: int, samples: int = SAMPLES) -> np.ndarray:
    """The lengths of one synthetic distribution.

    Args:
        name: A key of `DISTRIBUTIONS`.
        seed: Seed; distribution i uses the generator seeded [seed, i].
        samples: Number of samples.
    Returns:
        int64 lengths [samples].
    """
    rng = np.random.default_rng([seed, list(DISTRIBUTIONS).index(name)])
    parts, left = [], samples
    components = DISTRIBUTIONS[name]
    for j, (share, lo, hi) in enumerate(components):
        count = left if j == len(components) - 1 else round(share * samples)
        parts.append(rng.integers(lo, hi + 1, count, dtype=np.int64))
        left -= count
    return rng.permutation(np.concatenate(parts))


def _distributions(args: argparse.Namespace) -> Iterator[tuple[str, np.ndarray]]:
    """The (name, int64 lengths) pairs to run: the chosen synthetic ones, then the file."""
    names = args.distribution or ([] if args.lengths else list(DISTRIBUTIONS))
    for name in dict.fromkeys(names):
        yield name, synthetic_lengths(name, seed=args.seed)
    if args.lengths:
        yield args.lengths.stem, _load_lengths(args.lengths)


def _load_lengths(path: pathlib.Path) -> np.ndarray:
    """Reads a --lengths file.

    Raises:
        ValueError: Not a non-empty one-dimensional array of integers > 0.
    """
    a = np.load(path, allow_pickle=False)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer) or a.min() <= 0:
        raise ValueError(
            f"--lengths {str(path)!r}: want a non-empty one-dimensional array of integers > 0, "
            f"got dtype {a.dtype} shape {a.shape}"
        )
    return a.astype(np.int64)


def _windows(n: int, window: int) -> Iterator[np.ndarray]:
    for start in range(0, n, window):
        yield np.arange(start, min(start + window, n), dtype=np.int64)


def _token_budget_plan(lengths: np.ndarray, *, lmax: int, world: int, window: int) -> list[list[np.ndarray]]:
    """Per rank, its microbatches (global sample ids) over all windows, fillers included."""
    plan: list[list[np.ndarray]] = [[] for _ in range(world)]
    for ids in _windows(len(lengths), window):
        lens = lengths[ids]
        step = token_budget(lens, lens.astype(np.float64) ** 2, ranks=world, max_tokens=lmax, padded=True)
        for rank, microbatches in zip(plan, step):
            rank.extend(ids[b] for b in microbatches)
    return plan


def _fixed_batch_plan(lengths: np.ndarray, *, lmax: int, world: int, window: int) -> list[list[np.ndarray]]:
    """Per rank, its fixed-size microbatches over all windows (no fillers)."""
    bs = max(lmax // int(lengths.max()), 1)
    plan: list[list[np.ndarray]] = [[] for _ in range(world)]
    for ids in _windows(len(lengths), window):
        for r in range(world):
            share = ids[r::world]
            plan[r].extend(share[i : i + bs] for i in range(0, len(share), bs))
    return plan


def _measure(plan: list[list[np.ndarray]], lengths: np.ndarray) -> dict:
    """The record fields of one plan (see the module docstring)."""
    steps = [len(rank) for rank in plan]
    batches = [b for rank in plan for b in rank if len(b)]
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = [len(b) * int(lengths[b].max()) for b in batches]
    delivered = np.sort(np.concatenate(batches)) if batches else np.zeros(0, np.int64)
    rounds = max(steps)
    return {
        "steps_per_rank": steps,
        "aligned": len(set(steps)) == 1,
        "padding_rate": 1.0 - real / sum(padded) if padded else 0.0,
        "samples_per_step": len(delivered) / (len(plan) * rounds) if rounds else 0.0,
        "coverage_ok": bool(np.array_equal(delivered, np.arange(len(lengths)))),
        "max_padded_tokens": max(padded, default=0),
    }


def _summarize(records: list[dict], *, samples: int) -> dict:
    """Per-distribution summary over its (lmax, world) configurations."""
    by = {b: [r for r in records if r["batching"] == b] for b in ("token_budget", "fixed_batch")}
    ratios = [
        max(f["steps_per_rank"]) / max(t["steps_per_rank"]) for t, f in zip(by["token_budget"], by["fixed_batch"])
    ]
    return {
        "samples": samples,
        "configurations": len(ratios),
        "padding_rate_token_budget": float(np.mean([r["padding_rate"] for r in by["token_budget"]])),
        "padding_rate_fixed_batch": float(np.mean([r["padding_rate"] for r in by["fixed_batch"]])),
        "steps_ratio": float(np.mean(ratios)),
    }
