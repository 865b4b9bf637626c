"""What a TGB slice of journal delivery holds, and how a consumer turns it back into a rank's
batch: the producer encodes one step's deliveries (`encode_step`), a consumer decodes the slice
of its rank's (dp, cp) coordinates (`decode_slice`). No I/O, no threads, no clocks.

A slice is opaque to the journal: for the (dp, cp) coordinates it belongs to, and for every
pipeline stage k of the mesh, two uint8 arrays:

    pp{k}.header        the serialized `BatchHeader` that service.batch_header makes for the
                        rank (pp=k, dp, cp, tp=0), its rank fields (step, rank, dp_rank,
                        cp_rank, tp_rank, pp_rank) zeroed and no shared-memory placement
    pp{k}.payload       that rank's payload: `batch.payload + extra`, as GetBatch streams it

and, only when the tensor-parallel peers (tp > 0) of that stage receive other bytes than tp = 0
(the trainer broadcasts over TP, `broadcast_at("TP")`), `pp{k}.peer.header` and
`pp{k}.peer.payload` for them (every tp > 0 rank of a stage gets the same bytes, I3).

Each slice's footer entry carries the meta figure `loss_tokens` (`slice_meta`): the loss tokens
of its (dp, cp) coordinates' microbatches, so that a reader on another data mesh can sum those of
every slice its logical step reads (`JournalStep.totals`) and give its ranks that step's
`global_loss_tokens` and loss weights (`with_global_loss_tokens`), not the written step's.

Decoding checks every field a hostile or corrupt object could get wrong (names, dtypes, a
header that parses, its payload size, every tensor inside the payload) and raises
`CorruptSlice` naming it; the header it returns carries the reading rank's coordinates and the
logical step, so a client sees the very header streaming delivery sends.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from google.protobuf.message import DecodeError

from batchplane.constructor.build import Delivery
from batchplane.constructor.service import batch_header
from batchplane.core.errors import FailedPrecondition, InvalidArgument
from batchplane.core.mesh import ClientPlaceTree
from batchplane.v1 import constructor_pb2

_RANK_FIELDS = ("step", "rank", "dp_rank", "cp_rank", "tp_rank", "pp_rank")
#: The meta figure of a slice's loss tokens (`slice_meta`).
LOSS_TOKENS = "loss_tokens"


class CorruptSlice(FailedPrecondition):
    """A journal slice that is not what a producer writes; the message names the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"journal slice field {field!r}: {problem}")
        self.field = field
        self.problem = problem


def slice_names(stage: int, *, peer: bool = False) -> tuple[str, str]:
    """The (header, payload) array names of pipeline stage `stage` (`peer`: of its tp > 0 ranks)."""
    base = f"pp{stage}.peer" if peer else f"pp{stage}"
    return f"{base}.header", f"{base}.payload"


def encode_step(deliveries: Mapping[int, Delivery], mesh: ClientPlaceTree) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """One step's TGB slices from every rank's delivery.

    Args:
        deliveries: Global rank -> its delivery of the step, for every rank of `mesh`.
        mesh: The job's mesh.

    Returns:
        (dp, cp) -> the slice (see the module docstring), for every coordinate of the mesh.

    Raises:
        InvalidArgument: a rank of the mesh without a delivery.
    """
    sizes = mesh.sizes
    missing = sorted(set(range(mesh.world)) - set(deliveries))
    if missing:
        raise InvalidArgument(f"deliveries: no delivery for ranks {missing[:8]} of the mesh ({mesh.describe()})")
    out: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for dp in range(sizes["dp"]):
        for cp in range(sizes["cp"]):
            arrays: dict[str, np.ndarray] = {}
            for pp in range(sizes["pp"]):
                first = deliveries[mesh.rank(pp=pp, dp=dp, cp=cp, tp=0)]
                header, payload = _encoded(first, mesh)
                names = slice_names(pp)
                arrays[names[0]], arrays[names[1]] = header, payload
                if sizes["tp"] > 1:
                    peer = deliveries[mesh.rank(pp=pp, dp=dp, cp=cp, tp=1)]
                    if not _same(peer, first):
                        peer_header, peer_payload = _encoded(peer, mesh)
                        if not (np.array_equal(peer_header, header) and np.array_equal(peer_payload, payload)):
                            names = slice_names(pp, peer=True)
                            arrays[names[0]], arrays[names[1]] = peer_header, peer_payload
            out[(dp, cp)] = arrays
    return out


def slice_meta(deliveries: Mapping[int, Delivery], mesh: ClientPlaceTree) -> dict[tuple[int, int], dict[str, int]]:
    """Each slice's meta figures: (dp, cp) -> {LOSS_TOKENS: the loss tokens of the
    microbatches of rank (pp=0, dp, cp, tp=0)}. Over a step's slices they sum to its
    `global_loss_tokens` (each CP slice counts the loss tokens of its share).

    Args:
        deliveries: As `encode_step` takes them.
        mesh: The job's mesh.
    """
    sizes = mesh.sizes
    return {
        (dp, cp): {LOSS_TOKENS: sum(int(mb.loss_tokens) for mb in deliveries[mesh.rank(pp=0, dp=dp, cp=cp, tp=0)].batch.microbatches)}
        for dp in range(sizes["dp"])
        for cp in range(sizes["cp"])
    }


def with_global_loss_tokens(header: constructor_pb2.BatchHeader, global_loss_tokens: int) -> None:
    """Makes `header` (a decoded slice's) that of a logical step of `global_loss_tokens` loss
    tokens over all its ranks: the step's figure and each microbatch's loss weight, its loss
    tokens over that figure (0 when it is 0), as a constructor computes them."""
    header.global_loss_tokens = global_loss_tokens
    for mb in header.microbatches:
        mb.loss_weight = mb.loss_tokens / global_loss_tokens if global_loss_tokens > 0 else 0.0


def decode_slice(
    arrays: Mapping[str, np.ndarray], *, rank: int, step: int, mesh: ClientPlaceTree
) -> tuple[constructor_pb2.BatchHeader, memoryview]:
    """Rank `rank`'s batch of logical step `step` from the slice of its (dp, cp) coordinates.

    Args:
        arrays: The slice as the journal reader hands it out (name -> array).
        rank: The reading rank (a global rank of `mesh`).
        step: The logical step it asked for.
        mesh: The reading job's mesh (its pp must be the written one).

    Returns:
        The header, as streaming delivery makes it for this rank and step, and the payload.

    Raises:
        CorruptSlice: a name, dtype or header that is not what a producer writes, a payload
            size other than the header's, or a tensor outside the payload.
        FailedPrecondition: a slice written for another number of pipeline stages.
    """
    coords = mesh.coords(rank)
    stages = _stages(arrays)
    if stages != mesh.sizes["pp"]:
        raise FailedPrecondition(
            f"the journal was written for {stages} pipeline stages, this job's mesh has pp={mesh.sizes['pp']} "
            f"({mesh.describe()}); journal delivery keeps PP unchanged"
        )
    names = slice_names(coords.pp, peer=True)
    if coords.tp == 0 or names[0] not in arrays:
        names = slice_names(coords.pp)
    header_array, payload_array = arrays[names[0]], arrays[names[1]]
    header_bytes = _bytes_of(header_array, names[0])
    payload = memoryview(_bytes_of(payload_array, names[1])).cast("B")
    header = constructor_pb2.BatchHeader()
    try:
        header.ParseFromString(header_bytes.tobytes())
    except DecodeError as exc:
        raise CorruptSlice(names[0], f"not a serialized BatchHeader ({exc})") from None
    if header.end_of_data or header.HasField("shm"):
        raise CorruptSlice(names[0], "a journal header never marks the end of data nor a shared-memory placement")
    if header.payload_bytes != len(payload):
        raise CorruptSlice(names[1], f"holds {len(payload)} bytes, its header says payload_bytes={header.payload_bytes}")
    _check_tensors(header, names[0])
    header.step, header.rank = step, rank
    header.dp_rank, header.cp_rank, header.tp_rank, header.pp_rank = coords.dp, coords.cp, coords.tp, coords.pp
    return header, payload


def _encoded(delivery: Delivery, mesh: ClientPlaceTree) -> tuple[np.ndarray, np.ndarray]:
    header = batch_header(delivery, mesh)
    for name in _RANK_FIELDS:
        header.ClearField(name)
    data = np.frombuffer(header.SerializeToString(deterministic=True), dtype=np.uint8)
    payload = np.empty(delivery.payload_bytes, dtype=np.uint8)
    n = len(delivery.batch.payload)
    payload[:n] = np.frombuffer(delivery.batch.payload, dtype=np.uint8)
    if delivery.extra:
        payload[n:] = np.frombuffer(delivery.extra, dtype=np.uint8)
    return data, payload


def _same(a: Delivery, b: Delivery) -> bool:
    """The same built batch handed to two ranks (TP peers share one, I3)."""
    return a.batch is b.batch and a.subbatches == b.subbatches and a.extra == b.extra


def _stages(arrays: Mapping[str, np.ndarray]) -> int:
    """The pipeline stages a slice holds, every name checked."""
    stages: set[int] = set()
    for name in arrays:
        parts = name.split(".")
        if (
            len(parts) not in (2, 3)
            or not parts[0].startswith("pp")
            or not parts[0][2:].isdigit()
            or parts[-1] not in ("header", "payload")
            or (len(parts) == 3 and parts[1] != "peer")
        ):
            raise CorruptSlice(name, "not an array name a producer writes (pp<k>[.peer].header|payload)")
        stages.add(int(parts[0][2:]))
    if not stages or stages != set(range(len(stages))):
        raise CorruptSlice("pp<k>", f"the slice holds stages {sorted(stages)}, expected 0 .. n-1")
    for k in stages:
        for peer in (False, True):
            names = slice_names(k, peer=peer)
            if (names[0] in arrays) != (names[1] in arrays) or (not peer and names[0] not in arrays):
                raise CorruptSlice(names[0], "a stage needs both its header and its payload")
    return len(stages)


def _bytes_of(array: np.ndarray, name: str) -> np.ndarray:
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise CorruptSlice(
            name,
            f"must be a 1-D uint8 array, got {getattr(array, 'dtype', type(array).__name__)} of shape {list(getattr(array, 'shape', ()))}",
        )
    return np.ascontiguousarray(array)


def _check_tensors(header: constructor_pb2.BatchHeader, field: str) -> None:
    specs = [t for mb in header.microbatches for t in mb.tensors] + [t for sb in header.subbatches for t in sb.tensors]
    for spec in specs:
        try:
            itemsize = np.dtype(spec.dtype).itemsize
        except (TypeError, ValueError):
            raise CorruptSlice(field, f"tensor {spec.name!r} has dtype {spec.dtype!r}, not a numpy dtype") from None
        if any(d < 0 for d in spec.shape) or spec.offset < 0:
            raise CorruptSlice(field, f"tensor {spec.name!r} has a negative shape or offset")
        nbytes = int(np.prod(spec.shape, dtype=object)) * itemsize
        if spec.offset + nbytes > header.payload_bytes:
            raise CorruptSlice(
                field, f"tensor {spec.name!r} ({spec.offset} + {nbytes} bytes) lies past the payload of {header.payload_bytes} bytes"
            )
