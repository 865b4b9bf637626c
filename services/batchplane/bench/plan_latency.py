"""`batchplane bench plan-latency`: how long the planner takes to plan one step, by mesh size.

Reproduces MegaScale-Data's Table 2 (API cost of data orchestration, Llama-12B + ViT-2B): the
time to compute the step's costs and the time to balance them, for meshes of TP = `--tp`
(default 4), PP = `--pp` (default 8), CP = `--cp` (default 1) and DP = each `--dp` (default 9 and
36: 288 and 1,152 ranks), `--samples-per-rank` samples per DP rank (default 72, 144 and 720),
contexts `--context` (default 8k and 16k), without and with a balancing group size.

The strategy is the vision-language one of `batchplane bench balance` ("hybrid"): DGraph "text"
over DP, `LLAMA_12B.cost` of text + image tokens, "karmarkar_karp" with `--microbatches` (default
4) microbatches per DP rank; DGraph "images" (metadata "image_tokens") over WORLD, `VIT_2B.cost`,
"greedy". The samples are that benchmark's synthetic draw (98% of samples <= 64 text tokens, a
long tail holding ~9% of the text tokens, lognormal image patches, capped at the context), drawn
for step s from `numpy.random.default_rng([seed, dp, samples per rank, context, s])`; drawing
is not timed.

Group size: `--group-size G` (repeatable) for every DP size G divides (and is below); by default
each DP size's divisor closest to its square root (3 for DP 9, 6 for DP 36), which minimises
Karmarkar-Karp's work, about n * (groups + group size). The text graph balances within groups of
G DP ranks; the images graph within groups of G x (ranks per DP replica) ranks, so both graphs
have the same number of groups (DP / G).

Timing (`time.perf_counter`) of one step:

- total_s: `Strategy.run` in full;
- cost_s: the time spent inside the two cost models during that run: they are wrapped in
  timers, so they are called exactly as `Strategy.run` calls them (backbone on every sample's
  length, encoder on the image tokens of the samples that have images);
- balance_s: total_s - cost_s: `assign` for both graphs plus the run's own bookkeeping (sorting
  the samples, building the plan), which is small next to the balancing.

Each configuration runs `--steps` steps (default 7); the record holds the step with the median
total_s (the lower middle for an even count), so cost_s + balance_s = total_s. One untimed
warm-up step runs first.

Records, one per (dp, samples per rank, context, group size): ranks, tp, pp, dp, cp,
samples_per_step (dp x samples per rank), context, group_size (None for none), cost_s,
balance_s, total_s.

The summary compares the 1,152-rank (DP 36), 72-samples-per-rank, 8k figure with the paper's
0.464 s (cost 0.107 s + balance 0.357 s) and the 10x target of 0.0464 s as ratios paper / ours;
it also matches every Table 2 column to a record, reading the columns as cumulative (each adds
its change to the previous one, so the 1,152-GPU columns would be 144 samples per rank at 16k),
and gives per configuration how total_s grows from 72 to 720 samples per rank.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import numpy as np

from batchplane.bench import add_mesh_arguments, positive_int
from batchplane.bench.balance import draw_samples, sample_table, vision_language_strategy
from batchplane.core.mesh import ClientPlaceTree
from batchplane.planner.models import LLAMA_12B, VIT_2B

HELP = "cost and balance time of planning one vision-language step, by mesh size (the paper's Table 2)"

DP = (9, 36)
SAMPLES_PER_RANK = (72, 144, 720)
CONTEXTS = (8192, 16384)

#: The paper's Table 2: (column, ranks, samples per DP rank, context, grouped, cost_s, balance_s),
#: the columns read as cumulative.
PAPER_TABLE_2 = (
    ("baseline", 288, 72, 8192, False, 0.004, 0.016),
    ("+BS 72->144", 288, 144, 8192, False, 0.006, 0.027),
    ("+Seq 8K->16K", 288, 144, 16384, False, 0.012, 0.173),
    ("+Cluster 288->1152", 1152, 144, 16384, False, 0.107, 0.357),
    ("+Group 1->2", 1152, 144, 16384, True, 0.106, 0.195),
)
#: The paper's 1,152-GPU figure the brief compares with, and the 10x target.
PAPER_1152_S = 0.464
TARGET_1152_S = PAPER_1152_S / 10


class _TimedCost:
    """A cost function that adds the time spent in it to `seconds`."""

    def __init__(self, fn: Callable[..., np.ndarray]) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, lengths: np.ndarray, features: object = None) -> np.ndarray:
        start = time.perf_counter()
        try:
            return self.fn(lengths, features)
        finally:
            self.seconds += time.perf_counter() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's flags.

    Args:
        parser: The benchmark's argument parser.
    """
    add_mesh_arguments(parser, dp=DP, pp=8, contexts=CONTEXTS)
    parser.add_argument(
        "--samples-per-rank",
        action="append",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"samples per DP rank per step (repeatable; default {', '.join(map(str, SAMPLES_PER_RANK))})",
    )
    parser.add_argument(
        "--group-size",
        action="append",
        type=positive_int,
        default=None,
        metavar="G",
        help="DP ranks per balancing group, run for each DP size it divides besides no grouping "
        "(repeatable; default: per DP size its divisor closest to the square root)",
    )
    parser.add_argument("--steps", type=positive_int, default=7, help="steps per configuration; the median is kept (default 7)")
    parser.add_argument("--microbatches", type=positive_int, default=4, help="microbatches per DP rank (default 4)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    """Runs the sweep.

    Args:
        args: Parsed flags (see `add_arguments`).
        progress: Called once per (dp, samples per rank).
    Returns:
        {"benchmark", "steps", "microbatches", "records", "summary"}.
    """
    dps = sorted(set(args.dp)) if args.dp else list(DP)
    per_rank = sorted(set(args.samples_per_rank)) if args.samples_per_rank else list(SAMPLES_PER_RANK)
    contexts = sorted(set(args.context)) if args.context else list(CONTEXTS)
    common = {"seed": args.seed, "microbatches": args.microbatches}
    _plan_once(ClientPlaceTree(dp=2), samples_per_rank=8, context=4096, group_size=None, step=0, **common)  # warm-up
    records: list[dict] = []
    for dp in dps:
        mesh = ClientPlaceTree(pp=args.pp, dp=dp, cp=args.cp, tp=args.tp)
        for spr in per_rank:
            for context in contexts:
                for group_size in [None, *group_sizes(dp, args.group_size)]:
                    timings = sorted(
                        (
                            _plan_once(mesh, samples_per_rank=spr, context=context, group_size=group_size, step=s, **common)
                            for s in range(args.steps)
                        ),
                        key=lambda t: t[2],
                    )
                    cost_s, balance_s, total_s = timings[(len(timings) - 1) // 2]
                    records.append(
                        {
                            "ranks": mesh.world,
                            "tp": args.tp,
                            "pp": args.pp,
                            "dp": dp,
                            "cp": args.cp,
                            "samples_per_step": dp * spr,
                            "context": context,
                            "group_size": group_size,
                            "cost_s": cost_s,
                            "balance_s": balance_s,
                            "total_s": total_s,
                        }
                    )
            progress(f"plan-latency: {mesh.world} ranks, {spr} samples per DP rank done")
    return {
        "benchmark": "plan-latency",
        "steps": args.steps,
        "microbatches": args.microbatches,
        "records": records,
        "summary": _summarize(records),
    }


def group_sizes(dp: int, chosen: list[int] | None) -> list[int]:
    """The group sizes to run for `dp` besides none.

    Args:
        dp: DP size.
        chosen: --group-size values, or None for the default.
    Returns:
        The values of `chosen` that divide dp and are below it; by default the divisor of dp
        in (1, dp) closest to sqrt(dp) (the smaller on a tie), or none when dp is prime.
    """
    if chosen:
        return sorted({g for g in chosen if g < dp and dp % g == 0})
    divisors = [g for g in range(2, dp) if dp % g == 0]
    return [min(divisors, key=lambda g: (abs(g - math.sqrt(dp)), g))] if divisors else []


def _plan_once(
    mesh: ClientPlaceTree, *, samples_per_rank: int, context: int, group_size: int | None, seed: int, step: int, microbatches: int
) -> tuple[float, float, float]:
    """(cost_s, balance_s, total_s) of planning one freshly drawn step."""
    dp = mesh.buckets("DP")
    rng = np.random.default_rng([seed, dp, samples_per_rank, context, step])
    text, image_tokens = draw_samples(rng, dp * samples_per_rank, context=context)
    table = sample_table(text, image_tokens)
    backbone, encoder = _TimedCost(LLAMA_12B.cost), _TimedCost(VIT_2B.cost)
    strategy = vision_language_strategy(
        text_method="karmarkar_karp",
        microbatches=microbatches,
        backbone_cost=backbone,
        encoder_cost=encoder,
        group_size=group_size,
        image_group_size=None if group_size is None else group_size * (mesh.world // dp),
    )
    start = time.perf_counter()
    strategy.run(step, table, mesh, default_cost=backbone)
    total = time.perf_counter() - start
    cost = backbone.seconds + encoder.seconds
    return cost, total - cost, total


def _find(records: list[dict], *, ranks: int, samples_per_rank: int, context: int, grouped: bool) -> dict | None:
    """The first record of that configuration, ungrouped or with any group size."""
    for r in records:
        same = (r["ranks"], r["samples_per_step"], r["context"]) == (ranks, samples_per_rank * r["dp"], context)
        if same and (r["group_size"] is not None) == grouped:
            return r
    return None


def _summarize(records: list[dict]) -> dict:
    """The 1,152-rank 8k figure against the paper, Table 2 column by column, and growth."""
    out: dict = {}
    for grouped in (False, True):
        r = _find(records, ranks=1152, samples_per_rank=72, context=8192, grouped=grouped)
        if r is not None:
            out["ranks_1152_8k_72" + ("_grouped" if grouped else "")] = {
                "group_size": r["group_size"],
                "total_s": r["total_s"],
                "paper_s": PAPER_1152_S,
                "paper_over_ours": PAPER_1152_S / r["total_s"],
                "target_s": TARGET_1152_S,
                "target_over_ours": TARGET_1152_S / r["total_s"],
                "meets_target": r["total_s"] <= TARGET_1152_S,
            }
    table = []
    for column, ranks, spr, context, grouped, cost_s, balance_s in PAPER_TABLE_2:
        r = _find(records, ranks=ranks, samples_per_rank=spr, context=context, grouped=grouped)
        if r is not None:
            table.append(
                {
                    "column": column,
                    "ranks": ranks,
                    "samples_per_rank": spr,
                    "context": context,
                    "group_size": r["group_size"],
                    "paper_cost_s": cost_s,
                    "paper_balance_s": balance_s,
                    "cost_s": r["cost_s"],
                    "balance_s": r["balance_s"],
                    "paper_over_ours": (cost_s + balance_s) / r["total_s"],
                }
            )
    out["paper_table_2"] = table
    by_key = {(r["ranks"], r["samples_per_step"] // r["dp"], r["context"], r["group_size"]): r for r in records}
    growth = []
    for (ranks, spr, context, group_size), small in by_key.items():
        big = by_key.get((ranks, 10 * spr, context, group_size))
        if spr == 72 and big is not None:
            growth.append(
                {
                    "ranks": ranks,
                    "context": context,
                    "group_size": group_size,
                    "total_s_72": small["total_s"],
                    "total_s_720": big["total_s"],
                    "ratio": big["total_s"] / small["total_s"],
                }
            )
    out["growth_72_to_720"] = growth
    return out
