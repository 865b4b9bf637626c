"""Reading what the constructor's peers answer: a loader's FetchSamples stream into an Arrow
table, and the planner's GetPlan answer into each bucket's arrays, checked by `bounds` before
anything is allocated from a peer's number or used. No calls and no sockets here: a stream is
any iterator of its messages. What does not follow the contract raises
`bounds.MalformedResponse` (an Unavailable: the step is built again from a fresh plan).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchplane.constructor.bounds import MalformedResponse, check_bucket, check_fetch_header, check_plan_step
from batchplane.v1 import loader_pb2, planner_pb2
from batchplane.wire import PayloadReceiver, WireFormatError, decode_array

#: The payload of a FetchSamples stream (loader.proto): one row per sample.
FETCH_SCHEMA = pa.schema([("source", pa.int32()), ("seq", pa.int64()), ("input_ids", pa.list_(pa.int32()))])

#: One bucket's plan: (source int32, seq int64, row int64, epoch int32, length int32 [n],
#: microbatch offsets int64 [m + 1], fetchers, loaders int32 [n]).
Bucket = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]


def receive_samples(
    messages: Iterator[loader_pb2.FetchSamplesResponse], *, address: str, sources: np.ndarray, seqs: np.ndarray, lengths: np.ndarray
) -> tuple[pa.Table, int]:
    """The samples a loader streams for a fetch of (`sources`, `seqs`) with planned `lengths`,
    and the payload's bytes.

    Raises:
        MalformedResponse: no header first, a size announced past what those samples can take
            (before anything is allocated), a payload that overflows, falls short or does not
            parse, or rows other than the samples asked for with their planned lengths.
        grpc.RpcError: the call failed (the caller's retry handles it).
    """
    first = next(messages, None)
    if first is None or first.WhichOneof("part") != "header":
        raise MalformedResponse("loader", address, "the stream did not start with a header")
    tokens = int(lengths.astype(np.int64).sum())
    check_fetch_header(first.header.payload_bytes, first.header.num_samples, samples=len(seqs), tokens=tokens, peer="loader", address=address)
    buffer = bytearray(first.header.payload_bytes)
    receiver = PayloadReceiver(buffer)
    try:
        for message in messages:
            if message.WhichOneof("part") != "chunk":
                raise WireFormatError("a message other than a chunk after the header")
            receiver.add(message.chunk.data)
        receiver.check_complete()
        table = pa.ipc.open_stream(pa.py_buffer(buffer)).read_all()
    except (WireFormatError, pa.ArrowException) as exc:
        raise MalformedResponse("loader", address, str(exc)) from None
    if not table.schema.equals(FETCH_SCHEMA):
        raise MalformedResponse("loader", address, f"a payload of schema {table.schema.to_string(show_schema_metadata=False)!r}")
    if table.num_rows != len(seqs):
        raise MalformedResponse("loader", address, f"{table.num_rows} samples for {len(seqs)} requested")
    got_source = table.column("source").to_numpy()
    got_seq = table.column("seq").to_numpy()
    got_length = pc.list_value_length(table.column("input_ids")).fill_null(-1).to_numpy()
    mine, theirs = np.lexsort((seqs, sources)), np.lexsort((got_seq, got_source))
    if not (np.array_equal(got_source[theirs], sources[mine]) and np.array_equal(got_seq[theirs], seqs[mine])):
        raise MalformedResponse("loader", address, "samples other than those requested")
    if not np.array_equal(got_length[theirs], lengths[mine]):
        raise MalformedResponse("loader", address, "samples of other lengths than planned")
    return table, len(buffer)


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
                "samples.source": decode_array(s.source, field="samples.source", dtype="int32", ndim=1),
                "samples.seq": decode_array(s.seq, field="samples.seq", dtype="int64", ndim=1),
                "samples.row": decode_array(s.row, field="samples.row", dtype="int64", ndim=1),
                "samples.epoch": decode_array(s.epoch, field="samples.epoch", dtype="int32", ndim=1),
                "samples.length": decode_array(s.length, field="samples.length", dtype="int32", ndim=1),
                "loaders": decode_array(rank_plan.loaders, field="loaders", dtype="int32", ndim=1),
            }
            offsets = decode_array(rank_plan.microbatch_offsets, field="microbatch_offsets", dtype="int64", ndim=1)
        except WireFormatError as exc:
            raise MalformedResponse("planner", address, f"bucket {rank_plan.dp_rank}: {exc}") from None
        fetchers = max(rank_plan.fetchers, 1)
        check_bucket(
            bucket=rank_plan.dp_rank, sizes={name: len(a) for name, a in arrays.items()}, offsets=offsets, lengths=arrays["samples.length"],
            fetchers=fetchers, constructors=constructors, max_samples=max_samples, microbatches=microbatches, peer="planner", address=address,
        )
        buckets[rank_plan.dp_rank] = (
            arrays["samples.source"], arrays["samples.seq"], arrays["samples.row"], arrays["samples.epoch"], arrays["samples.length"],
            offsets, fetchers, arrays["loaders"],
        )
    return buckets
