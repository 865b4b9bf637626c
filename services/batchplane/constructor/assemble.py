"""Building one rank's microbatches for one step into a single payload buffer. Pure numpy; no
I/O, no torch.

Every tensor of every microbatch is laid out at a 64-byte aligned offset of one bytearray and
written in place, so the payload is built once and streamed as it is; the client turns each
slice into a tensor without a copy.

Per microbatch of B samples padded on the right to the longest, L tokens:
- input_ids [B, L]: the tokens, `pad_id` after each sample's end;
- labels [B, L]: the next token (labels[b, t] = input_ids[b, t + 1]); `ignore_id` on each
  sample's last token and on padding, so a label never crosses a sample's end;
- attention_mask [B, L] (bool): True on real tokens;
- position_ids [B, L]: 0 .. length - 1 per sample, 0 on padding;
- sample_source, sample_row, sample_epoch, sample_length [B]: which sample each row is.
A microbatch with no samples (a filler, only in a finite job's last step) is one row of one
padding token with no label.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from batchplane.wire import align

SAMPLE_FIELDS = (("sample_source", "int32"), ("sample_row", "int64"), ("sample_epoch", "int32"), ("sample_length", "int32"))


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where a tensor lies in the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MicrobatchLayout:
    tensors: tuple[TensorLayout, ...]
    num_tokens: int
    loss_tokens: int
    filler: bool


@dataclasses.dataclass(frozen=True)
class BuiltBatch:
    """One rank's batch of one step, ready to stream."""

    step: int
    rank: int
    microbatches: tuple[MicrobatchLayout, ...]
    payload: bytearray
    global_loss_tokens: int


@dataclasses.dataclass(frozen=True)
class RankSamples:
    """One rank's samples of a step in plan order, microbatch after microbatch.

    Attributes:
        tokens: Each sample's token ids (views into the fetched payloads).
        source, row, epoch: Each sample's identity.
        offsets: Microbatch m holds samples offsets[m]:offsets[m+1].
    """

    tokens: Sequence[np.ndarray]
    source: np.ndarray
    row: np.ndarray
    epoch: np.ndarray
    offsets: np.ndarray


def assemble(
    samples: RankSamples,
    *,
    step: int,
    rank: int,
    pad_id: int,
    ignore_id: int,
    token_dtype: str,
    global_loss_tokens: int,
) -> BuiltBatch:
    """Builds one rank's microbatches of one step (see the module docstring).

    Returns:
        The batch with its payload.
    """
    lengths = np.fromiter((len(t) for t in samples.tokens), dtype=np.int32, count=len(samples.tokens))
    layouts: list[MicrobatchLayout] = []
    offset = 0
    for m in range(len(samples.offsets) - 1):
        lo, hi = int(samples.offsets[m]), int(samples.offsets[m + 1])
        rows = max(hi - lo, 1)
        width = max(int(lengths[lo:hi].max()) if hi > lo else 1, 1)
        tensors = []
        for name, dtype, shape in (
            ("input_ids", token_dtype, (rows, width)),
            ("labels", token_dtype, (rows, width)),
            ("attention_mask", "bool", (rows, width)),
            ("position_ids", token_dtype, (rows, width)),
            *((field, dtype, (hi - lo,)) for field, dtype in SAMPLE_FIELDS),
        ):
            layout = TensorLayout(name, dtype, shape, offset)
            tensors.append(layout)
            offset += align(layout.nbytes)
        layouts.append(
            MicrobatchLayout(
                tensors=tuple(tensors),
                num_tokens=int(lengths[lo:hi].sum()),
                loss_tokens=int(np.maximum(lengths[lo:hi] - 1, 0).sum()),
                filler=hi == lo,
            )
        )
    payload = bytearray(offset)
    for m, layout in enumerate(layouts):
        lo = int(samples.offsets[m])
        views = {t.name: np.frombuffer(payload, t.dtype, int(np.prod(t.shape)), t.offset).reshape(t.shape) for t in layout.tensors}
        _fill(views, samples, lo, lengths, pad_id=pad_id, ignore_id=ignore_id)
    return BuiltBatch(step, rank, tuple(layouts), payload, global_loss_tokens)


def _fill(views: dict[str, np.ndarray], samples: RankSamples, lo: int, lengths: np.ndarray, *, pad_id: int, ignore_id: int) -> None:
    ids, labels, mask, positions = views["input_ids"], views["labels"], views["attention_mask"], views["position_ids"]
    rows, width = ids.shape
    n = len(views["sample_row"])
    ids.fill(pad_id)
    labels.fill(ignore_id)
    length = lengths[lo : lo + n]
    arange = np.arange(width)
    mask[...] = arange[None, :] < length[:, None] if n else False
    positions[...] = np.where(mask, arange[None, :], 0)
    for b in range(n):
        tokens = samples.tokens[lo + b]
        ids[b, : len(tokens)] = tokens
        labels[b, : len(tokens) - 1] = tokens[1:]
    views["sample_source"][:] = samples.source[lo : lo + n]
    views["sample_row"][:] = samples.row[lo : lo + n]
    views["sample_epoch"][:] = samples.epoch[lo : lo + n]
    views["sample_length"][:] = length
