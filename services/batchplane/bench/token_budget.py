"""`batchplane bench token-budget`: the planner's token-budget batching against an offline
global greedy and fixed-size batches.

Measures the planner exactly as a token-budget job with default settings plans: windows of K
steps of `--global-batch` samples, K the planner's default window for that global batch
(`default_window_steps(global_batch, read_ahead_samples=LoaderSettings().read_ahead_samples)`,
16 steps at 256 samples per step), each window planned by `token_budget_steps`. Beside it, the
reference it aims at (an offline greedy over all samples at once) and ODB's Standard baseline.
Runs in process on integer length arrays; no I/O beyond an optional `--lengths` file.

Distributions (distribution number i of `NAMES` is drawn from `numpy.random.default_rng([seed,
i])`, so each is the same whichever others run):

- ODB's six synthetic ones (App. I), `--samples` of them (default 1000 as in ODB), integer
  lengths with both ends included: "uniform-narrow" U[64, 512]; "uniform-wide" U[64, 2048];
  "longtail" 90% U[64, 256] and 10% U[1024, 2048], shuffled; "bimodal" 50% U[64, 256] and 50%
  U[1536, 2048], shuffled; "all-long" U[1800, 2048]; "all-short" U[32, 64].
- Distributions matched to ODB's published length statistics (Table 10, §3.1), `--samples` of
  them (default 8192): a lognormal exp(N(ln median, sigma)) clipped to [8, max] and rounded,
  sigma solved (bisection on 4096 normal quantiles) so that the clipped distribution has the
  published coefficient of variation: "ultrachat-like" (UltraChat-200K: median 1,104, CV 0.48,
  max 4,471), "llava-like" (LLaVA-150K: median 463, CV 0.29, max 1,260), "sharegpt4o-like"
  (ShareGPT4o: median 977, CV 1.00, max 12,110); "multimodal-mix": a shuffled mixture of the
  three, 50% llava-like, 40% ultrachat-like, 10% sharegpt4o-like, shares chosen to give ODB's
  MM-Mix CV of about 0.8 (MM-Mix, short OCR/VQA beside long captioning samples, is not
  published beyond its CV and short-sample fraction of about 0.37). A lognormal cannot match
  median, mean and CV at once: the achieved median, mean, CV, P95, P99 and max of every
  distribution are in the summary (`stats`).
- `--lengths FILE` adds the lengths in a .npy file as a distribution named after the file
  (alone, unless `--distribution` names others too).

For every distribution, token budget Lmax (default 4096, 12288) and world size W (default 4,
8), the batchings measured (cost of a sample: its length squared; padded budget: a microbatch b
holds len(b) * max length <= Lmax unless b is a single sample):

- "planner", once per `--window-steps` K (field `window_steps`): the samples, in order, cut
  into windows of K * global_batch (the last window may be shorter and then has
  ceil(samples / global_batch) steps), each window planned by
  `token_budget_steps(lengths, lengths**2, ranks=W, steps=K, max_tokens=Lmax, padded=True)`;
- "offline_greedy", the reference: all samples of the distribution sorted by length descending
  (ties: lower index first), next-fit grouped under the padded budget (a group holds
  max(floor(Lmax / its first length), 1) samples), group j dealt to rank j mod W, so that every
  rank has ceil(G / W) microbatch slots (G groups; a rank short of groups trains empty slots).
  Written here independently of the planner. It has no steps: where G < W * ceil(samples /
  global_batch) (all-short) it needs fewer slots than any plan of one microbatch or more per
  rank per step;
- "fixed_batch": ODB's Standard baseline: bs = max(floor(Lmax / longest sample of the
  distribution), 1) samples per microbatch, the largest fixed batch that never exceeds the
  budget; each step's global_batch samples are dealt round-robin to the ranks (sample j to rank
  j mod W, as a DistributedSampler does), and each rank cuts its share into microbatches of bs
  in order, the last one possibly short.

A step is one microbatch round, every rank training one microbatch, as in ODB (no gradient
accumulation). Record fields:

- distribution, lmax, world, batching, window_steps (planner only; None otherwise);
- steps_per_rank: per rank, its microbatch slots over the whole distribution: for planner and
  offline_greedy every slot it is given (empty filler slots included: the rank runs them, so
  alignment holds); for fixed_batch the microbatches it really has;
- aligned: in every planned step (a window's step for the planner, a global batch for
  fixed_batch, the whole run for offline_greedy) every rank has the same number of
  microbatches;
- padding_rate: 1 - real tokens / padded tokens, a microbatch padded to its longest sample
  (empty microbatches count for neither);
- samples_per_step: samples / (W * max(steps_per_rank)): the mean samples a rank trains per
  step;
- coverage_ok: every sample id delivered exactly once;
- max_padded_tokens: the largest len(b) * max length of any microbatch b (at most Lmax unless
  a single sample is longer than Lmax).

The summary, per distribution: its samples, `stats` and `recipe`; the mean padding rate of
offline_greedy and fixed_batch over the (Lmax, W) configurations; and per window setting the
planner's mean padding rate, its padding minus offline_greedy's in percentage points (mean and
max over the configurations), the step ratio max(planner steps_per_rank) / max(offline_greedy
steps_per_rank) (mean and max), whether every configuration is within `MARGIN_PP` of
offline_greedy's padding, and the mean step ratio max(fixed_batch) / max(planner), the speedup
proxy ODB reports (the same samples in fewer synchronized steps). For the matched distributions
the summary also gives ODB's best published padding rate on the real dataset (Tables 13, 14;
measured there at ODB's selected Lmax, not the sweep's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import statistics
from collections.abc import Callable, Iterator

import numpy as np

from batchplane.bench import positive_int
from batchplane.core.config import LoaderSettings
from batchplane.planner.token_budget import token_budget_steps
from batchplane.planner.window import default_window_steps

HELP = "the planner's token-budget batching vs an offline global greedy and fixed batches"

SYNTHETIC_SAMPLES = 1000
MATCHED_SAMPLES = 8192
LMAX = (4096, 12288)
WORLD = (4, 8)
GLOBAL_BATCH = 256
#: Percentage points of padding the planner may exceed the offline greedy by (summary
#: `within_margin`): a window's groups are cut at the window's edges, and each window's last
#: group of every length band is partly filled.
MARGIN_PP = 0.5
#: Shortest length a matched distribution draws, tokens.
MIN_LENGTH = 8

#: name -> list of (share of the samples, low, high), both ends included.
DISTRIBUTIONS: dict[str, tuple[tuple[float, int, int], ...]] = {
    "uniform-narrow": ((1.0, 64, 512),),
    "uniform-wide": ((1.0, 64, 2048),),
    "longtail": ((0.9, 64, 256), (0.1, 1024, 2048)),
    "bimodal": ((0.5, 64, 256), (0.5, 1536, 2048)),
    "all-long": ((1.0, 1800, 2048),),
    "all-short": ((1.0, 32, 64),),
}


@dataclasses.dataclass(frozen=True)
class Matched:
    """A lognormal matched to a dataset's published length statistics (ODB Table 10, §3.1).

    Attributes:
        median: Published median, tokens.
        cv: Published coefficient of variation (std / mean).
        max: Published longest sample, tokens: the clip.
        odb_padding_rate: ODB's lowest published padding rate on the dataset (Tables 13, 14).
    """

    median: int
    cv: float
    max: int
    odb_padding_rate: float


MATCHED: dict[str, Matched] = {
    "ultrachat-like": Matched(median=1104, cv=0.48, max=4471, odb_padding_rate=0.013),
    "llava-like": Matched(median=463, cv=0.29, max=1260, odb_padding_rate=0.016),
    "sharegpt4o-like": Matched(median=977, cv=1.00, max=12110, odb_padding_rate=0.004),
}

#: The multimodal mixture: (matched distribution, share of the samples).
MIX: tuple[tuple[str, float], ...] = (("llava-like", 0.5), ("ultrachat-like", 0.4), ("sharegpt4o-like", 0.1))

#: Every named distribution, in seeding order.
NAMES: tuple[str, ...] = (*DISTRIBUTIONS, *MATCHED, "multimodal-mix")

#: A plan: plan[step][rank] = that rank's microbatches (int64 arrays of global sample ids).
Plan = list[list[list[np.ndarray]]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's flags.

    Args:
        parser: The benchmark's argument parser.
    """
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated lengths (default 0)")
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        default=GLOBAL_BATCH,
        metavar="N",
        help=f"samples per step (default {GLOBAL_BATCH})",
    )
    parser.add_argument(
        "--window-steps",
        action="append",
        type=positive_int,
        default=None,
        metavar="K",
        help="steps per planner window (repeatable, e.g. 1, 4, 16; default: the planner's default "
        "for the global batch and the default loaders.read_ahead_samples)",
    )
    parser.add_argument("--window", type=_removed_window, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--samples",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"samples per generated distribution (default {SYNTHETIC_SAMPLES} for ODB's six, {MATCHED_SAMPLES} for the matched ones)",
    )
    parser.add_argument(
        "--lengths",
        type=pathlib.Path,
        default=None,
        metavar="FILE",
        help="a .npy of integer lengths > 0, run as a distribution named after the file; alone unless --distribution is given too",
    )
    parser.add_argument(
        "--distribution",
        action="append",
        choices=NAMES,
        default=None,
        help="a generated distribution to run (repeatable; default: all ten, none with --lengths)",
    )
    parser.add_argument(
        "--lmax",
        action="append",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"token budget per microbatch (repeatable; default {', '.join(map(str, LMAX))})",
    )
    parser.add_argument(
        "--world",
        action="append",
        type=positive_int,
        default=None,
        metavar="W",
        help=f"data-parallel world size (repeatable; default {', '.join(map(str, WORLD))})",
    )


def _removed_window(text: str) -> int:
    """The type of the removed --window (samples per step): rejects it by name rather than
    let argparse take it for an abbreviation of --window-steps, a different unit."""
    raise argparse.ArgumentTypeError("removed: samples per step are --global-batch, planner windows --window-steps")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    """Runs the sweep.

    Args:
        args: Parsed flags (see `add_arguments`).
        progress: Called once per distribution.
    Returns:
        {"benchmark", "global_batch", "window_steps", "default_window_steps", "margin_pp",
        "lmax", "world", "records", "summary"}.
    Raises:
        ValueError: A --lengths file that is not a one-dimensional array of integers > 0.
    """
    default_k = default_window_steps(args.global_batch, read_ahead_samples=LoaderSettings().read_ahead_samples)
    windows = sorted(set(args.window_steps)) if args.window_steps else [default_k]
    lmaxes = sorted(set(args.lmax)) if args.lmax else list(LMAX)
    worlds = sorted(set(args.world)) if args.world else list(WORLD)
    dists = list(_distributions(args))
    records: list[dict] = []
    summary: dict[str, dict] = {}
    for k, (name, lengths, recipe) in enumerate(dists):
        own = []
        for lmax in lmaxes:
            for world in worlds:
                shape = {"lmax": lmax, "world": world}
                plans: list[tuple[str, int | None, Plan]] = [
                    ("planner", w, _planner_plan(lengths, **shape, global_batch=args.global_batch, window_steps=w)) for w in windows
                ]
                plans.append(("offline_greedy", None, _offline_greedy_plan(lengths, **shape)))
                plans.append(("fixed_batch", None, _fixed_batch_plan(lengths, **shape, global_batch=args.global_batch)))
                for batching, window_steps, plan in plans:
                    own.append(
                        {
                            "distribution": name,
                            "lmax": lmax,
                            "world": world,
                            "batching": batching,
                            "window_steps": window_steps,
                            **_measure(plan, lengths, world=world),
                        }
                    )
        records.extend(own)
        summary[name] = _summarize(own, lengths=lengths, recipe=recipe, windows=windows)
        if name in MATCHED:
            summary[name]["odb_published_padding_rate"] = MATCHED[name].odb_padding_rate
        progress(f"token-budget: {name} done ({k + 1}/{len(dists)})")
    return {
        "benchmark": "token-budget",
        "global_batch": args.global_batch,
        "window_steps": windows,
        "default_window_steps": default_k,
        "margin_pp": MARGIN_PP,
        "lmax": lmaxes,
        "world": worlds,
        "records": records,
        "summary": summary,
    }


def synthetic_lengths(name: str, *, seed: int, samples: int | None = None) -> np.ndarray:
    """The lengths of one generated distribution (ODB's six and the matched ones).

    Args:
        name: A name of `NAMES`.
        seed: Seed; distribution i of `NAMES` uses the generator seeded [seed, i].
        samples: Number of samples; None: `SYNTHETIC_SAMPLES` for ODB's six, `MATCHED_SAMPLES`
            for the others.
    Returns:
        int64 lengths [samples].
    """
    rng = np.random.default_rng([seed, NAMES.index(name)])
    if samples is None:
        samples = SYNTHETIC_SAMPLES if name in DISTRIBUTIONS else MATCHED_SAMPLES
    if name in MATCHED:
        return _lognormal(rng, MATCHED[name], samples)
    if name == "multimodal-mix":
        counts = _counts([share for _, share in MIX], samples)
        parts = [_lognormal(rng, MATCHED[part], count) for (part, _), count in zip(MIX, counts)]
    else:
        components = DISTRIBUTIONS[name]
        counts = _counts([share for share, _, _ in components], samples)
        parts = [rng.integers(lo, hi + 1, count, dtype=np.int64) for (_, lo, hi), count in zip(components, counts)]
    return rng.permutation(np.concatenate(parts))


def length_stats(lengths: np.ndarray) -> dict:
    """Samples, mean, median, CV (population std / mean), P95, P99, min and max of lengths."""
    a = lengths.astype(np.float64)
    return {
        "samples": len(a),
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "cv": float(a.std() / a.mean()),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
        "min": int(lengths.min()),
        "max": int(lengths.max()),
    }


def _counts(shares: list[float], samples: int) -> list[int]:
    """Samples per component: round(share * samples), the last taking the rest."""
    counts = [round(share * samples) for share in shares[:-1]]
    return [*counts, samples - sum(counts)]


@functools.cache
def _sigma(median: int, cv: float, clip: int) -> float:
    """The sigma of a lognormal with this median whose values clipped to [MIN_LENGTH, clip]
    have coefficient of variation `cv`: bisection on 4096 normal quantiles."""
    nd = statistics.NormalDist()
    z = np.array([nd.inv_cdf((i + 0.5) / 4096) for i in range(4096)])

    def clipped_cv(s: float) -> float:
        a = np.clip(median * np.exp(s * z), MIN_LENGTH, clip)
        return float(a.std() / a.mean())

    lo, hi = 1e-3, 3.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_cv(mid) < cv else (lo, mid)
    return (lo + hi) / 2


def _lognormal(rng: np.random.Generator, m: Matched, samples: int) -> np.ndarray:
    """`samples` int64 lengths of the matched lognormal `m` (see the module docstring)."""
    draws = m.median * np.exp(_sigma(m.median, m.cv, m.max) * rng.standard_normal(samples))
    return np.clip(np.rint(draws), MIN_LENGTH, m.max).astype(np.int64)


def _recipe(name: str, samples: int) -> str:
    """One line saying how distribution `name` is generated."""
    if name in DISTRIBUTIONS:
        parts = ", ".join(f"{share:.0%} U[{lo}, {hi}]" for share, lo, hi in DISTRIBUTIONS[name])
        return f"{samples} samples: {parts} (ODB App. I)"
    if name in MATCHED:
        m = MATCHED[name]
        return (
            f"{samples} samples: rint({m.median} * exp({_sigma(m.median, m.cv, m.max):.4f} * N(0, 1))) "
            f"clipped to [{MIN_LENGTH}, {m.max}] (published median {m.median}, CV {m.cv}, max {m.max})"
        )
    mix = ", ".join(f"{share:.0%} {part}" for part, share in MIX)
    return f"{samples} samples: {mix}, shuffled"


def _distributions(args: argparse.Namespace) -> Iterator[tuple[str, np.ndarray, str]]:
    """The (name, int64 lengths, recipe) triples to run: the chosen generated ones, then the file."""
    names = args.distribution or ([] if args.lengths else list(NAMES))
    for name in dict.fromkeys(names):
        lengths = synthetic_lengths(name, seed=args.seed, samples=args.samples)
        yield name, lengths, _recipe(name, len(lengths))
    if args.lengths:
        yield args.lengths.stem, _load_lengths(args.lengths), f"file {args.lengths}"


def _load_lengths(path: pathlib.Path) -> np.ndarray:
    """Reads a --lengths file.

    Raises:
        ValueError: Not a non-empty one-dimensional array of integers > 0.
    """
    a = np.load(path, allow_pickle=False)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer) or a.min() <= 0:
        raise ValueError(
            f"--lengths {str(path)!r}: want a non-empty one-dimensional array of integers > 0, got dtype {a.dtype} shape {a.shape}"
        )
    return a.astype(np.int64)


def _chunks(n: int, size: int) -> Iterator[np.ndarray]:
    for start in range(0, n, size):
        yield np.arange(start, min(start + size, n), dtype=np.int64)


def _planner_plan(lengths: np.ndarray, *, lmax: int, world: int, global_batch: int, window_steps: int) -> Plan:
    """The planner's steps over consecutive windows of window_steps * global_batch samples."""
    plan: Plan = []
    for ids in _chunks(len(lengths), window_steps * global_batch):
        lens = lengths[ids]
        steps = min(window_steps, -(-len(ids) // global_batch))
        for step in token_budget_steps(lens, lens.astype(np.float64) ** 2, ranks=world, steps=steps, max_tokens=lmax, padded=True):
            plan.append([[ids[b] for b in microbatches] for microbatches in step])
    return plan


def _offline_greedy_plan(lengths: np.ndarray, *, lmax: int, world: int) -> Plan:
    """The offline reference: one step holding every sample, grouped longest-first (next fit)
    under the padded budget, group j to rank j % world, ranks filled up to ceil(G / world)."""
    groups: list[list[int]] = []
    capacity = 0
    for i in np.argsort(-lengths, kind="stable").tolist():
        if groups and len(groups[-1]) < capacity:
            groups[-1].append(i)
        else:
            groups.append([i])
            capacity = max(lmax // int(lengths[i]), 1)
    slots = -(-len(groups) // world)
    ranks = [[np.array(sorted(g), dtype=np.int64) for g in groups[r::world]] for r in range(world)]
    return [[rank + [np.zeros(0, np.int64)] * (slots - len(rank)) for rank in ranks]]


def _fixed_batch_plan(lengths: np.ndarray, *, lmax: int, world: int, global_batch: int) -> Plan:
    """Per step (global_batch samples), per rank, its fixed-size microbatches (no fillers)."""
    bs = max(lmax // int(lengths.max()), 1)
    plan: Plan = []
    for ids in _chunks(len(lengths), global_batch):
        shares = [ids[r::world] for r in range(world)]
        plan.append([[share[i : i + bs] for i in range(0, len(share), bs)] for share in shares])
    return plan


def _measure(plan: Plan, lengths: np.ndarray, *, world: int) -> dict:
    """The record fields of one plan (see the module docstring)."""
    steps = [sum(len(step[r]) for step in plan) for r in range(world)]
    batches = [b for step in plan for rank in step for b in rank if len(b)]
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = [len(b) * int(lengths[b].max()) for b in batches]
    delivered = np.sort(np.concatenate(batches)) if batches else np.zeros(0, np.int64)
    rounds = max(steps)
    return {
        "steps_per_rank": steps,
        "aligned": all(len({len(rank) for rank in step}) == 1 for step in plan),
        "padding_rate": 1.0 - real / sum(padded) if padded else 0.0,
        "samples_per_step": len(delivered) / (world * rounds) if rounds else 0.0,
        "coverage_ok": bool(np.array_equal(delivered, np.arange(len(lengths)))),
        "max_padded_tokens": max(padded, default=0),
    }


def _summarize(records: list[dict], *, lengths: np.ndarray, recipe: str, windows: list[int]) -> dict:
    """Per-distribution summary over its (lmax, world) configurations (module docstring)."""
    greedy = [r for r in records if r["batching"] == "offline_greedy"]
    fixed = [r for r in records if r["batching"] == "fixed_batch"]
    planner = []
    for w in windows:
        mine = [r for r in records if r["batching"] == "planner" and r["window_steps"] == w]
        pp = [100 * (p["padding_rate"] - g["padding_rate"]) for p, g in zip(mine, greedy)]
        vs_greedy = [max(p["steps_per_rank"]) / max(g["steps_per_rank"]) for p, g in zip(mine, greedy)]
        vs_fixed = [max(f["steps_per_rank"]) / max(p["steps_per_rank"]) for p, f in zip(mine, fixed)]
        planner.append(
            {
                "window_steps": w,
                "padding_rate": float(np.mean([r["padding_rate"] for r in mine])),
                "padding_pp_vs_offline_greedy": float(np.mean(pp)),
                "padding_pp_vs_offline_greedy_max": float(max(pp)),
                "within_margin": bool(max(pp) <= MARGIN_PP),
                "steps_ratio_vs_offline_greedy": float(np.mean(vs_greedy)),
                "steps_ratio_vs_offline_greedy_max": float(max(vs_greedy)),
                "steps_ratio_fixed_batch": float(np.mean(vs_fixed)),
            }
        )
    return {
        "samples": len(lengths),
        "recipe": recipe,
        "stats": length_stats(lengths),
        "configurations": len(greedy),
        "padding_rate_offline_greedy": float(np.mean([r["padding_rate"] for r in greedy])),
        "padding_rate_fixed_batch": float(np.mean([r["padding_rate"] for r in fixed])),
        "planner": planner,
    }
