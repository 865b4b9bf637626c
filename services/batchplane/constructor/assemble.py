"""Building one rank's microbatches for one step into a single payload buffer. Pure numpy; no
I/O, no torch.

Every tensor of every microbatch is laid out at a 64-byte aligned offset of one bytearray and
written in place, so the payload is built once and streamed as it is; the client turns each
slice into a tensor without a copy.

Per microbatch of B samples laid out as R rows padded on the right to the longest, L tokens:
- input_ids [R, L]: the tokens, `pad_id` after each row's end;
- labels [R, L]: the next token (labels[r, t] = input_ids[r, t + 1]); `ignore_id` on each
  row's last token and on padding, so a label never crosses a sample's (or chunk's) end;
- attention_mask [R, L] (bool): True on real tokens;
- position_ids [R, L]: 0 .. length - 1 per row, 0 on padding;
- sample_source, sample_row, sample_epoch, sample_length [B]: which sample each is, one entry
  per sample (sample_length is the sample's whole length, split or not);
- sample_chunks [B] (int32, only when the job splits: `max_length` set and `length_policy`
  "split"): the rows (packed: the sequences) each sample is laid out as.
Each sample is one row (R == B, row b is sample b), except under `length_policy` "split": a
sample longer than `max_length` is cut into ceil(length / max_length) consecutive chunks of at
most max_length tokens (`batchplane.core.lengths.chunks`), each a row of its own with positions
from 0 and no label across its end, so R == sample_chunks.sum() and sample b's rows start at
row sample_chunks[:b].sum(). Under "truncate" and "reject" the loader already made every sample
at most max_length tokens long: nothing is split here.
A microbatch with no samples (a filler, only in a finite job's last step) is one row of one
padding token with no label. With packing (`pack_length`), a microbatch's sequences are
concatenated into rows instead (see `parallel.pack`: segment_ids, cu_seqlens, max_seqlen).

Then the job's declared payload columns (`batch.payload`, `batchplane.core.payload`), in
declaration order, each of its declared dtype, by its kind:
- token: <name> [R, L, *shape] (just [R, L] for shape ()), laid out exactly like input_ids:
  row r, token t holds the value of the token input_ids[r, t] is (split and packed alike),
  `fill` on padding (and, in a filler, its one padding token);
- sample: <name> [B, *shape]: sample b's value at b;
- blob: <name> [Σ rows, *shape], the samples' rows one after another, and <name>_offsets int32
  [B + 1]: sample b's rows are offsets[b]:offsets[b + 1] (a filler: [0, *shape] and [0]).
Each is written once, straight into its place in the payload: a blob's rows are copied from the
fetched buffer into their slice, never concatenated first. `BuiltBatch.token_columns` names the
per-token ones (and hooks' per-token tensors) with their padding, which is what CP slices
besides the built per-token tensors; sample and blob columns pass CP whole.

Each microbatch carries its loss weight t / T: its loss tokens over the step's. A sample's loss
tokens are its length minus its rows (`batchplane.core.lengths.loss_tokens`), which is what the
planner's `StepPlan.loss_tokens` (T) counts too, so the weights of a step sum to 1.

`derive` makes a rank's variant of a built batch (its CP slice, its pipeline stage's part) as a
new payload; ranks whose variant is the whole batch share the built one (TP peers, I3).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np

from batchplane.constructor.parallel import TOKEN_TENSORS, TokenColumn, cp_slice, pack, stage_filter
from batchplane.core.lengths import Chunks, chunks, loss_tokens, splits
from batchplane.core.payload import SAMPLE, TOKEN, PayloadColumn
from batchplane.wire import align

SAMPLE_FIELDS = (("sample_source", "int32"), ("sample_row", "int64"), ("sample_epoch", "int32"), ("sample_length", "int32"))
#: The per-sample field a job that splits samples gets besides SAMPLE_FIELDS.
CHUNKS_FIELD = ("sample_chunks", "int32")


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where a tensor lies in the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MicrobatchLayout:
    tensors: tuple[TensorLayout, ...]
    num_tokens: int
    loss_tokens: int
    filler: bool
    #: loss_tokens / the step's loss tokens over all ranks.
    loss_weight: float = 0.0


@dataclasses.dataclass(frozen=True)
class BuiltBatch:
    """One rank's batch of one step, ready to stream."""

    step: int
    rank: int
    microbatches: tuple[MicrobatchLayout, ...]
    payload: bytearray
    global_loss_tokens: int
    #: The per-token tensors besides the built ones (TOKEN_TENSORS), by name, with the value
    #: that pads them: declared token columns (their `fill`) and a hook's per-token tensors (0).
    #: CP slices these and the built ones; every other tensor passes whole.
    token_columns: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RankSamples:
    """One rank's samples of a step in plan order, microbatch after microbatch.

    Attributes:
        tokens: Each sample's token ids (views into the fetched payloads).
        source, row, epoch: Each sample's identity.
        offsets: Microbatch m holds samples offsets[m]:offsets[m+1].
        columns: The job's declared payload columns by name, per sample a view into the
            fetched payload shaped [tokens, *shape] (token), [*shape] (sample) or
            [rows, *shape] (blob).
    """

    tokens: Sequence[np.ndarray]
    source: np.ndarray
    row: np.ndarray
    epoch: np.ndarray
    offsets: np.ndarray
    columns: Mapping[str, Sequence[np.ndarray]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A tensor given as parts that follow each other along axis 0 (a blob's samples' rows),
    which `lay_out` copies straight into their places in the payload, with no concatenated copy
    first."""

    dtype: np.dtype
    shape: tuple[int, ...]
    parts: Sequence[np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * self.dtype.itemsize


def _write(view: np.ndarray, value: np.ndarray | Pieces) -> None:
    """Writes a tensor (or its pieces, one after another) into its view of the payload."""
    if not isinstance(value, Pieces):
        view[...] = value
        return
    at = 0
    for part in value.parts:
        view[at : at + len(part)] = part
        at += len(part)


def _whole_columns(samples: RankSamples, payload: Sequence[PayloadColumn], lo: int, hi: int) -> dict[str, np.ndarray | Pieces]:
    return whole_columns(samples.columns, payload, lo, hi)


def whole_columns(
    columns: Mapping[str, Sequence[np.ndarray]], payload: Sequence[PayloadColumn], lo: int, hi: int
) -> dict[str, np.ndarray | Pieces]:
    """Samples lo:hi's sample and blob columns of `payload` (blob offsets after their blob), in
    its order, as pieces of the per-sample views `columns[name]` (nothing is copied here).

    Raises:
        ValueError: a blob of 2**31 rows or more (its offsets are int32).
    """
    out: dict[str, np.ndarray | Pieces] = {}
    for c in payload:
        if c.kind == TOKEN:
            continue
        views = columns[c.name][lo:hi]
        if c.kind == SAMPLE:
            out[c.name] = Pieces(np.dtype(c.dtype), (hi - lo, *c.shape), [v.reshape(1, *c.shape) for v in views])
            continue
        rows = np.zeros(hi - lo + 1, np.int64)
        np.cumsum(np.fromiter((len(v) for v in views), np.int64, count=hi - lo), out=rows[1:])
        if rows[-1] >= 2**31:
            raise ValueError(f"column {c.name!r}: {int(rows[-1])} rows in one microbatch; its offsets are int32")
        out[c.name] = Pieces(np.dtype(c.dtype), (int(rows[-1]), *c.shape), views)
        out[c.offsets_name] = rows.astype(np.int32)
    return out


def _check_columns(samples: RankSamples, payload: Sequence[PayloadColumn]) -> None:
    for c in payload:
        got = samples.columns.get(c.name)
        if got is None or len(got) != len(samples.tokens):
            raise ValueError(
                f"samples.columns: declared column {c.name!r} needs one view per sample ({len(samples.tokens)}), got {None if got is None else len(got)}"
            )


def _token_fills(payload: Sequence[PayloadColumn]) -> Mapping[str, float]:
    return MappingProxyType({c.name: c.fill for c in payload if c.kind == TOKEN})


def assemble(
    samples: RankSamples,
    *,
    step: int,
    rank: int,
    pad_id: int,
    ignore_id: int,
    token_dtype: str,
    global_loss_tokens: int,
    pack_length: int | None = None,
    max_length: int | None = None,
    length_policy: str = "split",
    payload: Sequence[PayloadColumn] = (),
) -> BuiltBatch:
    """Builds one rank's (bucket's) microbatches of one step (see the module docstring).

    Args:
        pack_length: Pack samples into rows of at most this many tokens; None pads each
            sample to the microbatch's longest.
        max_length: The job's `batch.max_length` (`JobSettings.max_length`); None: no limit.
        length_policy: The job's `batch.length_policy`; only "split" changes what is built
            here (a sample longer than max_length becomes several rows or sequences).
        payload: The job's declared columns (`batch.payload`), each in `samples.columns`.
    Returns:
        The batch with its payload.
    Raises:
        ValueError: max_length < 1, an unknown length_policy, or a declared column missing
            from `samples.columns`.
    """
    _check_columns(samples, payload)
    if pack_length is not None:
        return _assemble_packed(
            samples,
            step=step,
            rank=rank,
            pad_id=pad_id,
            ignore_id=ignore_id,
            token_dtype=token_dtype,
            global_loss_tokens=global_loss_tokens,
            pack_length=pack_length,
            payload=payload,
            max_length=max_length,
            policy=length_policy,
        )
    token_columns = [c for c in payload if c.kind == TOKEN]
    fields = (*SAMPLE_FIELDS, CHUNKS_FIELD) if splits(max_length=max_length, policy=length_policy) else SAMPLE_FIELDS
    lengths = np.fromiter((len(t) for t in samples.tokens), dtype=np.int32, count=len(samples.tokens))
    layouts: list[MicrobatchLayout] = []
    pieces: list[tuple[Chunks, dict[str, np.ndarray | Pieces]]] = []
    offset = 0
    for m in range(len(samples.offsets) - 1):
        lo, hi = int(samples.offsets[m]), int(samples.offsets[m + 1])
        seqs = chunks(lengths[lo:hi], max_length=max_length, policy=length_policy)
        rows = max(len(seqs), 1)
        width = max(int(seqs.lengths.max()) if hi > lo else 1, 1)
        whole = _whole_columns(samples, payload, lo, hi)
        tensors: list[TensorLayout] = []
        for name, dtype, shape in (
            ("input_ids", token_dtype, (rows, width)),
            ("labels", token_dtype, (rows, width)),
            ("attention_mask", "bool", (rows, width)),
            ("position_ids", token_dtype, (rows, width)),
            *((field, dtype, (hi - lo,)) for field, dtype in fields),
            *((c.name, c.dtype, (rows, width, *c.shape)) for c in token_columns),
            *((name, np.dtype(t.dtype).name, tuple(t.shape)) for name, t in whole.items()),
        ):
            spec = TensorLayout(name, dtype, shape, offset)
            tensors.append(spec)
            offset += align(spec.nbytes)
        loss = loss_tokens(lengths[lo:hi], max_length=max_length, policy=length_policy)
        layouts.append(
            MicrobatchLayout(
                tensors=tuple(tensors),
                num_tokens=int(lengths[lo:hi].sum()),
                loss_tokens=loss,
                filler=hi == lo,
                loss_weight=_weight(loss, global_loss_tokens),
            )
        )
        pieces.append((seqs, whole))
    buffer = bytearray(offset)
    for m, (layout, (seqs, whole)) in enumerate(zip(layouts, pieces)):
        lo = int(samples.offsets[m])
        views = {t.name: np.frombuffer(buffer, t.dtype, int(math.prod(t.shape)), t.offset).reshape(t.shape) for t in layout.tensors}
        columns = [(views[c.name], samples.columns[c.name], c.fill) for c in token_columns]
        _fill(views, samples, lo, lengths, seqs, pad_id=pad_id, ignore_id=ignore_id, columns=columns)
        for name, value in whole.items():
            _write(views[name], value)
    return BuiltBatch(step, rank, tuple(layouts), buffer, global_loss_tokens, _token_fills(payload))


def _fill(
    views: dict[str, np.ndarray],
    samples: RankSamples,
    lo: int,
    lengths: np.ndarray,
    seqs: Chunks,
    *,
    pad_id: int,
    ignore_id: int,
    columns: Sequence[tuple[np.ndarray, Sequence[np.ndarray], float]] = (),
) -> None:
    """Writes one padded microbatch: row r is chunk r of `seqs` (the samples themselves when
    nothing is split); `columns` are the token columns as (view, per-sample values, fill),
    written row for row like input_ids."""
    ids, labels, mask, positions = views["input_ids"], views["labels"], views["attention_mask"], views["position_ids"]
    rows, width = ids.shape
    n = len(views["sample_row"])
    ids.fill(pad_id)
    labels.fill(ignore_id)
    for view, _, fill in columns:
        view.fill(fill)
    arange = np.arange(width)
    mask[...] = arange[None, :] < seqs.lengths[:, None] if n else False
    positions[...] = np.where(mask, arange[None, :], 0)
    for r, (b, start, size) in enumerate(zip(seqs.sample.tolist(), seqs.start.tolist(), seqs.lengths.tolist())):
        tokens = samples.tokens[lo + b][start : start + size]
        ids[r, :size] = tokens
        if size:
            labels[r, : size - 1] = tokens[1:]
        for view, values, _ in columns:
            view[r, :size] = values[lo + b][start : start + size]
    views["sample_source"][:] = samples.source[lo : lo + n]
    views["sample_row"][:] = samples.row[lo : lo + n]
    views["sample_epoch"][:] = samples.epoch[lo : lo + n]
    views["sample_length"][:] = lengths[lo : lo + n]
    if "sample_chunks" in views:
        views["sample_chunks"][:] = np.bincount(seqs.sample, minlength=n)


def _weight(loss_tokens: int, global_loss_tokens: int) -> float:
    return loss_tokens / global_loss_tokens if global_loss_tokens > 0 else 0.0


def metadata_only(
    *,
    step: int,
    rank: int,
    lengths: np.ndarray,
    offsets: np.ndarray,
    global_loss_tokens: int,
    max_length: int | None = None,
    length_policy: str = "split",
) -> BuiltBatch:
    """A bucket's microbatches without tensors (none of a pod's ranks gets its data): token
    counts and loss weights from the planned lengths alone, `max_length` and `length_policy`
    as in `assemble`."""
    layouts = []
    for m in range(len(offsets) - 1):
        part = lengths[int(offsets[m]) : int(offsets[m + 1])].astype(np.int64)
        loss = loss_tokens(part, max_length=max_length, policy=length_policy)
        layouts.append(MicrobatchLayout((), int(part.sum()), loss, len(part) == 0, _weight(loss, global_loss_tokens)))
    return BuiltBatch(step, rank, tuple(layouts), bytearray(), global_loss_tokens)


def _sample_fields(samples: RankSamples, lo: int, hi: int, lengths: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "sample_source": samples.source[lo:hi].astype(np.int32),
        "sample_row": samples.row[lo:hi].astype(np.int64),
        "sample_epoch": samples.epoch[lo:hi].astype(np.int32),
        "sample_length": lengths[lo:hi].astype(np.int32),
    }


def _assemble_packed(
    samples: RankSamples,
    *,
    step: int,
    rank: int,
    pad_id: int,
    ignore_id: int,
    token_dtype: str,
    global_loss_tokens: int,
    pack_length: int,
    max_length: int | None,
    policy: str,
    payload: Sequence[PayloadColumn],
) -> BuiltBatch:
    lengths = np.fromiter((len(t) for t in samples.tokens), dtype=np.int32, count=len(samples.tokens))
    split = splits(max_length=max_length, policy=policy)
    microbatches: list[tuple[Mapping[str, np.ndarray | Pieces], MicrobatchLayout]] = []
    for m in range(len(samples.offsets) - 1):
        lo, hi = int(samples.offsets[m]), int(samples.offsets[m + 1])
        token_columns = [TokenColumn(c.name, c.dtype, c.shape, c.fill, samples.columns[c.name][lo:hi]) for c in payload if c.kind == TOKEN]
        tensors: dict[str, np.ndarray | Pieces] = dict(
            pack(
                samples.tokens[lo:hi],
                max_length=pack_length,
                pad_id=pad_id,
                ignore_id=ignore_id,
                dtype=token_dtype,
                max_sample_length=max_length,
                length_policy=policy,
                columns=token_columns,
            )
        )
        tensors.pop("sample_rows")
        sample_chunks = tensors.pop("sample_chunks")
        packed_columns = {c.name: tensors.pop(c.name) for c in token_columns}
        tensors.update(_sample_fields(samples, lo, hi, lengths))
        if split:
            tensors["sample_chunks"] = sample_chunks
        tensors.update(packed_columns)
        tensors.update(_whole_columns(samples, payload, lo, hi))
        loss = loss_tokens(lengths[lo:hi], max_length=max_length, policy=policy)
        meta = MicrobatchLayout((), int(lengths[lo:hi].sum()), loss, hi == lo, _weight(loss, global_loss_tokens))
        microbatches.append((tensors, meta))
    return lay_out(microbatches, step=step, rank=rank, global_loss_tokens=global_loss_tokens, token_columns=_token_fills(payload))


def lay_out(
    microbatches: Sequence[tuple[Mapping[str, np.ndarray | Pieces], MicrobatchLayout]],
    *,
    step: int,
    rank: int,
    global_loss_tokens: int,
    token_columns: Mapping[str, float] = MappingProxyType({}),
) -> BuiltBatch:
    """Copies microbatches (tensors by name, or `Pieces` of them, and their metadata) into one
    aligned payload; `token_columns` becomes the batch's (see BuiltBatch)."""
    layouts = []
    offset = 0
    for tensors, meta in microbatches:
        specs = []
        for name, array in tensors.items():
            specs.append(TensorLayout(name, np.dtype(array.dtype).name, tuple(array.shape), offset))
            offset += align(array.nbytes)
        layouts.append(dataclasses.replace(meta, tensors=tuple(specs)))
    payload = bytearray(offset)
    for (tensors, _), layout in zip(microbatches, layouts):
        for spec, array in zip(layout.tensors, tensors.values()):
            size = int(math.prod(spec.shape))
            _write(np.frombuffer(payload, spec.dtype, size, spec.offset).reshape(spec.shape), array)
    return BuiltBatch(step, rank, tuple(layouts), payload, global_loss_tokens, MappingProxyType(dict(token_columns)))


def tensors_of(batch: BuiltBatch) -> list[dict[str, np.ndarray]]:
    """Read-only views of every microbatch's tensors in a built batch."""
    view = memoryview(batch.payload)
    return [
        {t.name: np.frombuffer(view, t.dtype, int(math.prod(t.shape)), t.offset).reshape(t.shape) for t in mb.tensors}
        for mb in batch.microbatches
    ]


def derive(
    batch: BuiltBatch,
    *,
    cp: int = 1,
    cp_rank: int | None = None,
    cp_mode: str = "zigzag",
    stage: int = 0,
    stages: int = 1,
    middle: Sequence[str] = (),
    with_tensors: bool = True,
    pad_id: int,
    ignore_id: int,
) -> BuiltBatch:
    """A rank's variant of a bucket's batch: its CP slice of every per-token tensor (the built
    ones of TOKEN_TENSORS and the batch's `token_columns`, by name; position ids of the full
    sequence; sample and blob columns whole), then what its pipeline stage needs (declared
    columns go to every stage); `with_tensors=False` keeps only the microbatches' metadata (a
    rank the trainer broadcasts to).

    Loss tokens and weights are those of the slice the rank computes a loss on (the whole
    microbatch without CP).
    """
    pads: dict[str, float] = {
        "input_ids": pad_id,
        "labels": ignore_id,
        "attention_mask": False,
        "position_ids": 0,
        "segment_ids": 0,
        "loss_mask": False,
    }
    out: list[tuple[Mapping[str, np.ndarray | Pieces], MicrobatchLayout]] = []
    for tensors, meta in zip(tensors_of(batch), batch.microbatches):
        if not with_tensors:
            out.append(({}, meta))
            continue
        if cp_rank is not None:
            pad_values = {k: pads[k] for k in tensors if k in TOKEN_TENSORS}
            pad_values.update((k, v) for k, v in batch.token_columns.items() if k in tensors)
            tensors = cp_slice(tensors, cp=cp, rank=cp_rank, mode=cp_mode, pad_values=pad_values)
            loss_tokens = int(np.count_nonzero(tensors["labels"] != ignore_id))
            meta = dataclasses.replace(
                meta,
                loss_tokens=loss_tokens,
                num_tokens=int(np.count_nonzero(tensors["attention_mask"])),
                loss_weight=_weight(loss_tokens, batch.global_loss_tokens),
            )
        tensors = stage_filter(tensors, stage=stage, stages=stages, ignore_id=ignore_id, middle=middle)
        out.append((tensors, meta))
    return lay_out(out, step=batch.step, rank=batch.rank, global_loss_tokens=batch.global_loss_tokens, token_columns=batch.token_columns)
