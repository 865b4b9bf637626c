"""`batchplane bench balance`: load-time balancing of a vision-language step, four ways.

Reproduces the orchestration side of MegaScale-Data's Fig. 13 (Llama-12B backbone + ViT-2B
encoder) in simulation: each step's samples are planned with the DGraph API and the step's
iteration time is computed from the FLOPs every rank is left with. Methods, two without
balancing ("vanilla") and two with:

- "vanilla_independent": the paper's vanilla, colocated loaders: each DP rank trains the
  samples it drew itself from the mixture (its own RNG stream, see Workload below; no
  cross-rank balancing), in `--microbatches` contiguous microbatches (DGraph "text" with
  `plan_raw`), and the ranks of its DP replica encode its samples' images whole, dealt in
  arrival order (the i-th sample with images to the replica's i mod M-th rank: equal counts,
  costs unbalanced);
- "vanilla_round_robin" (called "vanilla" before): the step's samples are dealt to the DP
  ranks in arrival order (DGraph "text" balanced "round_robin"), and a DP replica's images are
  split perfectly evenly over its ranks (below) - the best case for a vanilla;
- "backbone": the sequences are balanced over DP by backbone cost ("karmarkar_karp" on
  `LLAMA_12B.cost` of the total length, text + image tokens); images still go with their
  sample, split evenly over the replica's ranks as for "vanilla_round_robin";
- "hybrid": the backbone graph above plus a secondary DGraph "images" (metadata "image_tokens")
  distributed over WORLD and balanced "greedy" by `VIT_2B.cost` (the paper's Algorithm 2): every
  rank encodes the images it is given, wherever their sample's sequence trains.

The samples are i.i.d., so dealing the step round robin gives every DP rank a draw with the
same distribution as its own independent draw: the two vanillas' backbone spreads agree within
noise, and what separates their times is the encoder split (whole samples by count vs a fluid
even split). Every graph has `--microbatches` microbatches per DP rank; the simulation uses
per-rank totals only, so they do not change the result (no pipeline bubbles are modelled).

Simulated iteration time of a step, with M = tp * pp * cp ranks per DP replica and F the assumed
effective throughput per GPU (`--tflops`, default 400 TFLOP/s):

    time = max over ranks r of (E_r + B_d(r) / M) / F

- B_d: backbone training FLOPs (`LLAMA_12B.cost`, or the same shape with `--backbone-layers`) of
  the sequences of DP rank d; the M ranks of a replica share them evenly (TP, PP and CP split a
  replica's backbone work);
- E_r: encoder training FLOPs (`VIT_2B.cost` of a sample's image tokens, its images counted as
  one sequence) encoded on rank r. For "vanilla_round_robin" and "backbone" a DP rank's images
  are spread perfectly evenly over its M ranks, E_r = E_d / M (a fluid split, the best case for
  those methods); for "vanilla_independent" E_r sums the samples dealt to r by count; for
  "hybrid" E_r is what the images graph gave rank r, whole samples at a time.

Communication (moving image features to the rank that trains the sequence), pipeline bubbles,
memory and the data-loading side are not modelled; the backbone sees every image token (no
patch merging).

Workload (synthetic; `--lengths FILE` replaces it). The mixture: for a context C (the maximum
sequence length), each sample is drawn independently:

- text tokens: with probability 0.98 uniform on {8, ..., 64}; otherwise (the long tail)
  65 + floor(X), X ~ LogNormal(mu=4.2, sigma=1.0) (tail mean ~174 tokens, so the tail holds ~9%
  of the text tokens, like coyo700m's top 1.62% holding 9.3%); at most C;
- images: none with probability 0.1 (text-only samples), else 1 + Poisson(0.5) images, each of
  max(64, round(Y)) patches, Y ~ LogNormal(ln 1024, 1.0) (median a 512 x 512 image in 16 x 16
  patches);
- image tokens: the sum of its images' patches, capped at C - text tokens (the images are
  downscaled so the sample fits the context, NaViT-style), so text + image tokens <= C.

The cap is what makes the context matter: a longer context leaves a longer tail of image tokens
in the batch. The JSON's "workload" reports, per context, the measured share of samples with at
most 64 text tokens, the long tail's share of text tokens (and of all tokens), the capped share,
the text-only share and the encoder's share of the FLOPs, over every sample drawn.

Step s of (dp, context) has dp * `--samples-per-rank` samples (default 72: the paper's BS = 72
per GPU; a GPU trains on its DP replica's samples, which its TP, PP and CP peers share, so a
per-GPU batch is a per-replica batch): DP rank d draws its own `--samples-per-rank` from
`numpy.random.default_rng([seed, dp, context, s, d])` (`rank_draw`), and the step's batch is
the ranks' draws in rank order (`step_draw`). All four methods plan the same samples; only
"vanilla_independent" keeps each draw on the rank that drew it. Per step a rank's share of
each part of the mixture (text-only samples, long-tail text) varies; over many steps it
converges to the mixture's. `--lengths FILE` instead draws them uniformly with replacement from
the file's samples that fit the context (the file is the mixture): a .npy of text lengths (1-D,
no images) or of shape [2, n] (text lengths, image tokens), or a .npz whose first array holds
text lengths and second (optional) image tokens.

Records, one per (dp, context, method):

- dp, context, method;
- max_over_mean, max_over_min: the spread of the DP ranks' backbone costs (`StepPlan.rank_costs`),
  averaged over steps;
- encoder_max_over_mean: max / mean of E_r over the ranks, averaged over steps;
- sim_iteration_s: the simulated iteration time, mean over steps;
- speedup_vs_round_robin, speedup_vs_independent: "vanilla_round_robin"'s, resp.
  "vanilla_independent"'s, sim_iteration_s / this method's (ratios of means: the same samples
  trained in less time);
- speedup_vs_vanilla: speedup_vs_round_robin, under its name from before there were two.

The summary gives, for "hybrid" and "backbone", the mean and max speedup over all (dp, context)
cells and the mean per context, over "vanilla_round_robin" (top level, as before, and under
"vs_round_robin") and over "vanilla_independent" (under "vs_independent"), beside the paper's
(1.77x average, 4.54x best; per context 4k 1.71x, 8k 2.63x, 16k 3.09x).

Pure: no I/O beyond reading a --lengths file, no services, no clocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
from collections.abc import Callable

import numpy as np

from batchplane.bench import add_mesh_arguments, positive_int
from batchplane.core.mesh import ClientPlaceTree
from batchplane.planner.balance import spread
from batchplane.planner.cost import CostFn
from batchplane.planner.dgraph import DGraph, Strategy
from batchplane.planner.models import LLAMA_12B, VIT_2B, TransformerSpec
from batchplane.planner.plan import SampleTable, StepPlan

HELP = (
    "two vanillas (independent per-rank draws, round robin) vs backbone vs hybrid (encoder + backbone) "
    "balancing of a vision-language step, simulated"
)

METHODS = ("vanilla_independent", "vanilla_round_robin", "backbone", "hybrid")
#: The methods without balancing, and the record field of the speedup over each.
VANILLAS = {"vanilla_round_robin": "speedup_vs_round_robin", "vanilla_independent": "speedup_vs_independent"}
#: How a DP replica's images are spread over its ranks when no images graph places them:
#: "even", a fluid split (E_d / M each); "dealt", whole samples in arrival order, i-th to rank i mod M.
ENCODER_SPLITS = ("even", "dealt")
DP = (8, 32)
CONTEXTS = (4096, 8192, 16384)

#: The synthetic draw (see the module docstring).
BODY_SHARE = 0.98
BODY_TEXT = (8, 64)
TAIL_TEXT_MU, TAIL_TEXT_SIGMA = 4.2, 1.0
TEXT_ONLY_SHARE = 0.1
EXTRA_IMAGES_MEAN = 0.5
PATCHES_MEDIAN, PATCHES_SIGMA, PATCHES_MIN = 1024, 1.0, 64

#: The paper's Fig. 13 / Sec. 7.3 speedups over vanilla.
PAPER = {"mean": 1.77, "max": 4.54, "per_context": {4096: 1.71, 8192: 2.63, 16384: 3.09}}


@dataclasses.dataclass(frozen=True)
class Workload:
    """Per-sample text and image tokens to draw steps from (a --lengths file), int64 [n] each."""

    text: np.ndarray
    image_tokens: np.ndarray


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's flags.

    Args:
        parser: The benchmark's argument parser.
    """
    add_mesh_arguments(parser, dp=DP, pp=1, contexts=CONTEXTS)
    parser.add_argument(
        "--samples-per-rank",
        type=positive_int,
        default=72,
        help="samples per DP rank per step (default 72, the paper's per-GPU batch)",
    )
    parser.add_argument("--steps", type=positive_int, default=60, help="steps per (dp, context) (default 60)")
    parser.add_argument("--microbatches", type=positive_int, default=4, help="microbatches per DP rank (default 4)")
    parser.add_argument(
        "--tflops",
        type=_positive_float,
        default=400.0,
        help="assumed effective training throughput per GPU, TFLOP/s (default 400)",
    )
    parser.add_argument(
        "--backbone-layers",
        type=positive_int,
        default=LLAMA_12B.layers,
        help=f"layers of the Llama-12B backbone (default {LLAMA_12B.layers}; the paper's Sec. 7.2 runs 8 or 16)",
    )
    parser.add_argument(
        "--lengths",
        type=pathlib.Path,
        default=None,
        metavar="FILE",
        help="draw samples from a .npy (text lengths, or [2, n] text and image tokens) or .npz "
        "(text lengths, then image tokens) instead of the synthetic distribution",
    )


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    """Runs the sweep.

    Args:
        args: Parsed flags (see `add_arguments`).
        progress: Called once per (dp, context).
    Returns:
        {"benchmark", "backbone", "encoder", "tp", "pp", "cp", "samples_per_rank", "steps",
        "microbatches", "tflops", "source", "workload", "records", "summary"}.
    Raises:
        ValueError: A --lengths file that does not hold valid lengths, or none of whose samples
            fits a context.
    """
    dps = sorted(set(args.dp)) if args.dp else list(DP)
    contexts = sorted(set(args.context)) if args.context else list(CONTEXTS)
    file = load_workload(args.lengths) if args.lengths else None
    backbone = dataclasses.replace(LLAMA_12B, layers=args.backbone_layers)
    strategies = {
        "vanilla_independent": independent_strategy(microbatches=args.microbatches, backbone_cost=backbone.cost),
        "vanilla_round_robin": vision_language_strategy(
            text_method="round_robin", microbatches=args.microbatches, backbone_cost=backbone.cost
        ),
        "backbone": vision_language_strategy(text_method="karmarkar_karp", microbatches=args.microbatches, backbone_cost=backbone.cost),
        "hybrid": vision_language_strategy(
            text_method="karmarkar_karp", microbatches=args.microbatches, backbone_cost=backbone.cost, encoder_cost=VIT_2B.cost
        ),
    }
    flops_per_s = args.tflops * 1e12
    records: list[dict] = []
    drawn: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {c: [] for c in contexts}
    for dp in dps:
        mesh = ClientPlaceTree(pp=args.pp, dp=dp, cp=args.cp, tp=args.tp)
        for context in contexts:
            fits = None if file is None else _fitting(file, context)
            sums = {m: np.zeros(4) for m in METHODS}  # max/mean, max/min, encoder max/mean, time
            for step in range(args.steps):
                text, image_tokens = step_draw(
                    seed=args.seed, dp=dp, context=context, step=step, samples_per_rank=args.samples_per_rank, workload=fits
                )
                drawn[context].append((text, image_tokens))
                table = sample_table(text, image_tokens)
                for method, strategy in strategies.items():
                    plan = strategy.run(step, table, mesh, default_cost=backbone.cost)
                    split = "dealt" if method == "vanilla_independent" else "even"
                    sums[method] += _measure(plan, mesh, flops_per_s=flops_per_s, encoder_split=split)
            means = {m: s / args.steps for m, s in sums.items()}
            for method in METHODS:
                mo_mean, mo_min, enc_mo_mean, sim = means[method]
                speedups = {field: float(means[vanilla][3] / sim) for vanilla, field in VANILLAS.items()}
                records.append(
                    {
                        "dp": dp,
                        "context": context,
                        "method": method,
                        "max_over_mean": float(mo_mean),
                        "max_over_min": float(mo_min),
                        "encoder_max_over_mean": float(enc_mo_mean),
                        "sim_iteration_s": float(sim),
                        "speedup_vs_vanilla": speedups["speedup_vs_round_robin"],
                        **speedups,
                    }
                )
            progress(f"balance: dp {dp} context {context} done")
    return {
        "benchmark": "balance",
        "backbone": {"name": backbone.name, "layers": backbone.layers},
        "encoder": {"name": VIT_2B.name, "layers": VIT_2B.layers},
        "tp": args.tp,
        "pp": args.pp,
        "cp": args.cp,
        "samples_per_rank": args.samples_per_rank,
        "steps": args.steps,
        "microbatches": args.microbatches,
        "tflops": args.tflops,
        "source": str(args.lengths) if args.lengths else "synthetic",
        "workload": {str(c): workload_stats(drawn[c], context=c, backbone=backbone) for c in contexts},
        "records": records,
        "summary": _summarize(records),
    }


def rank_draw(
    *, seed: int, dp: int, context: int, step: int, rank: int, samples_per_rank: int, workload: Workload | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The samples DP rank `rank` draws for itself at `step`, as a colocated loader does: its own
    stream `numpy.random.default_rng([seed, dp, context, step, rank])`, no coordination.

    Args:
        seed: The run's seed (>= 0).
        dp: Data-parallel size (part of the stream's key).
        context: Maximum text + image tokens of a sample.
        step: The step.
        rank: The DP rank, 0 <= rank < dp.
        samples_per_rank: Samples the rank draws.
        workload: Samples to draw from uniformly with replacement (a --lengths file's, all
            fitting the context); None: the synthetic mixture (`draw_samples`).
    Returns:
        (text tokens, image tokens), int64 [samples_per_rank] each.
    Raises:
        ValueError: rank outside [0, dp).
    """
    if not 0 <= rank < dp:
        raise ValueError(f"rank must be in [0, {dp}), got {rank}")
    rng = np.random.default_rng([seed, dp, context, step, rank])
    if workload is None:
        return draw_samples(rng, samples_per_rank, context=context)
    pick = rng.integers(0, len(workload.text), samples_per_rank)
    return workload.text[pick], workload.image_tokens[pick]


def step_draw(
    *, seed: int, dp: int, context: int, step: int, samples_per_rank: int, workload: Workload | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The step's samples: every DP rank's own draw (`rank_draw`), in rank order, so rank d's
    are at positions d * samples_per_rank ... (d + 1) * samples_per_rank - 1.

    Args:
        seed, dp, context, step, samples_per_rank, workload: As for `rank_draw`.
    Returns:
        (text tokens, image tokens), int64 [dp * samples_per_rank] each.
    """
    draws = [
        rank_draw(seed=seed, dp=dp, context=context, step=step, rank=d, samples_per_rank=samples_per_rank, workload=workload)
        for d in range(dp)
    ]
    return np.concatenate([t for t, _ in draws]), np.concatenate([i for _, i in draws])


def draw_samples(rng: np.random.Generator, n: int, *, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Draws `n` samples of the synthetic vision-language workload (see the module docstring).

    Args:
        rng: The generator.
        n: Number of samples.
        context: Maximum text + image tokens of a sample.
    Returns:
        (text tokens, image tokens), int64 [n] each; text >= 1, text + image <= context.
    """
    tail = rng.random(n) >= BODY_SHARE
    text = rng.integers(BODY_TEXT[0], BODY_TEXT[1] + 1, n, dtype=np.int64)
    text[tail] = BODY_TEXT[1] + 1 + np.floor(rng.lognormal(TAIL_TEXT_MU, TAIL_TEXT_SIGMA, int(tail.sum()))).astype(np.int64)
    text = np.minimum(text, context)
    images = 1 + rng.poisson(EXTRA_IMAGES_MEAN, n)
    images[rng.random(n) < TEXT_ONLY_SHARE] = 0
    width = max(int(images.max(initial=0)), 1)
    patches = np.maximum(PATCHES_MIN, np.rint(rng.lognormal(np.log(PATCHES_MEDIAN), PATCHES_SIGMA, (n, width)))).astype(np.int64)
    patches[np.arange(width)[None, :] >= images[:, None]] = 0
    return text, np.minimum(patches.sum(axis=1), context - text)


def sample_table(text: np.ndarray, image_tokens: np.ndarray) -> SampleTable:
    """One step's samples as the planner sees them: one source, in arrival order, length = text
    + image tokens, feature "image_tokens".

    Args:
        text: int64 text tokens [n], each >= 1.
        image_tokens: int64 image tokens [n], each >= 0.
    Returns:
        The SampleTable.
    """
    n = len(text)
    return SampleTable(
        source=np.zeros(n, np.int32),
        seq=np.arange(n, dtype=np.int64),
        row=np.arange(n, dtype=np.int64),
        length=(text + image_tokens).astype(np.int32),
        epoch=np.zeros(n, np.int32),
        features={"image_tokens": image_tokens.astype(np.float64)},
    )


def vision_language_strategy(
    *,
    text_method: str,
    microbatches: int,
    backbone_cost: CostFn,
    encoder_cost: CostFn | None = None,
    group_size: int | None = None,
    image_group_size: int | None = None,
) -> Strategy:
    """The strategy: sequences over DP by backbone cost, and, with `encoder_cost`, images
    (metadata "image_tokens") over WORLD greedily by encoder cost.

    Args:
        text_method: Balancing of the sequences ("round_robin", "karmarkar_karp", ...).
        microbatches: Microbatches per DP rank.
        backbone_cost: Cost of a sequence from its length (text + image tokens).
        encoder_cost: Cost of a sample's images from its image tokens; None: no images graph.
        group_size: DP ranks per balancing group of the text graph (None: all at once).
        image_group_size: Ranks per balancing group of the images graph (None: all at once).
    Returns:
        The compiled Strategy.
    """
    text = DGraph("text").mix().distribute(axis="DP", group_size=group_size).cost(backbone_cost)
    text.balance(text_method, microbatches=microbatches)
    if encoder_cost is None:
        return text.plan()
    images = DGraph("images", metadata="image_tokens").distribute(axis="WORLD", group_size=image_group_size)
    images.cost(encoder_cost).balance("greedy")
    return text.plan(images)


def independent_strategy(*, microbatches: int, backbone_cost: CostFn) -> Strategy:
    """The colocated loaders' plan: DP rank d trains the samples it drew (`step_draw`'s d-th
    block of equal size), in `microbatches` contiguous microbatches; nothing is balanced.

    Args:
        microbatches: Microbatches per DP rank.
        backbone_cost: Cost of a sequence from its length (for the plan's rank costs).
    Returns:
        The compiled Strategy (DGraph "text" over DP with `plan_raw`).
    """
    text = DGraph("text").mix().distribute(axis="DP").cost(backbone_cost)
    text.plan_raw(functools.partial(_own_draws, microbatches=microbatches))
    return text.plan()


def simulate(
    plan: StepPlan, mesh: ClientPlaceTree, *, encoder: TransformerSpec = VIT_2B, encoder_split: str = "even"
) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the FLOPs it computes in one step (see the module docstring).

    Args:
        plan: The step's plan; with an "images" subplan over WORLD its images are encoded where
            it says, else on the ranks of their sample's DP replica as `encoder_split` says.
        mesh: The mesh the plan was made for.
        encoder: The image encoder.
        encoder_split: One of `ENCODER_SPLITS`: "even" spreads a replica's encoder FLOPs evenly
            over its ranks; "dealt" gives its samples with images, whole and in arrival order,
            the i-th to the i mod M-th of `mesh.ranks(dp=d)`.
    Returns:
        (encoder FLOPs [world], backbone FLOPs [world]) of each rank.
    Raises:
        ValueError: An unknown encoder_split.
    """
    if encoder_split not in ENCODER_SPLITS:
        raise ValueError(f"encoder_split must be one of {ENCODER_SPLITS}, got {encoder_split!r}")
    share = mesh.world // mesh.buckets("DP")
    rank_dp = np.zeros(mesh.world, np.int64)
    for d in range(mesh.buckets("DP")):
        rank_dp[mesh.ranks(dp=d)] = d
    backbone_flops = (plan.rank_costs() / share)[rank_dp]
    images = [s for s in plan.subplans if s.name == "images" and s.axis == "WORLD"]
    if images:
        return images[0].bucket_costs(), backbone_flops  # WORLD bucket b is rank b
    image_tokens = np.rint(plan.samples.features["image_tokens"]).astype(np.int64)
    per_sample = encoder.cost(image_tokens)
    if encoder_split == "even":
        per_dp = np.array([sum(float(per_sample[mb].sum()) for mb in rank) for rank in plan.microbatches])
        return (per_dp / share)[rank_dp], backbone_flops
    encoder_flops = np.zeros(mesh.world)
    for d, rank in enumerate(plan.microbatches):
        own = np.sort(np.concatenate(rank)) if rank else np.zeros(0, np.int64)
        with_images = own[image_tokens[own] > 0]
        ranks = np.asarray(mesh.ranks(dp=d))
        np.add.at(encoder_flops, ranks[np.arange(len(with_images)) % len(ranks)], per_sample[with_images])
    return encoder_flops, backbone_flops


def workload_stats(steps: list[tuple[np.ndarray, np.ndarray]], *, context: int, backbone: TransformerSpec = LLAMA_12B) -> dict:
    """Checks of the drawn samples of one context (see the module docstring).

    Args:
        steps: (text, image tokens) of every step drawn.
        context: The context.
        backbone: The backbone, for the encoder's FLOPs share.
    Returns:
        {"samples", "text_le_64_share", "tail_text_token_share", "tail_all_token_share",
        "mean_text_tokens", "mean_image_tokens", "text_only_share", "capped_share",
        "encoder_flops_share"}.
    """
    text = np.concatenate([t for t, _ in steps])
    image_tokens = np.concatenate([i for _, i in steps])
    tail = text > BODY_TEXT[1]
    total = text + image_tokens
    encoder_flops = float(VIT_2B.cost(image_tokens).sum())
    return {
        "samples": int(len(text)),
        "text_le_64_share": float(np.mean(~tail)),
        "tail_text_token_share": float(text[tail].sum() / text.sum()),
        "tail_all_token_share": float(text[tail].sum() / total.sum()),
        "mean_text_tokens": float(text.mean()),
        "mean_image_tokens": float(image_tokens.mean()),
        "text_only_share": float(np.mean(image_tokens == 0)),
        "capped_share": float(np.mean(total == context)),
        "encoder_flops_share": encoder_flops / (encoder_flops + float(backbone.cost(total).sum())),
    }


def load_workload(path: pathlib.Path) -> Workload:
    """Reads a --lengths file (see the module docstring).

    Raises:
        ValueError: Not integer text lengths > 0 and image tokens >= 0 of one length each.
    """
    data = np.load(path, allow_pickle=False)
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            arrays = [data[name] for name in data.files]
    elif data.ndim == 2 and data.shape[0] == 2:
        arrays = [data[0], data[1]]
    else:
        arrays = [data]
    if len(arrays) == 1:
        arrays.append(np.zeros(arrays[0].shape, np.int64))
    text, image_tokens = arrays[0], arrays[-1]
    ok = (
        len(arrays) == 2
        and all(a.ndim == 1 and np.issubdtype(a.dtype, np.integer) for a in (text, image_tokens))
        and text.size > 0
        and text.shape == image_tokens.shape
        and text.min() > 0
        and image_tokens.min() >= 0
    )
    if not ok:
        raise ValueError(
            f"--lengths {str(path)!r}: want integer text lengths > 0 (1-D .npy), or those and image "
            f"tokens >= 0 of the same length ([2, n] .npy or a .npz of one or two arrays); got "
            f"{[(str(a.dtype), a.shape) for a in arrays]}"
        )
    return Workload(text.astype(np.int64), image_tokens.astype(np.int64))


def _positive_float(text: str) -> float:
    value = float(text)
    if not np.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _fitting(workload: Workload, context: int) -> Workload:
    """The file's samples of at most `context` tokens.

    Raises:
        ValueError: None fits.
    """
    total = workload.text + workload.image_tokens
    keep = total <= context
    if not keep.any():
        raise ValueError(f"--lengths: no sample fits context {context} (the shortest has {int(total.min())} tokens)")
    return Workload(workload.text[keep], workload.image_tokens[keep])


def _own_draws(samples: SampleTable, costs: np.ndarray, mesh: ClientPlaceTree, *, microbatches: int) -> list[list[np.ndarray]]:
    """`plan_raw` of "vanilla_independent": DP bucket d gets the d-th of equal contiguous blocks
    (the samples rank d drew), split into `microbatches` contiguous microbatches."""
    blocks = np.array_split(np.arange(len(samples), dtype=np.int64), mesh.buckets("DP"))
    return [np.array_split(block, microbatches) for block in blocks]


def _measure(plan: StepPlan, mesh: ClientPlaceTree, *, flops_per_s: float, encoder_split: str = "even") -> np.ndarray:
    """[backbone max/mean, backbone max/min, encoder max/mean, simulated seconds] of one step."""
    max_over_min, max_over_mean = spread(plan.rank_costs())
    encoder_flops, backbone_flops = simulate(plan, mesh, encoder_split=encoder_split)
    _, encoder_max_over_mean = spread(encoder_flops)
    seconds = float((encoder_flops + backbone_flops).max()) / flops_per_s
    return np.array([max_over_mean, max_over_min, encoder_max_over_mean, seconds])


def _summarize(records: list[dict]) -> dict:
    """Speedups of "hybrid" and "backbone" over each vanilla and the (dp, context) cells, beside
    the paper's; the top level of each method is over "vanilla_round_robin", as before."""
    out: dict = {"paper": {"mean": PAPER["mean"], "max": PAPER["max"], "per_context": {str(c): v for c, v in PAPER["per_context"].items()}}}
    for method in ("hybrid", "backbone"):
        mine = [r for r in records if r["method"] == method]
        contexts = sorted({r["context"] for r in mine})
        over = {
            field.removeprefix("speedup_"): {
                "mean_speedup": float(np.mean([r[field] for r in mine])),
                "max_speedup": float(np.max([r[field] for r in mine])),
                "per_context": {str(c): float(np.mean([r[field] for r in mine if r["context"] == c])) for c in contexts},
            }
            for field in VANILLAS.values()
        }
        out[method] = {**over["vs_round_robin"], **over}
    return out
