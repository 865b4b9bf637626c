"""The constructor's parallelism and microbatch transforms: context-parallel (CP) slicing,
sequence packing and the pipeline-parallel (PP) stage filter. Pure numpy; no I/O, no grpc, no
torch. They run for every microbatch of every step, so the per-token work is vectorized.

A microbatch is a mapping of tensor name to array. Which tensors are per token is said by name,
never inferred from a shape: the built ones (TOKEN_TENSORS: input_ids, labels, attention_mask,
position_ids, segment_ids, loss_mask, each [rows, width]) and the job's declared "token" payload
columns (`batchplane.core.payload`, [rows, width, *shape]) are laid out like input_ids and cut
on axis 1 by CP; everything else passes CP whole: per-sample metadata (sample_*, one entry per
sample), the per-sequence cu_seqlens, 0-d scalars (max_seqlen), declared "sample" columns
[samples, *shape] and "blob" columns [Σ rows, *shape] with their `<name>_offsets`. Labels are
the next token *within a sequence* (`ignore_id` on each sequence's last token and on padding);
they are computed before any slicing, so cutting the columns never changes a label.

A sequence is a sample, or under `batch.length_policy` "split" one chunk of a sample longer than
`batch.max_length` (see `batchplane.core.lengths`): the sample's consecutive chunks of at most
max_length tokens are sequences of their own (own segment, own cu_seqlens entry, positions from
0, no label across a chunk's end), while the sample_* tensors still hold one entry per sample;
`sample_chunks` says how many sequences each sample is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np

from batchplane.core.lengths import chunks as chunks_of

CP_MODES = ("contiguous", "zigzag")
TOKEN_DTYPES = ("int32", "int64")

FIRST = "first"
MIDDLE = "middle"
LAST = "last"

# What each pipeline stage gets by default, besides the per-sample metadata ("sample_*"), which
# goes to every stage. The first stage embeds the tokens and runs its attention layers. The last
# stage runs attention layers too and computes the loss, so besides labels/loss_mask it needs:
# position_ids, because rotary embeddings are applied inside every attention layer, and after CP
# slicing (or packing) the positions are neither 0..L-1 nor contiguous, so a stage cannot
# regenerate them from arange; segment_ids/cu_seqlens/max_seqlen, so that its attention layers
# keep the packed samples of a row apart and a per-sample loss can be reduced per segment.
# Middle stages get nothing by default (only activations); a model whose middle stages need
# positions or packing info for the same reason names them in `stage_filter(..., middle=...)`.
STAGE_TENSORS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        FIRST: frozenset({"input_ids", "attention_mask", "position_ids", "segment_ids", "cu_seqlens", "max_seqlen"}),
        MIDDLE: frozenset(),
        LAST: frozenset({"labels", "loss_mask", "position_ids", "segment_ids", "cu_seqlens", "max_seqlen"}),
    }
)
SAMPLE_PREFIX = "sample_"
#: The per-token tensors the constructor builds, [rows, width] like input_ids: CP slices them
#: (besides these, it slices the tensors it is given pad values for: declared token columns).
TOKEN_TENSORS = frozenset({"input_ids", "labels", "attention_mask", "position_ids", "segment_ids", "loss_mask"})
#: Every tensor the constructor builds; others (declared payload columns, a constructor_do_plan
#: hook's) go to every stage.
BUILT_TENSORS = frozenset().union(*STAGE_TENSORS.values(), {"attention_mask", "input_ids", "labels"})


# --- context parallelism ---------------------------------------------------------------------


def _check_cp(*, cp: int, mode: str) -> None:
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp!r}")
    if mode not in CP_MODES:
        raise ValueError(f"mode must be one of {', '.join(CP_MODES)}, got {mode!r}")


def cp_width(width: int, *, cp: int, mode: str) -> int:
    """The width every CP rank's share adds up to: `width` rounded up so that the ranks get
    equal shares.

    Args:
        width: The microbatch's width (columns), >= 0.
        cp: The context-parallel size, >= 1.
        mode: "contiguous" (a multiple of cp) or "zigzag" (a multiple of 2 * cp).

    Returns:
        The padded width; `width` itself when cp == 1.

    Raises:
        ValueError: for width < 0, cp < 1 or an unknown mode.
    """
    _check_cp(cp=cp, mode=mode)
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width!r}")
    if cp == 1:
        return width
    multiple = cp if mode == "contiguous" else 2 * cp
    return -(-width // multiple) * multiple


def _cp_ranges(width: int, *, cp: int, rank: int, mode: str) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(padded width, the [lo, hi) column ranges of `rank`, in the order the rank holds them)."""
    padded = cp_width(width, cp=cp, mode=mode)
    if not 0 <= rank < cp:
        raise ValueError(f"rank must be in [0, {cp}), got {rank!r}")
    if cp == 1:
        return padded, ((0, padded),)
    if mode == "contiguous":
        k = padded // cp
        return padded, ((rank * k, (rank + 1) * k),)
    k = padded // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return padded, ((rank * k, (rank + 1) * k), (mirror * k, (mirror + 1) * k))


def cp_columns(width: int, *, cp: int, rank: int, mode: str) -> np.ndarray:
    """The columns (into the padded width, `cp_width(width, ...)`) that CP rank `rank` holds.

    "contiguous": the padded width in cp equal chunks; rank i gets chunk i. "zigzag" (the
    load-balanced layout of Megatron / TransformerEngine ring attention): 2 * cp equal chunks;
    rank i gets chunk i, then chunk 2 * cp - 1 - i, so that every rank holds an early (cheap)
    and a late (expensive) part of a causal sequence.

    Balance of causal attention, a column c costing c + 1 (its query sees c + 1 keys). Zigzag,
    padded width W = 2 * cp * k, p = W - width < 2 * cp padding columns: chunk j costs
    k * k * j + k * (k + 1) / 2 and j + (2 * cp - 1 - j) is the same for every rank, so each
    rank's kernel work (padding included) is exactly k * (W + 1). Counting real columns only,
    the padding is the last p columns; for k >= 2 it lies in the ranks' second chunks, rank 0
    (holding the last chunk) loses the most, L = q * W - q * (q - 1) / 2 with q = min(p, k), so
        max / min <= k * (W + 1) / (k * (W + 1) - L) <= k / (k - q)   (q < k),
    with equality for cp >= 2 and k >= 3, and it tends to 1 as the width grows (q < 2 * cp).
    Contiguous: kernel work grows with the rank, max / min = 1 + 2 * k' * (cp - 1) / (k' + 1)
    for chunks of k' columns, i.e. close to 2 * cp - 1.

    Args:
        width: The microbatch's width before padding.
        cp: The context-parallel size.
        rank: The CP rank, in [0, cp).
        mode: "contiguous" or "zigzag".

    Returns:
        int64 column indices, cp_width(...) / cp of them, increasing within each chunk.

    Raises:
        ValueError: for width < 0, cp < 1, a rank outside [0, cp) or an unknown mode.
    """
    _, ranges = _cp_ranges(width, cp=cp, rank=rank, mode=mode)
    return np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in ranges])


def cp_slice(
    tensors: Mapping[str, np.ndarray],
    *,
    cp: int,
    rank: int,
    mode: str,
    pad_values: Mapping[str, float],
) -> dict[str, np.ndarray]:
    """CP rank `rank`'s share of a microbatch: the per-token tensors are padded on the right to
    cp_width(...) and cut to the rank's columns (`cp_columns`) on axis 1; everything else passes
    through whole.

    The per-token tensors are chosen by name, not by shape: those of TOKEN_TENSORS present in
    `tensors`, and every tensor named in `pad_values` (a job's declared token columns, a hook's
    per-token tensors). A per-token tensor is [rows, width, *inner]: a token column of shape [k]
    is [rows, width, k] and is cut on axis 1 like the others. A [samples, 3] per-sample column
    or a [patches, 1176] blob is not named, so it passes whole.

    position_ids are not renumbered: each column keeps its position in the full sequence,
    which is what rotary embeddings and the causal mask of ring attention need on a rank that
    holds non-adjacent chunks. Labels were computed on the full sequence, so the label of a
    chunk's last column is still the next token of the sequence (held by another rank), and a
    label never crosses a sample boundary. The others (sample_*, cu_seqlens, max_seqlen, sample
    and blob columns) pass through unchanged and keep describing the full rows, not the slice:
    for packed rows, the kernel masks by segment_ids (sliced like the tokens). TransformerEngine's
    THD layout, which splits every packed sequence in 2 * cp chunks of its own, is not this.

    Args:
        tensors: The microbatch; all per-token tensors share one width (axis 1).
        cp: The context-parallel size.
        rank: The CP rank, in [0, cp).
        mode: "contiguous" or "zigzag".
        pad_values: The padding of each per-token tensor by name (e.g. pad_id for input_ids,
            ignore_id for labels, False for attention_mask, 0 for position_ids/segment_ids, a
            declared token column's `fill`); a name not in `tensors` is ignored.

    Returns:
        A new dict: each per-token tensor as a new C-contiguous array [rows, cp_width(...) / cp,
        *inner] of its dtype; the other tensors as they were (the same objects).

    Raises:
        ValueError: for a bad cp, rank or mode, per-token tensors of different widths or of
            fewer than 2 dimensions, or a TOKEN_TENSORS tensor without a pad value.
    """
    missing = sorted(name for name in tensors if name in TOKEN_TENSORS and name not in pad_values)
    if missing:
        raise ValueError(f"pad_values: no pad value for {', '.join(missing)}")
    per_token = [name for name in tensors if name in pad_values]
    flat = sorted(name for name in per_token if tensors[name].ndim < 2)
    if flat:
        raise ValueError(
            f"tensors: per-token tensors must be [rows, width, ...], got {', '.join(f'{n} {list(tensors[n].shape)}' for n in flat)}"
        )
    widths = {name: tensors[name].shape[1] for name in per_token}
    if len(set(widths.values())) > 1:
        raise ValueError(f"tensors: per-token tensors must share one width, got {widths}")
    width = next(iter(widths.values()), 0)
    padded, ranges = _cp_ranges(width, cp=cp, rank=rank, mode=mode)
    share = padded // cp
    out: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        if name not in widths:
            out[name] = t
            continue
        part = np.empty((t.shape[0], share, *t.shape[2:]), dtype=t.dtype)
        at = 0
        for lo, hi in ranges:
            real = max(min(hi, width) - lo, 0)
            part[:, at : at + real] = t[:, lo : lo + real]
            part[:, at + real : at + hi - lo] = pad_values[name]
            at += hi - lo
        out[name] = part
    return out


# --- packing ---------------------------------------------------------------------------------


class TokenColumn:
    """A declared token column of a microbatch's samples, for `pack` (a `batch.payload` entry
    of kind "token", `batchplane.core.payload.PayloadColumn`, with its values; a plain class so
    that this module imports numpy only).

    Args:
        name: The tensor's name.
        dtype: Its NumPy dtype name.
        shape: The shape of one token's value: () for a scalar.
        fill: The value of padding.
        values: Per sample, its values [len(tokens[i]), *shape].
    """

    __slots__ = ("name", "dtype", "shape", "fill", "values")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], fill: float, values: Sequence[np.ndarray]) -> None:
        self.name, self.dtype, self.shape, self.fill, self.values = name, dtype, tuple(shape), fill, values


def _pack_rows(lengths: list[int], max_length: int) -> np.ndarray:
    """Next-fit in order: a sequence opens a new row when it does not fit in the current one."""
    rows = np.empty(len(lengths), dtype=np.int32)
    row, used = -1, max_length + 1  # no open row: the first sequence opens one
    for i, n in enumerate(lengths):
        if used + n > max_length:
            row, used = row + 1, 0
        used += n
        rows[i] = row
    return rows


def pack(
    tokens: Sequence[np.ndarray],
    *,
    max_length: int,
    pad_id: int,
    ignore_id: int,
    dtype: str,
    max_sample_length: int | None = None,
    length_policy: str = "split",
    columns: Sequence[TokenColumn] = (),
) -> dict[str, np.ndarray]:
    """Packs a microbatch's sequences, in order, into rows of at most `max_length` tokens.

    The sequences are the samples, except that under `length_policy` "split" a sample longer
    than `max_sample_length` is cut into ceil(L / max_sample_length) consecutive chunks of at
    most max_sample_length tokens, each a sequence of its own (`batchplane.core.lengths.chunks`).
    Going through the sequences in order, a sequence starts a new row when it does not fit in
    the current one; a sequence longer than max_length gets a row of its own (never truncated;
    only split as said). Rows are right-padded to the longest row, W. With no samples (a filler
    microbatch), the result is one row of one padding token: no label, segment 0, mask False,
    cu_seqlens [0].

    Args:
        tokens: The samples' token ids, each a non-empty 1-D integer array.
        max_length: The most tokens of a row holding more than one sequence, >= 1.
        pad_id: The token id of padding.
        ignore_id: The label of positions without a target.
        dtype: The dtype of input_ids, labels and position_ids: "int32" or "int64".
        max_sample_length: `batch.max_length`: with policy "split", longer samples are split;
            None (or another policy, which the loader applied already) splits nothing.
        length_policy: `batch.length_policy`: "split", "truncate" or "reject".
        columns: Declared token columns to carry along; each is packed exactly like input_ids,
            into [R, W, *shape] of its dtype with `fill` on padding.

    Returns:
        input_ids [R, W]; labels [R, W]: the next token within the same sequence, ignore_id on
        each sequence's last token and on padding; position_ids [R, W]: 0.. per sequence, 0 on
        padding; segment_ids [R, W] int32: 1, 2, ... per sequence within its row, 0 on padding;
        attention_mask [R, W] bool: True on real tokens; cu_seqlens int32 [Q + 1]: the Q
        sequences' offsets into input_ids[attention_mask] (the unpadded tokens, row-major), as
        varlen attention kernels take them; max_seqlen: 0-d int32, the longest sequence (0 with
        none); sample_rows int32 [S]: the row of each sample (of its first sequence);
        sample_chunks int32 [S]: the sequences of each sample (1 unless split). Without a split
        sample, sequences are samples (Q == S). Then each of `columns` by its name.

    Raises:
        ValueError: for max_length < 1, a dtype other than int32/int64, a sample that is not
            a non-empty 1-D array, max_sample_length < 1 or an unknown length_policy.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length!r}")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    for i, t in enumerate(tokens):
        if t.ndim != 1 or len(t) == 0:
            raise ValueError(f"tokens[{i}] must be a non-empty 1-D array, got shape {t.shape}")
    count = len(tokens)
    sample_lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=count)
    seqs = chunks_of(sample_lengths, max_length=max_sample_length, policy=length_policy)
    if count == 0:
        return {
            "input_ids": np.full((1, 1), pad_id, dtype=dtype),
            "labels": np.full((1, 1), ignore_id, dtype=dtype),
            "position_ids": np.zeros((1, 1), dtype=dtype),
            "segment_ids": np.zeros((1, 1), dtype=np.int32),
            "attention_mask": np.zeros((1, 1), dtype=bool),
            "cu_seqlens": np.zeros(1, dtype=np.int32),
            "max_seqlen": np.array(0, dtype=np.int32),
            "sample_rows": np.zeros(0, dtype=np.int32),
            "sample_chunks": np.zeros(0, dtype=np.int32),
            **{c.name: np.full((1, 1, *c.shape), c.fill, dtype=c.dtype) for c in columns},
        }
    lengths = seqs.lengths  # per sequence
    n_seqs = len(lengths)
    rows = _pack_rows(lengths.tolist(), max_length)
    first = np.flatnonzero(np.diff(rows, prepend=-1))  # the first sequence of each row
    row_lengths = np.add.reduceat(lengths, first)
    width = int(row_lengths.max())
    mask = np.arange(width) < row_lengths[:, None]
    # Sequences go to rows in order and a sample's chunks are consecutive, so the real tokens
    # in row-major order are the samples concatenated: every per-token array is built flat and
    # scattered by the mask.
    offsets = np.zeros(n_seqs + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    flat = np.empty(total, dtype=dtype)
    np.concatenate(tokens, out=flat, casting="unsafe")
    next_token = np.empty(total, dtype=dtype)
    next_token[:-1] = flat[1:]
    next_token[offsets[1:] - 1] = ignore_id
    segment = (np.arange(n_seqs) - first[rows] + 1).astype(np.int32)

    def scatter(values: np.ndarray, fill: int, out_dtype: str | type) -> np.ndarray:
        out = np.full(mask.shape, fill, dtype=out_dtype)
        out[mask] = values
        return out

    return {
        "input_ids": scatter(flat, pad_id, dtype),
        "labels": scatter(next_token, ignore_id, dtype),
        "position_ids": scatter(np.arange(total) - np.repeat(offsets[:-1], lengths), 0, dtype),
        "segment_ids": scatter(np.repeat(segment, lengths), 0, np.int32),
        "attention_mask": mask,
        "cu_seqlens": offsets.astype(np.int32),
        "max_seqlen": np.array(lengths.max(), dtype=np.int32),
        "sample_rows": rows[seqs.first],
        "sample_chunks": np.bincount(seqs.sample, minlength=count).astype(np.int32),
        **{c.name: _scatter_column(c, mask) for c in columns},
    }


def _scatter_column(column: TokenColumn, mask: np.ndarray) -> np.ndarray:
    """A token column packed like input_ids: the samples' values in order at the real tokens
    (row-major), `fill` elsewhere."""
    out = np.full((*mask.shape, *column.shape), column.fill, dtype=column.dtype)
    values = column.values
    out[mask] = np.concatenate(values) if len(values) > 1 else values[0]
    return out


# --- pipeline parallelism --------------------------------------------------------------------


def stage_filter(
    tensors: Mapping[str, np.ndarray],
    *,
    stage: int,
    stages: int,
    ignore_id: int,
    middle: Sequence[str] = (),
) -> dict[str, np.ndarray]:
    """The tensors pipeline stage `stage` of `stages` needs (see STAGE_TENSORS).

    The first stage gets STAGE_TENSORS["first"], the last STAGE_TENSORS["last"], middle stages
    STAGE_TENSORS["middle"] plus `middle`; every stage gets the per-sample metadata (names
    starting with "sample_") and tensors the constructor does not build (not in
    BUILT_TENSORS: the job's declared payload columns of every kind, with a blob's
    `<name>_offsets`, and a constructor_do_plan hook's tensors, which the model may need
    anywhere: a vision encoder on one stage, a per-token loss weight on the last). With one stage, it is first and last and gets every tensor. When
    the last stage needs "loss_mask" and the microbatch has labels but no loss_mask, it is
    derived: labels != ignore_id.

    Args:
        tensors: The microbatch.
        stage: The stage, in [0, stages).
        stages: The number of pipeline stages, >= 1.
        ignore_id: The label of positions without a target (for the derived loss_mask).
        middle: Extra tensors that middle stages (and only they) get.

    Returns:
        A new dict of the kept tensors (the same array objects), in input order; a derived
        loss_mask comes last.

    Raises:
        ValueError: for stages < 1 or a stage outside [0, stages).
    """
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages!r}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage!r}")
    is_first, is_last = stage == 0, stage == stages - 1
    if stages == 1:
        out = dict(tensors)
    else:
        wanted = STAGE_TENSORS[FIRST] if is_first else STAGE_TENSORS[LAST] if is_last else STAGE_TENSORS[MIDDLE] | set(middle)
        out = {name: t for name, t in tensors.items() if name in wanted or name.startswith(SAMPLE_PREFIX) or name not in BUILT_TENSORS}
    if is_last and "loss_mask" not in out and "labels" in tensors:
        out["loss_mask"] = tensors["labels"] != ignore_id
    return out
