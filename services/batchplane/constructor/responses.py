"""Reading what the constructor's peers answer: a loader's FetchSamples stream into an Arrow
table (and its samples into `build.Fetched`), and the planner's GetPlan answer into a
`build.StepPlan` (each bucket's arrays, the secondary graphs' parts), checked by `bounds` before
anything is allocated from a peer's number or used. No calls and no sockets here: a stream is
any iterator of its messages. What does not follow the contract raises
`bounds.MalformedResponse` (an Unavailable: the step is built again from a fresh plan).

A job that declares payload columns (`batch.payload`, `batchplane.core.payload`) gets them after
input_ids, in declaration order, each of its normalized Arrow type (`payload.arrow_type`),
without nulls: a token column's list as long as the sample's input_ids times prod(shape), a
blob's a multiple of prod(shape). `sample_columns` turns them into per-sample views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchplane.constructor.bounds import (
    COLUMN_OVERHEAD_BYTES,
    COLUMN_SAMPLE_BYTES,
    MalformedResponse,
    check_bucket,
    check_fetch_header,
    check_plan_step,
    check_subplan_part,
    check_unique_samples,
    fetch_bytes_cap,
    fetch_payload_limit,
)
from batchplane.constructor.build import Bucket, Fetched, StepPlan
from batchplane.constructor.subbatch import SubPart
from batchplane.core import payload as payload_schema
from batchplane.core.digest import DTYPE as DIGEST_DTYPE
from batchplane.core.config import JobSettings
from batchplane.core.payload import PayloadColumn
from batchplane.v1 import common_pb2, loader_pb2, planner_pb2
from batchplane.wire import PayloadReceiver, WireFormatError, decode_array

#: The payload of a FetchSamples stream (loader.proto): one row per sample.
FETCH_SCHEMA = pa.schema([("source", pa.int32()), ("seq", pa.int64()), ("input_ids", pa.list_(pa.int32()))])

#: The most values a blob column holds in one payload: its list offsets are int32 (the loader
#: cannot send more; `payload.normalize` refuses more). `bounds.fetch_bytes_cap` bounds all
#: blobs together far below it.
MAX_BLOB_VALUES = 2**31 - 1


def fetch_schema(columns: Sequence[PayloadColumn] = ()) -> pa.Schema:
    """The schema of a FetchSamples payload of a job declaring `columns`."""
    return pa.schema([*FETCH_SCHEMA, *payload_schema.schema_fields(columns)])


def columns_payload_limit(columns: Sequence[PayloadColumn], *, samples: int, tokens: int) -> int:
    """The most bytes the declared `columns` may add to a FetchSamples payload of `samples`
    samples of `tokens` planned tokens: token and sample columns by their declared shapes; a
    blob, whose rows no plan bounds, by MAX_BLOB_VALUES."""
    total = 0
    for c in columns:
        values = {payload_schema.TOKEN: tokens * c.inner, payload_schema.SAMPLE: samples * c.inner}.get(c.kind, MAX_BLOB_VALUES)
        total += COLUMN_OVERHEAD_BYTES + COLUMN_SAMPLE_BYTES * samples + values * np.dtype(c.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class Wanted:
    """One step's samples asked of a loader.

    Attributes:
        sources: int32 [n], their sources.
        seqs: int64 [n], their positions.
        lengths: int32 [n], their planned token counts.
        digests: int64 [n], what their content digests to (`core.digest`); None: not checked.
    """

    sources: np.ndarray
    seqs: np.ndarray
    lengths: np.ndarray
    digests: np.ndarray | None = None


def receive_samples(
    messages: Iterator[loader_pb2.FetchSamplesResponse],
    *,
    address: str,
    wanted: Sequence[Wanted],
    columns: Sequence[PayloadColumn] = (),
    max_bytes: int | None = None,
) -> tuple[list[pa.Table], int]:
    """The samples a loader streams for a fetch of `wanted` (a step's, then those of the
    following steps asked for in the same call), one table per step it served, and the
    payload's bytes. A loader serves the first step and a prefix of the others
    (`FetchHeader.following_served`), one record batch each.

    Args:
        columns: The job's declared payload columns (`batch.payload`), which the payload must
            carry after input_ids (see the module docstring).
        max_bytes: The job's `loaders.buffer_bytes`: with declared columns the payload may take
            at most `bounds.fetch_bytes_cap` of it (None: no such cap).
    Raises:
        MalformedResponse: no header first, following steps served that were not asked for, a
            size announced past what those samples can take (before anything is allocated), a
            payload that overflows, falls short or does not parse, a record batch per step
            missing, rows of a step other than its samples asked for with their planned
            lengths, or a declared column missing, of another type, with nulls, or of lengths
            that break its kind's rule (named in the text).
        grpc.RpcError: the call failed (the caller's retry handles it).
    """
    first = next(messages, None)
    if first is None or first.WhichOneof("part") != "header":
        raise MalformedResponse("loader", address, "the stream did not start with a header")
    header = first.header
    if not 0 <= header.following_served < len(wanted):
        raise MalformedResponse("loader", address, f"following_served {header.following_served} outside [0, {len(wanted) - 1}]")
    served = wanted[: header.following_served + 1]
    samples = sum(len(w.seqs) for w in served)
    tokens = sum(int(w.lengths.astype(np.int64).sum()) for w in served)
    if columns:
        limit = fetch_payload_limit(samples=samples, tokens=tokens) + columns_payload_limit(columns, samples=samples, tokens=tokens)
        if max_bytes is not None:
            limit = min(limit, fetch_bytes_cap(buffer_bytes=max_bytes, samples=samples, columns=len(columns)))
        if not 0 <= header.payload_bytes <= limit:
            raise MalformedResponse(
                "loader",
                address,
                f"payload_bytes {header.payload_bytes} outside [0, {limit}] for {samples} samples of {tokens} tokens and columns {[c.name for c in columns]}",
            )
    # with declared columns, the size was checked just above against the larger limit
    size = 0 if columns else header.payload_bytes
    check_fetch_header(size, header.num_samples, samples=samples, tokens=tokens, peer="loader", address=address)
    buffer = bytearray(header.payload_bytes)
    receiver = PayloadReceiver(buffer)
    try:
        for message in messages:
            if message.WhichOneof("part") != "chunk":
                raise WireFormatError("a message other than a chunk after the header")
            receiver.add(message.chunk.data)
        receiver.check_complete()
        reader = pa.ipc.open_stream(pa.py_buffer(buffer))
        batches = list(reader)
    except (WireFormatError, pa.ArrowException) as exc:
        raise MalformedResponse("loader", address, str(exc)) from None
    expected = fetch_schema(columns)
    if not reader.schema.equals(expected):
        raise MalformedResponse("loader", address, _schema_problem(reader.schema, expected, columns))
    if len(batches) != len(served):
        raise MalformedResponse("loader", address, f"{len(batches)} record batches for {len(served)} steps (one per step)")
    tables = []
    for batch, step in zip(batches, served):
        table = pa.Table.from_batches([batch])
        _check_rows(table, step, address=address, columns=columns)
        tables.append(table)
    return tables, len(buffer)


def _check_rows(table: pa.Table, wanted: Wanted, *, address: str, columns: Sequence[PayloadColumn]) -> None:
    """Raises MalformedResponse unless `table` holds exactly the samples `wanted` with their
    planned lengths, and every declared column keeps its kind's rule."""
    if table.num_rows != len(wanted.seqs):
        raise MalformedResponse("loader", address, f"{table.num_rows} samples for {len(wanted.seqs)} requested")
    got_source = table.column("source").to_numpy()
    got_seq = table.column("seq").to_numpy()
    got_length = pc.list_value_length(table.column("input_ids")).fill_null(-1).to_numpy()
    mine, theirs = np.lexsort((wanted.seqs, wanted.sources)), np.lexsort((got_seq, got_source))
    if not (np.array_equal(got_source[theirs], wanted.sources[mine]) and np.array_equal(got_seq[theirs], wanted.seqs[mine])):
        raise MalformedResponse("loader", address, "samples other than those requested")
    if not np.array_equal(got_length[theirs], wanted.lengths[mine]):
        raise MalformedResponse("loader", address, "samples of other lengths than planned")
    for c in columns:
        problem = _column_problem(c, table.column(c.name).combine_chunks(), got_length)
        if problem:
            raise MalformedResponse("loader", address, f"column {c.name!r} ({c.kind} {c.dtype}{list(c.shape)}): {problem}")


def _schema_problem(got: pa.Schema, expected: pa.Schema, columns: Sequence[PayloadColumn]) -> str:
    """What is wrong with a payload's schema, naming the first declared column at fault."""
    for c in columns:
        if c.name not in got.names:
            return f"declared column {c.name!r} is missing from the payload"
        want, have = payload_schema.arrow_type(c), got.field(c.name).type
        if have != want:
            return f"column {c.name!r} is {have}, its declaration ({c.kind} {c.dtype}{list(c.shape)}) needs {want}"
    extra = [n for n in got.names if n not in expected.names]
    if extra:
        return f"columns {extra} that the job does not declare"
    return f"a payload of schema {got.to_string(show_schema_metadata=False)!r}"


def _column_problem(column: PayloadColumn, array: pa.Array, token_lengths: np.ndarray) -> str:
    """What breaks a declared column's rule in a payload whose schema is right ('' if nothing)."""
    try:
        array.validate(full=True)  # offsets within the values, rising
    except pa.ArrowInvalid as exc:
        return f"invalid: {exc}"
    if array.null_count:
        return "null samples"
    if column.kind == payload_schema.SAMPLE:
        values = array.values if column.shape else array
        return "null values" if values.null_count else ""
    if array.values.null_count:
        return "null values inside a sample's list"
    counts = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
    if column.kind == payload_schema.TOKEN:
        bad = np.flatnonzero(counts != token_lengths.astype(np.int64) * column.inner)
        if len(bad):
            i = int(bad[0])
            return f"sample {i} has {int(counts[i])} values for {int(token_lengths[i])} tokens of {column.inner} each"
        return ""
    bad = np.flatnonzero(counts % column.inner)
    if len(bad):
        i = int(bad[0])
        return f"sample {i} has {int(counts[i])} values, not a multiple of its rows of {column.inner}"
    return ""


def sample_columns(table: pa.Table, columns: Sequence[PayloadColumn]) -> dict[str, list[np.ndarray]]:
    """Per declared column, per row of a received payload, a view of that sample's values:
    [tokens, *shape] (token), [*shape] (sample) or [rows, *shape] (blob). Views into the
    payload's buffers (bool columns, bit-packed in Arrow, are unpacked once per column)."""
    out: dict[str, list[np.ndarray]] = {}
    n = table.num_rows
    for c in columns:
        values, offsets = payload_schema.values_of(c, table.column(c.name))
        if offsets is None:
            inner = c.inner
            out[c.name] = [values[i * inner : (i + 1) * inner].reshape(c.shape) for i in range(n)]
        else:
            bounds = offsets.tolist()
            out[c.name] = [values[bounds[i] : bounds[i + 1]].reshape(-1, *c.shape) for i in range(n)]
    return out


def _sample_arrays(s: common_pb2.SampleSet) -> dict[str, np.ndarray]:
    """A plan's SampleSet decoded, by field name; "samples.digest" only where the plan has
    digests (raises WireFormatError)."""
    arrays = {
        "samples.source": decode_array(s.source, field="samples.source", dtype="int32", ndim=1),
        "samples.seq": decode_array(s.seq, field="samples.seq", dtype="int64", ndim=1),
        "samples.row": decode_array(s.row, field="samples.row", dtype="int64", ndim=1),
        "samples.epoch": decode_array(s.epoch, field="samples.epoch", dtype="int32", ndim=1),
        "samples.length": decode_array(s.length, field="samples.length", dtype="int32", ndim=1),
    }
    if s.HasField("digest"):
        arrays["samples.digest"] = decode_array(s.digest, field="samples.digest", dtype=np.dtype(DIGEST_DTYPE).name, ndim=1)
    return arrays


def plan_buckets(
    plan: planner_pb2.GetPlanResponse, *, asked: int, address: str, constructors: int, max_samples: int, microbatches: int
) -> dict[int, Bucket]:
    """Each bucket's arrays of a GetPlan answer to a request for step `asked`.

    Args:
        constructors: Constructors in the job.
        max_samples: Samples one step plans (`batch.global_batch_size`).
        microbatches: Microbatches a rank has per step at least (`batch.microbatches`).
    Raises:
        MalformedResponse: another step, an oldest step past it, arrays that do not decode or
            disagree, or numbers outside what the job has (`bounds.check_bucket`).
    """
    check_plan_step(asked=asked, step=plan.step, oldest_step=plan.oldest_step, peer="planner", address=address)
    buckets: dict[int, Bucket] = {}
    for rank_plan in plan.ranks:
        s = rank_plan.samples
        try:
            arrays = {
                **_sample_arrays(s),
                "loaders": decode_array(rank_plan.loaders, field="loaders", dtype="int32", ndim=1),
            }
            offsets = decode_array(rank_plan.microbatch_offsets, field="microbatch_offsets", dtype="int64", ndim=1)
        except WireFormatError as exc:
            raise MalformedResponse("planner", address, f"bucket {rank_plan.dp_rank}: {exc}") from None
        fetchers = max(rank_plan.fetchers, 1)
        copies = _decode_optional(rank_plan, "copies", field="copies", where=f"bucket {rank_plan.dp_rank}", address=address)
        check_bucket(
            bucket=rank_plan.dp_rank,
            sizes={name: len(a) for name, a in arrays.items()},
            offsets=offsets,
            lengths=arrays["samples.length"],
            fetchers=fetchers,
            constructors=constructors,
            max_samples=max_samples,
            microbatches=microbatches,
            peer="planner",
            address=address,
            copies=copies,
        )
        n = len(arrays["samples.seq"])
        buckets[rank_plan.dp_rank] = Bucket(
            arrays["samples.source"],
            arrays["samples.seq"],
            arrays["samples.row"],
            arrays["samples.epoch"],
            arrays["samples.length"],
            offsets,
            fetchers,
            arrays["loaders"],
            copies if copies is not None else np.full(n, fetchers, np.int32),
            arrays.get("samples.digest"),
        )
    return buckets


def _decode_optional(message, name: str, *, field: str, where: str, address: str) -> np.ndarray | None:
    """An optional int32 [n] Array field of `message` (None when unset)."""
    if not message.HasField(name):
        return None
    try:
        return decode_array(getattr(message, name), field=field, dtype="int32", ndim=1)
    except WireFormatError as exc:
        raise MalformedResponse("planner", address, f"{where}: {exc}") from None


def plan_subplans(
    plan: planner_pb2.GetPlanResponse,
    *,
    address: str,
    constructors: int,
    max_samples: int,
    payload: Sequence[PayloadColumn],
    consumes: Callable[[str, int], bool],
) -> list[SubPart]:
    """The secondary graphs' parts of a GetPlan answer, decoded and checked
    (`bounds.check_subplan_part`; no sample twice in one graph's parts).

    Args:
        constructors: Constructors in the job.
        max_samples: Samples one step plans (`batch.global_batch_size`).
        payload: The job's declared payload columns (`batch.payload`).
        consumes: Whether one of this constructor's ranks consumes (axis, bucket); called only
            for an axis of `bounds.PART_AXES`.
    Raises:
        MalformedResponse: arrays that do not decode, or numbers and names outside what the job has.
    """
    kinds = {c.name: c.kind for c in payload}
    parts: list[SubPart] = []
    seen: set[tuple[str, int]] = set()
    for part in plan.subplans:
        where = f"subplan {part.name[:64]!r} bucket {part.bucket}"
        s = part.samples
        try:
            arrays = {
                **_sample_arrays(s),
                "values": decode_array(part.values, field="values", dtype="int64", ndim=1),
            }
        except WireFormatError as exc:
            raise MalformedResponse("planner", address, f"{where}: {exc}") from None
        loaders = _decode_optional(part, "loaders", field="loaders", where=where, address=address)
        copies = _decode_optional(part, "copies", field="copies", where=where, address=address)
        columns = tuple(part.columns)
        check_subplan_part(
            name=part.name,
            axis=part.axis,
            bucket=part.bucket,
            metadata=part.metadata,
            sizes={k: len(a) for k, a in arrays.items()},
            lengths=arrays["samples.length"],
            columns=columns,
            kinds=kinds,
            loaders=loaders,
            copies=copies,
            loader_count=len(plan.loader_addresses),
            constructors=constructors,
            max_samples=max_samples,
            consumed=part.axis in ("DP", "CP", "WORLD") and consumes(part.axis, part.bucket),
            peer="planner",
            address=address,
        )
        if (part.name, part.bucket) in seen:
            raise MalformedResponse("planner", address, f"{where}: the part is listed twice")
        seen.add((part.name, part.bucket))
        parts.append(
            SubPart(
                name=part.name,
                axis=part.axis,
                metadata=part.metadata,
                bucket=part.bucket,
                source=arrays["samples.source"],
                seq=arrays["samples.seq"],
                row=arrays["samples.row"],
                epoch=arrays["samples.epoch"],
                length=arrays["samples.length"],
                values=arrays["values"],
                columns=columns,
                loaders=loaders if columns else None,
                copies=copies if columns else None,
                digest=arrays.get("samples.digest"),
            )
        )
    for name in {p.name for p in parts}:
        mine = [p for p in parts if p.name == name]
        check_unique_samples(
            np.concatenate([p.source for p in mine]),
            np.concatenate([p.seq for p in mine]),
            where=f"subplan {name[:64]!r}",
            peer="planner",
            address=address,
        )
    return parts


def step_plan(
    plan: planner_pb2.GetPlanResponse, *, asked: int, address: str, job: JobSettings, consumes: Callable[[str, int], bool]
) -> StepPlan:
    """A GetPlan answer (not the end of data) to a request for step `asked`, decoded and checked
    (`plan_buckets`, `plan_subplans`).

    Args:
        job: The job's settings.
        consumes: Whether one of this constructor's ranks consumes (axis, bucket).
    Raises:
        MalformedResponse: see `plan_buckets` and `plan_subplans`.
    """
    batch, constructors = job.batch, job.constructor_count
    buckets = plan_buckets(
        plan, asked=asked, address=address, constructors=constructors, max_samples=batch.global_batch_size, microbatches=batch.microbatches
    )
    parts = plan_subplans(
        plan, address=address, constructors=constructors, max_samples=batch.global_batch_size, payload=batch.payload, consumes=consumes
    )
    return StepPlan(step=plan.step, axis=plan.axis or "DP", global_loss_tokens=plan.global_loss_tokens, buckets=buckets, parts=parts)


def fetched_samples(tables: Sequence[pa.Table], columns: Sequence[PayloadColumn]) -> Fetched:
    """The samples of received payloads (`receive_samples`) by (source, seq): each one's token
    ids and, per declared column, its view (`sample_columns`)."""
    tokens: dict[tuple[int, int], np.ndarray] = {}
    views: dict[str, dict[tuple[int, int], np.ndarray]] = {c.name: {} for c in columns}
    for table in tables:
        values = table.column("input_ids").combine_chunks()
        flat = values.values.to_numpy()
        offsets = values.offsets.to_numpy()
        keys = [(int(k), int(s)) for k, s in zip(table.column("source").to_numpy(), table.column("seq").to_numpy())]
        for i, key in enumerate(keys):
            tokens[key] = flat[offsets[i] : offsets[i + 1]]
        for name, column in sample_columns(table, columns).items():
            views[name].update(zip(keys, column))
    return Fetched(tokens, views)
