"""Which TGB slices a reader rank reads at a logical step, when the journal was written for one
data mesh and is read by another (topology change at resume, BatchWeave §4.1), and how the
pieces it reads become its batch. Pure: no I/O, no clocks, no threads; numpy only.

Only the data mesh matters: DP x CP. TP and PP ranks read what their (dp, cp) coordinates read,
so changing TP or PP changes nothing. The rule, for a journal written at (D, C) and read at
(D', C'):

DP — one stream of DP slices. The written slices form one sequence, written step s, DP slice d
being number f = s * D + d. A reader's position is a `SliceCursor` (written step, offset): the
next unread slice is f0 = step * D + offset. At the logical step that starts at f0, reader DP
rank r reads slice f = f0 + r, i.e. written step f // D, DP slice f % D, and the next logical
step starts at f0 + D'. So:
- D' = D: rank r reads slice r of written step t (the journal as written);
- D' = k * D (DP grown): logical step t reads the k consecutive written steps k*t .. k*t+k-1
  (from a cursor at a step boundary); rank r reads written step k*t + r // D, slice r % D;
- D' = D / k (DP shrunk): written step s is read over k consecutive logical steps k*s .. k*s+k-1;
  at the j-th of them rank r reads slice j * D' + r (so rank r reads slices r, D' + r,
  2 * D' + r, ...: alternating slices of one written step).
Any D, D' >= 1 work the same way (the rule never needs a ratio); with an integer ratio and a
cursor at a step boundary, logical steps start and end on written step boundaries. Every written
slice is read by exactly one (logical step, DP rank) (the map f -> (f // D', f % D') is a
bijection). At the end of a finite journal, slices that do not fill a whole logical step are
not delivered (I2: every DP rank gets the same number of steps); `logical_steps` counts whole
steps.

CP — the per-token columns of one written (step, dp) are re-cut. C' = C keeps every CP slice.
Otherwise the ratio must be an integer (C' = m * C or C = m * C'), and the written slicing mode
(`contiguous` or `zigzag`, `batchplane.constructor.parallel`) must be the reader's (when both
are > 1; a CP size of 1 holds whole rows in either mode). The reader re-slices the written padded
width W (= C * the written share), never the unpadded width, so padding may exceed what a fresh
constructor would add at C'; every real token is delivered once with its original position_ids.
- contiguous, C = m * C': reader rank r = written CP slices r*m .. r*m+m-1, concatenated;
- contiguous, C' = m * C: reader rank r = piece r % m of m equal pieces of written slice r // m;
- zigzag (written rank c holds chunks c and 2C-1-c of 2C equal chunks, in that order), C = m * C':
  reader rank r = the first halves of written slices r*m .. r*m+m-1 in ascending order, then
  their second halves in descending order (= chunks r and 2C'-1-r of the reader's 2C' chunks);
- zigzag, C' = m * C: reader rank r reads written slice q = r // m only, cut into 2m pieces, and
  takes piece i = r % m and piece 2m-1-i.
Cutting a written share into pieces needs its width to divide evenly: C' = m * C under zigzag
needs W to be a multiple of 2 * C', under contiguous of C'; `assemble` refuses (TopologyError)
a layout that cannot be re-cut exactly rather than deliver other tokens. Tensors that are not
per-token (cu_seqlens, sample_*, blobs, max_seqlen) are whole on every CP slice and are taken
from the first slice read; `assemble` refuses slices in which they differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import numpy as np

from batchplane.core.errors import InvalidArgument

#: CP slicing modes (those of batchplane.constructor.parallel.CP_MODES).
CP_MODES = ("contiguous", "zigzag")


class TopologyError(InvalidArgument):
    """A topology change the journal cannot remap exactly (a CP ratio that is not an integer,
    a change of CP slicing mode, a share whose width does not divide), or a bad mesh or
    cursor; the message names the field."""


class HasDataCoords(Protocol):
    """A rank's coordinates; `batchplane.core.mesh.Coord` is one. Only dp and cp are read."""

    @property
    def dp(self) -> int: ...

    @property
    def cp(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class DataMesh:
    """The data-relevant part of a device mesh.

    Attributes:
        dp: Data-parallel size, >= 1.
        cp: Context-parallel size, >= 1.
        cp_mode: How sequences are cut over CP ranks: "zigzag" or "contiguous" (ignored when
            cp == 1).

    Raises:
        TopologyError: a size below 1 or an unknown mode.
    """

    dp: int
    cp: int = 1
    cp_mode: str = "zigzag"

    def __post_init__(self) -> None:
        for name in ("dp", "cp"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise TopologyError(f"mesh.{name}: must be an int >= 1, got {value!r}")
        if self.cp_mode not in CP_MODES:
            raise TopologyError(f"mesh.cp_mode: must be one of {', '.join(CP_MODES)}, got {self.cp_mode!r}")


@dataclasses.dataclass(frozen=True)
class SliceCursor:
    """A reader's position in the journal: the next unread DP slice is slice `offset` of
    written step `step` (number step * D + offset of the written stream). It is what a
    checkpoint records; `step` is also its retention watermark (the first written step still
    needed).

    Attributes:
        step: Written step, >= 0.
        offset: DP slices of `step` already read, in [0, written dp).
    """

    step: int
    offset: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.step) or self.step < 0:
            raise TopologyError(f"cursor.step: must be an int >= 0, got {self.step!r}")
        if not _is_int(self.offset) or self.offset < 0:
            raise TopologyError(f"cursor.offset: must be an int >= 0, got {self.offset!r}")


@dataclasses.dataclass(frozen=True)
class SliceRead:
    """One piece a reader rank reads: of the TGB of written step `step`, the slice (dp, cp);
    of its per-token tensors, pieces [first, last) of `parts` equal pieces of their width
    (axis 1). parts == 1, first == 0, last == 1 is the whole slice.
    """

    step: int
    dp: int
    cp: int
    parts: int = 1
    first: int = 0
    last: int = 1

    @property
    def key(self) -> tuple[int, int, int]:
        """(step, dp, cp): the slice to fetch; several reads may share it."""
        return self.step, self.dp, self.cp


def flat_index(cursor: SliceCursor, *, written: DataMesh) -> int:
    """The number of the next unread DP slice in the written stream (step * D + offset).

    Raises:
        TopologyError: cursor.offset >= written.dp.
    """
    if cursor.offset >= written.dp:
        raise TopologyError(f"cursor.offset: must be < the written dp {written.dp}, got {cursor.offset}")
    return cursor.step * written.dp + cursor.offset


def advance(cursor: SliceCursor, *, written: DataMesh, reader: DataMesh, steps: int = 1) -> SliceCursor:
    """The cursor after `steps` logical steps of the reader mesh.

    Args:
        cursor: Where the first of them starts.
        written: The mesh the journal was written for.
        reader: The mesh reading it.
        steps: Logical steps, >= 0.

    Returns:
        The cursor of the logical step `steps` after `cursor`.

    Raises:
        TopologyError: steps < 0 or a bad cursor.
    """
    if not _is_int(steps) or steps < 0:
        raise TopologyError(f"steps: must be an int >= 0, got {steps!r}")
    step, offset = divmod(flat_index(cursor, written=written) + steps * reader.dp, written.dp)
    return SliceCursor(step, offset)


def cursor_for(logical_step: int, *, origin_step: int, origin: SliceCursor, written: DataMesh, reader: DataMesh) -> SliceCursor:
    """The cursor of logical step `logical_step`, given that logical step `origin_step` started at
    `origin` (e.g. the resume point: the checkpoint's step and cursor).

    Raises:
        TopologyError: logical_step < origin_step or a bad cursor.
    """
    if not _is_int(logical_step) or not _is_int(origin_step) or logical_step < origin_step:
        raise TopologyError(f"logical_step: must be an int >= origin_step {origin_step!r}, got {logical_step!r}")
    return advance(origin, written=written, reader=reader, steps=logical_step - origin_step)


def written_steps(cursor: SliceCursor, *, written: DataMesh, reader: DataMesh) -> range:
    """The written steps that the logical step starting at `cursor` reads (over all its ranks):
    it can be delivered once all of them are committed.

    Raises:
        TopologyError: a bad cursor.
    """
    f0 = flat_index(cursor, written=written)
    return range(f0 // written.dp, (f0 + reader.dp - 1) // written.dp + 1)


def dp_slices(cursor: SliceCursor, *, written: DataMesh, reader: DataMesh) -> list[tuple[int, int]]:
    """The written DP slices, as (written step, dp), that the logical step starting at `cursor`
    reads over all its ranks: reader DP rank r reads the r-th (each with every CP slice of it).

    Raises:
        TopologyError: a bad cursor.
    """
    f0 = flat_index(cursor, written=written)
    return [divmod(f, written.dp) for f in range(f0, f0 + reader.dp)]


def logical_steps(cursor: SliceCursor, committed_end: int, *, written: DataMesh, reader: DataMesh) -> int:
    """How many whole logical steps, from `cursor`, the written steps below `committed_end` hold.

    Args:
        cursor: Where the first logical step starts.
        committed_end: One past the last committed written step (steps [0, committed_end)).

    Raises:
        TopologyError: a bad cursor.
    """
    left = committed_end * written.dp - flat_index(cursor, written=written)
    return max(left, 0) // reader.dp


def cp_picks(cp_rank: int, *, written: DataMesh, reader: DataMesh) -> tuple[tuple[int, int, int, int], ...]:
    """The pieces of written CP slices that reader CP rank `cp_rank` holds, in its column order.

    Args:
        cp_rank: The reader's CP rank, in [0, reader.cp).
        written: The mesh the journal was written for.
        reader: The mesh reading it.

    Returns:
        (written cp, parts, first, last) per piece: pieces [first, last) of `parts` equal
        pieces of that slice's per-token width; adjacent pieces of one slice are merged.

    Raises:
        TopologyError: a rank outside [0, reader.cp), a CP ratio that is not an integer, or
            different slicing modes (both CP sizes > 1).
    """
    c, c2 = written.cp, reader.cp
    if not _is_int(cp_rank) or not 0 <= cp_rank < c2:
        raise TopologyError(f"coord.cp: must be in [0, {c2}), got {cp_rank!r}")
    if c > 1 and c2 > 1 and written.cp_mode != reader.cp_mode:
        raise TopologyError(
            f"reader.cp_mode: the journal was cut {written.cp_mode!r} over cp={c}; reading it as {reader.cp_mode!r} "
            f"over cp={c2} would deliver other tokens to each rank; use the written mode"
        )
    mode = written.cp_mode if c > 1 else reader.cp_mode
    if c == c2:
        picks = [(cp_rank, 1, 0, 1)]
    elif c2 > c:
        if c2 % c:
            raise TopologyError(f"reader.cp: {c2} is not a multiple of the written cp {c} (nor a divisor); CP cannot be remapped exactly")
        m = c2 // c
        q, i = divmod(cp_rank, m)
        picks = [(q, m, i, i + 1)] if mode == "contiguous" else [(q, 2 * m, i, i + 1), (q, 2 * m, 2 * m - 1 - i, 2 * m - i)]
    else:
        if c % c2:
            raise TopologyError(f"reader.cp: {c2} is not a divisor of the written cp {c} (nor a multiple); CP cannot be remapped exactly")
        m = c // c2
        ranks = [cp_rank * m + j for j in range(m)]
        if mode == "contiguous":
            picks = [(w, 1, 0, 1) for w in ranks]
        else:
            picks = [(w, 2, 0, 1) for w in ranks] + [(w, 2, 1, 2) for w in reversed(ranks)]
    merged: list[tuple[int, int, int, int]] = []
    for pick in picks:
        if merged and merged[-1][:2] == pick[:2] and merged[-1][3] == pick[2]:
            merged[-1] = (*merged[-1][:3], pick[3])
        else:
            merged.append(pick)
    return tuple((w, parts, first, last) if (first, last) != (0, parts) else (w, 1, 0, 1) for w, parts, first, last in merged)


def reads_for(coord: HasDataCoords, *, cursor: SliceCursor, written: DataMesh, reader: DataMesh) -> list[SliceRead]:
    """What one reader rank reads at the logical step that starts at `cursor`.

    Args:
        coord: The rank's coordinates (only dp and cp are read: TP and PP peers read alike).
        cursor: Where the logical step starts.
        written: The mesh the journal was written for.
        reader: The mesh reading it.

    Returns:
        The pieces in the order `assemble` concatenates them; all of one written (step, dp).

    Raises:
        TopologyError: coordinates outside the reader mesh, a bad cursor, or a CP change that
            cannot be remapped (see `cp_picks`).
    """
    if not _is_int(coord.dp) or not 0 <= coord.dp < reader.dp:
        raise TopologyError(f"coord.dp: must be in [0, {reader.dp}), got {coord.dp!r}")
    step, dp = divmod(flat_index(cursor, written=written) + coord.dp, written.dp)
    return [SliceRead(step, dp, w, parts, first, last) for w, parts, first, last in cp_picks(coord.cp, written=written, reader=reader)]


def assemble(
    reads: Sequence[SliceRead],
    batches: Mapping[tuple[int, int, int], Mapping[str, np.ndarray]],
    *,
    token_names: Collection[str],
) -> dict[str, np.ndarray]:
    """A reader rank's batch from the slices it read.

    Args:
        reads: `reads_for`'s answer.
        batches: (step, dp, cp) -> that slice's batch (`tgb.decode_slice`), for every read's key.
        token_names: The per-token tensors ([rows, width, ...], cut on axis 1 by CP):
            `batchplane.constructor.parallel.TOKEN_TENSORS` and the job's declared token
            columns. Names not in the batch are ignored.

    Returns:
        Column name -> array, in the first slice's column order. With one whole-slice read,
        the slice's arrays themselves; otherwise per-token tensors are views or new arrays
        and the others are the first slice's.

    Raises:
        InvalidArgument: no reads, or a read's slice missing from `batches`.
        TopologyError: slices with different columns, a per-token tensor of fewer than two
            dimensions or whose width cannot be cut into the read's pieces, pieces that do not
            concatenate, or a tensor that is not per-token and differs between the slices.
    """
    if not reads:
        raise InvalidArgument("reads: empty")
    missing = [r.key for r in reads if r.key not in batches]
    if missing:
        raise InvalidArgument(f"batches: no batch for slices {missing[:5]}")
    first = batches[reads[0].key]
    if len(reads) == 1 and reads[0].parts == 1:
        return dict(first)
    keys = list(dict.fromkeys(r.key for r in reads))
    for key in keys[1:]:
        if set(batches[key]) != set(first):
            raise TopologyError(f"batches: slice {key} has columns {sorted(batches[key])}, slice {keys[0]} has {sorted(first)}")
    out: dict[str, np.ndarray] = {}
    for name, head in first.items():
        if name not in token_names:
            for key in keys[1:]:
                other = batches[key][name]
                if other.dtype != head.dtype or other.shape != head.shape or not np.array_equal(other, head):
                    raise TopologyError(
                        f"{name}: not a per-token tensor, yet slices {keys[0]} and {key} differ; it cannot be remapped over CP"
                    )
            out[name] = head
            continue
        pieces = []
        for read in reads:
            array = batches[read.key][name]
            if array.ndim < 2:
                raise TopologyError(
                    f"{name}: a per-token tensor must be [rows, width, ...], got shape {list(array.shape)} in slice {read.key}"
                )
            width = array.shape[1]
            if width % read.parts:
                raise TopologyError(
                    f"{name}: the written CP share of slice {read.key} is {width} columns, which cannot be cut into "
                    f"{read.parts} equal pieces; this CP change cannot be remapped exactly for this layout"
                )
            share = width // read.parts
            pieces.append(array[:, read.first * share : read.last * share])
        if len({p.dtype for p in pieces}) > 1:
            raise TopologyError(f"{name}: the CP slices hold it in different dtypes {sorted({p.dtype.name for p in pieces})}")
        if len(pieces) == 1:
            out[name] = pieces[0]
            continue
        try:
            out[name] = np.concatenate(pieces, axis=1)
        except ValueError as e:
            raise TopologyError(f"{name}: the CP slices' pieces do not concatenate: {e}") from None
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
