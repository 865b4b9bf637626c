"""`batchplane bench delivery`: how fast, and at what CPU cost, batch bytes reach the trainer's
tensors, beside this machine's ceilings, and the colocated-DataLoader baseline (issue 17, point 5).

Part A, transports. Two payloads, built once from `--seed` in both processes:

- tokens: `--microbatches` (default 8) padded microbatches of `--rows` x `--seq` (8 x 8192):
  input_ids, labels, position_ids (int64) and attention_mask (bool), rows of seeded lengths
  in [seq/4, seq] padded on the right (about 13 MB a batch);
- pixels: `--images` (default 32) images a batch at seeded mixed resolutions (each side one of
  224 .. 896 px, 14 px patches): pixel_values uint8 [sum of patches, 1176] (3 channels x 2
  frames x 14 x 14), image_grid_thw int64 [images, 3] and cu_seqlens int32 [images + 1]
  (about 40 MB a batch); `--distinct` different batches are cycled.

Each transport moves each payload at least `--batches` times (default 12) and for at least
`--min-round-s` seconds (default 0.25) per round; rounds alternate the transports (`--repeats`,
default 5, each in a rotated order) and the records hold the medians:

- memcpy: numpy copies the batch's payload into a buffer allocated and touched once before
  (one process; its CPU counts as the receiver's);
- grpc_stream: a plain gRPC server (generic handler, identity serializers, no interceptor) in a
  child process streams the payload as pre-built 1 MiB `bytes` chunks over a Unix socket; the
  parent writes them into one preallocated buffer: the ceiling of gRPC in Python;
- grpc: the constructor's serving path in a child process: its `ConstructorServicer` on the
  repo's server factory (`core.rpc.create_grpc_server`, trainer side, `network.tls: off`, so
  the Unix socket is plaintext; the client's channel uses local credentials, as it always does
  on a Unix socket), registered with `service.add_to_server`, over a stand-in pipeline that
  hands out pre-built `Delivery`s; received by the client's `ConstructorConnection.batch`
  without a slab session (what BATCHPLANE_SHM=0 gives) and turned into tensors by
  `client.tensors.unpack` in the parent;
- shm: the same with the client's shared-memory transport (`client.slabs`): the constructor
  copies each step's payload once into a memfd slab from its pool (the slab socket beside its
  Unix socket passes the fd once), the header names it, and the client's tensors are views of
  the mapped slab, released when dropped (before the next batch is asked for). Each step is a
  new `BuiltBatch` over the pre-built buffer, so every step is placed (copied) afresh. When the
  client gets no slab session, no shm record is written and `shm` in the result says why.

The bytes counted are those that arrive: the tensors' bytes (grpc, shm), the payload's (memcpy,
grpc_stream). CPU is user + system time of the sending child (/proc) and of this process
(getrusage) over each round. The first batch of each transport is received before the rounds
and checked byte for byte against the pre-built payload (record field `verified`).

Record fields (Part A): payload, transport, gb_per_s (1e9 bytes/s), cpu_s_per_gb (sender +
receiver), sender_cpu_s_per_gb, receiver_cpu_s_per_gb, bytes_per_batch (mean), batches (per
round, median), repeats, verified. `summary` holds, per payload, each transport's gb_per_s over memcpy's
and over grpc_stream's.

Part B, samples: `batchplane.bench.dataloader` (records with fields system, ranks,
global_batch, dp_microbatches, samples_per_s, cpu_s_per_1k_samples, cpu_ms_per_step (by
part: planner, loader, constructor, trainer; rank, worker), ...; `samples_summary` lists the
medians and ratios per rank count and step shape).
`--skip-samples` or `--skip-transports` leave one part out.

The vision-language demo path (JPEG decode and patchify) against a colocated DataLoader doing the
same work is `batchplane bench vlm`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import numpy as np

from batchplane.bench import positive_int, working_folder
from batchplane.constructor.assemble import BuiltBatch, MicrobatchLayout, lay_out, tensors_of
from batchplane.wire import CHUNK_BYTES

HELP = "GB/s and CPU/GB into the trainer's tensors (memcpy, plain gRPC stream, gRPC, shm) and samples/s against a colocated DataLoader"

PAYLOADS = ("tokens", "pixels")
#: The rank whose batches carry each payload in the stand-in constructor (a mesh of dp 2).
RANK_OF = {"tokens": 0, "pixels": 1}
PATCH = 14
PATCH_DIM = 3 * 2 * PATCH * PATCH  # channels x temporal frames x patch x patch = 1176
#: Image sides (pixels) and how often each is drawn, per side.
SIDES = (224, 336, 448, 560, 672, 896)
SIDE_WEIGHTS = (0.25, 0.25, 0.2, 0.12, 0.1, 0.08)
STREAM_METHOD = "/batchplane.bench.Stream/Get"
GB = 1e9
#: The constructor's slab pool cap (`constructors.shm_bytes`' default).
SHM_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class PayloadSettings:
    """What the payloads look like (flags of the same names)."""

    seed: int = 0
    microbatches: int = 8
    rows: int = 8
    seq: int = 8192
    images: int = 32
    distinct: int = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of every draw (default 0)")
    parser.add_argument("--microbatches", type=positive_int, default=8, help="tokens: microbatches per batch (default 8)")
    parser.add_argument("--rows", type=positive_int, default=8, help="tokens: rows per microbatch (default 8)")
    parser.add_argument("--seq", type=positive_int, default=8192, help="tokens: padded sequence length (default 8192)")
    parser.add_argument("--images", type=positive_int, default=32, help="pixels: images per batch (default 32)")
    parser.add_argument("--distinct", type=positive_int, default=2, help="different batches cycled per payload (default 2)")
    parser.add_argument("--batches", type=positive_int, default=12, help="least batches per transport per round (default 12)")
    parser.add_argument("--min-round-s", type=float, default=0.25, help="least seconds per transport per round (default 0.25)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="rounds, transports alternating (default 5)")
    parser.add_argument("--skip-transports", action="store_true", help="leave Part A (GB/s) out")
    parser.add_argument("--skip-samples", action="store_true", help="leave Part B (samples/s against the DataLoader) out")
    parser.add_argument("--dir", type=working_folder, default=None, help="working folder (default: a temporary one, removed after)")
    from batchplane.bench import dataloader  # Part B's own flags

    dataloader.add_arguments(parser)


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    settings = PayloadSettings(
        seed=args.seed, microbatches=args.microbatches, rows=args.rows, seq=args.seq, images=args.images, distinct=args.distinct
    )
    out: dict = {"records": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = pathlib.Path(tmp)
        if not args.skip_transports:
            records = measure_transports(
                settings,
                folder=root / "transports",
                batches=args.batches,
                repeats=args.repeats,
                progress=progress,
                min_round_s=args.min_round_s,
            )
            out["records"] += records
            out["summary"] = summarize(records)
            if not any(r["transport"] == "shm" for r in records):
                out["shm"] = "not measured: the client got no shared-memory session from the constructor"
        if not args.skip_samples:
            from batchplane.bench import dataloader

            samples = dataloader.run_samples(args, root / "samples", progress)
            out["records"] += samples
            out["samples_summary"] = dataloader.summarize_samples(samples)
    out["payloads"] = dataclasses.asdict(settings)
    return out


# ---- payloads ----------------------------------------------------------------------------


def build_payloads(settings: PayloadSettings) -> dict[str, list[BuiltBatch]]:
    """`settings.distinct` batches of each payload, the same for the same settings."""
    rng = np.random.default_rng(settings.seed)
    return {
        "tokens": [_tokens(rng, settings, step) for step in range(settings.distinct)],
        "pixels": [_pixels(rng, settings, step) for step in range(settings.distinct)],
    }


def _tokens(rng: np.random.Generator, s: PayloadSettings, step: int) -> BuiltBatch:
    microbatches = []
    arange = np.arange(s.seq)
    for _ in range(s.microbatches):
        lengths = rng.integers(max(s.seq // 4, 1), s.seq + 1, size=s.rows)
        mask = arange[None, :] < lengths[:, None]
        ids = np.where(mask, rng.integers(1, 50_000, size=(s.rows, s.seq)), 0)
        labels = np.full_like(ids, -100)
        labels[:, :-1] = np.where(mask[:, 1:], ids[:, 1:], -100)
        positions = np.where(mask, arange[None, :], 0)
        tensors = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": positions}
        tokens = int(lengths.sum())
        microbatches.append((tensors, MicrobatchLayout((), tokens, tokens - s.rows, False)))
    return lay_out(microbatches, step=step, rank=RANK_OF["tokens"], global_loss_tokens=sum(m.loss_tokens for _, m in microbatches))


def _pixels(rng: np.random.Generator, s: PayloadSettings, step: int) -> BuiltBatch:
    grid = rng.choice(np.array(SIDES) // PATCH, size=(s.images, 2), p=SIDE_WEIGHTS)
    thw = np.concatenate([np.ones((s.images, 1), np.int64), grid.astype(np.int64)], axis=1)
    patches = thw.prod(axis=1)
    cu = np.zeros(s.images + 1, np.int32)
    cu[1:] = np.cumsum(patches)
    pixels = np.frombuffer(rng.bytes(int(cu[-1]) * PATCH_DIM), np.uint8).reshape(int(cu[-1]), PATCH_DIM)
    tensors = {"pixel_values": pixels, "image_grid_thw": thw, "cu_seqlens": cu}
    return lay_out([(tensors, MicrobatchLayout((), 0, 0, False))], step=step, rank=RANK_OF["pixels"], global_loss_tokens=0)


def tensor_bytes(batch: BuiltBatch) -> int:
    """The bytes of a batch's tensors (its payload less alignment padding)."""
    return sum(t.nbytes for mb in batch.microbatches for t in mb.tensors)


# ---- the sending child ---------------------------------------------------------------------


class _StandInPipeline:
    """What `ConstructorServicer` uses of a `StepPipeline`, handing out pre-built payloads:
    rank RANK_OF[payload] gets batch step % distinct of that payload. Each step is a new
    `BuiltBatch` over the same payload buffer, kept until the rank asks for another step, as
    the pipeline keeps what it built: the constructor's slab pool places every step afresh (one
    copy into a slab, as for a batch just built) instead of finding it placed already."""

    def __init__(self, payloads: dict[str, list[BuiltBatch]]) -> None:
        from batchplane.core.delivery import ALL, Variant
        from batchplane.core.mesh import ClientPlaceTree

        self.mesh = ClientPlaceTree(dp=len(RANK_OF))
        self.ranks = tuple(sorted(RANK_OF.values()))
        self.batch_steps = 1  # the bench asks for one step per call
        self._batches = {RANK_OF[name]: batches for name, batches in payloads.items()}
        self._variant = Variant(bucket=0, cp_rank=None, stage=ALL, tensors=True)
        self._current: dict[int, object] = {}  # rank -> its Delivery of the step it asked for last
        self._lock = threading.Lock()

    def batch(self, rank: int, step: int, *, timeout_s: float, resume: dict, restart: bool):
        from batchplane.constructor.pipeline import Delivery

        with self._lock:
            current = self._current.get(rank)
            if current is None or current.batch.step != step:
                batches = self._batches[rank]
                built = dataclasses.replace(batches[step % len(batches)], step=step)  # the same payload buffer
                current = self._current[rank] = Delivery(batch=built, rank=rank, variant=self._variant)
            return current

    def report(self, request):  # pragma: no cover - the bench never reports
        raise NotImplementedError

    def job_length(self, *, wait_ms: int):  # pragma: no cover
        raise NotImplementedError

    def end_step(self) -> None:
        """The bench's data never ends."""
        return None

    def told_end(self, rank: int, step: int) -> int:
        """The end of data told with each batch: never known (the bench's data never ends)."""
        return 0

    def stop(self) -> None:
        pass


def _stream_server(path: str, payloads: dict[str, list[BuiltBatch]]):
    """A plain gRPC server streaming pre-built 1 MiB chunks of each payload."""
    import grpc

    chunks = {
        (name, i): [bytes(memoryview(b.payload)[o : o + CHUNK_BYTES]) for o in range(0, len(b.payload), CHUNK_BYTES)]
        for name, batches in payloads.items()
        for i, b in enumerate(batches)
    }

    def get(request: bytes, context) -> Iterator[bytes]:
        name, index = request.decode().split(":")
        yield from chunks[(name, int(index))]

    # Deliberately not core.rpc.create_grpc_server: this is the bare-gRPC ceiling the factory's
    # server (interceptor, health, security) is measured against.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.max_send_message_length", 4 << 20)])
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("batchplane.bench.Stream", {"Get": grpc.unary_stream_rpc_method_handler(get)})]
    )
    server.add_insecure_port(f"unix://{path}")
    server.start()
    return server


def _constructor_server(path: str, payloads: dict[str, list[BuiltBatch]], *, shm_bytes: int):
    """The constructor's trainer side as `constructor.server.start_constructor` wires it: its
    servicer on the repo's server factory and, with `shm_bytes`, the slab socket beside the
    Unix socket; over the stand-in pipeline. Returns what to stop."""
    from prometheus_client import CollectorRegistry

    from batchplane.constructor.metrics import ConstructorMetrics
    from batchplane.constructor.service import ConstructorServicer, add_to_server
    from batchplane.constructor.slabs import SESSIONS_PER_RANK, SlabPool, SlabServer, slab_socket_path
    from batchplane.core.rpc import RpcSettings, ServerMetrics, create_grpc_server
    from batchplane.core.tls import Security
    from batchplane.v1 import common_pb2

    registry = CollectorRegistry()
    address = f"unix://{path}"
    rpc = RpcSettings(security=Security(None), max_message_bytes=4 << 20)
    server, _, _ = create_grpc_server(rpc, host=address, port=0, metrics=ServerMetrics("constructor", registry), local=True)
    metrics = ConstructorMetrics(registry)
    pipeline = _StandInPipeline(payloads)
    slabs = None
    if shm_bytes:
        slabs = SlabServer(
            slab_socket_path(address), SlabPool(shm_bytes, metrics), max_sessions=len(pipeline.ranks) * SESSIONS_PER_RANK
        ).start()
    add_to_server(ConstructorServicer(common_pb2.JobInfo(), pipeline, metrics, slabs), server)
    server.start()
    return [lambda: server.stop(0).wait(), *([slabs.stop] if slabs is not None else [])]


def serve(folder: pathlib.Path, settings: PayloadSettings) -> None:
    """The child's work: builds the payloads, serves them on `folder`/constructor.sock and
    `folder`/stream.sock, says "ready" on stdout and serves until stdin closes."""
    payloads = build_payloads(settings)
    stream = _stream_server(str(folder / "stream.sock"), payloads)
    stops = _constructor_server(str(folder / "constructor.sock"), payloads, shm_bytes=SHM_BYTES)
    print("ready", flush=True)
    sys.stdin.read()
    stream.stop(0).wait()
    for stop in stops:
        stop()


class SenderProcess:
    """The child process serving both gRPC servers (`serve`), started and stopped by pid."""

    def __init__(self, folder: pathlib.Path, settings: PayloadSettings, *, timeout_s: float = 120.0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "batchplane.bench.delivery", str(folder), json.dumps(dataclasses.asdict(settings))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(folder / "sender.log", "wb"),
        )
        line = self.popen.stdout.readline()  # blocks until ready (or the child died)
        if line.strip() != b"ready":
            self.stop()
            raise RuntimeError(f"the sending process failed: {(folder / 'sender.log').read_text()[-2000:]}")
        self.constructor_address = f"unix://{folder / 'constructor.sock'}"
        self.stream_address = f"unix://{folder / 'stream.sock'}"

    def cpu_s(self) -> float:
        return _proc_cpu_s(self.popen.pid)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.stdin.close()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def __enter__(self) -> SenderProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads), from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- receivers -----------------------------------------------------------------------------


class Receiver:
    """One transport's receiving side: `receive(payload, step)` moves one batch into the
    trainer's memory and returns the bytes that arrived; `last` is what arrived last (tensors
    by microbatch, or the buffer)."""

    name = ""
    remote = True

    def receive(self, payload: str, step: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemcpyReceiver(Receiver):
    name, remote = "memcpy", False

    def __init__(self, payloads: dict[str, list[BuiltBatch]]) -> None:
        self._sources = {k: [np.frombuffer(b.payload, np.uint8) for b in v] for k, v in payloads.items()}
        size = max(len(b.payload) for v in payloads.values() for b in v)
        self._buffer = np.ones(size, np.uint8)  # touched: every page is faulted in
        self.last: np.ndarray | None = None

    def receive(self, payload: str, step: int) -> int:
        source = self._sources[payload][step % len(self._sources[payload])]
        np.copyto(self._buffer[: len(source)], source)
        self.last = self._buffer[: len(source)]
        return len(source)


class StreamReceiver(Receiver):
    name = "grpc_stream"

    def __init__(self, address: str, payloads: dict[str, list[BuiltBatch]]) -> None:
        import grpc

        self._sizes = {k: [len(b.payload) for b in v] for k, v in payloads.items()}
        # Deliberately not core.rpc.create_channel: the bare-gRPC baseline (see _stream_server).
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 4 << 20)])
        self._get = self._channel.unary_stream(STREAM_METHOD)  # identity serializers: bytes in, bytes out
        self._buffer = bytearray(max(max(v) for v in self._sizes.values()))
        self._view = memoryview(self._buffer)
        self.last: memoryview | None = None

    def receive(self, payload: str, step: int) -> int:
        index = step % len(self._sizes[payload])
        offset = 0
        for chunk in self._get(f"{payload}:{index}".encode(), timeout=60):
            self._view[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        if offset != self._sizes[payload][index]:
            raise RuntimeError(f"grpc_stream: {offset} bytes arrived, {self._sizes[payload][index]} were sent")
        self.last = self._view[:offset]
        return offset


class ClientReceiver(Receiver):
    """The client's receive path, as `Client` drives it: `ConstructorConnection` (its slab
    session connected after GetInfo when `shm`; `shm=False` is what BATCHPLANE_SHM=0 gives),
    `.batch()`, then `tensors.unpack` of every microbatch. The tensors of a batch are dropped
    before the next is asked for (a shared-memory slab is released once they are)."""

    def __init__(self, address: str, *, shm: bool) -> None:
        from batchplane.client.device import resolve_device
        from batchplane.client.transport import ConstructorConnection

        self.name = "shm" if shm else "grpc"
        device = resolve_device("auto")
        self._pin = device is not None and device.type == "cuda"  # as the Client does
        self._connection = ConstructorConnection(address, timeout_s=60, shm=shm, pin_slabs=False)
        self._connection.info()
        if shm and self._connection.slab_channel() is None:
            self._connection.close()
            raise ShmUnavailable(f"the client got no shared-memory session from the constructor at {address}")
        self.last: list[dict] = []

    def receive(self, payload: str, step: int) -> int:
        from batchplane.client.tensors import unpack

        self.last = []
        header, storage = self._connection.batch(RANK_OF[payload], step, pin=self._pin)
        if header.HasField("shm") != (self.name == "shm"):
            raise RuntimeError(f"{self.name}: the batch came {'through shared memory' if header.HasField('shm') else 'over gRPC'}")
        groups = [unpack(storage, mb.tensors) for mb in header.microbatches]
        del storage
        self.last = groups
        return sum(t.numel() * t.element_size() for g in groups for t in g.values())

    def close(self) -> None:
        self.last = []
        self._connection.close()


class ShmUnavailable(RuntimeError):
    """The client gets no shared-memory session from the constructor (no slab socket beside its
    Unix socket, BATCHPLANE_SHM=0, or the session was refused): shm is not measured."""


def verify(receiver: Receiver, batch: BuiltBatch) -> bool:
    """Whether what `receiver` received last is byte-identical to `batch`."""
    if isinstance(receiver, ClientReceiver):
        expected = tensors_of(batch)
        return len(expected) == len(receiver.last) and all(
            want.keys() == got.keys()
            and all(
                got[k].numpy().dtype == want[k].dtype and got[k].numpy().shape == want[k].shape and np.array_equal(got[k].numpy(), want[k])
                for k in want
            )
            for want, got in zip(expected, receiver.last)
        )
    return bytes(receiver.last) == bytes(batch.payload)


# ---- measuring -----------------------------------------------------------------------------


def measure_transports(
    settings: PayloadSettings,
    *,
    folder: pathlib.Path,
    batches: int,
    repeats: int,
    progress: Callable[[str], None],
    min_round_s: float = 0.0,
) -> list[dict]:
    """Part A: one record per (payload, transport), medians of `repeats` alternated rounds of at
    least `batches` batches and `min_round_s` seconds each."""
    payloads = build_payloads(settings)
    with SenderProcess(folder, settings) as sender:
        receivers: list[Receiver] = [
            MemcpyReceiver(payloads),
            StreamReceiver(sender.stream_address, payloads),
            ClientReceiver(sender.constructor_address, shm=False),
        ]
        try:
            receivers.append(ClientReceiver(sender.constructor_address, shm=True))
        except ShmUnavailable as exc:
            progress(f"{exc}: shm is not measured")
        verified = {}
        for receiver in receivers:
            for payload in PAYLOADS:
                receiver.receive(payload, 0)  # connections up, buffers touched
                verified[payload, receiver.name] = verify(receiver, payloads[payload][0])
        rounds: dict[tuple[str, str], list[dict]] = {key: [] for key in verified}
        for repeat in range(repeats):
            progress(f"round {repeat + 1} of {repeats}")
            order = receivers[repeat % len(receivers) :] + receivers[: repeat % len(receivers)]
            for payload in PAYLOADS:
                for receiver in order:
                    rounds[payload, receiver.name].append(_round(receiver, sender, payload, batches, min_round_s))
        for receiver in receivers:
            receiver.close()
    records = []
    for (payload, transport), measured in rounds.items():
        median = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
        records.append(
            {
                "payload": payload,
                "transport": transport,
                "gb_per_s": round(median["gb_per_s"], 4),
                "cpu_s_per_gb": round(median["sender_cpu_s_per_gb"] + median["receiver_cpu_s_per_gb"], 4),
                "sender_cpu_s_per_gb": round(median["sender_cpu_s_per_gb"], 4),
                "receiver_cpu_s_per_gb": round(median["receiver_cpu_s_per_gb"], 4),
                "bytes_per_batch": round(median["bytes_per_batch"]),
                "batches": round(median["batches"]),
                "repeats": repeats,
                "verified": verified[payload, transport],
            }
        )
        progress(f"  {payload:6s} {transport:11s} {records[-1]['gb_per_s']:6.2f} GB/s  {records[-1]['cpu_s_per_gb']:.3f} CPU s/GB")
    return records


def _round(receiver: Receiver, sender: SenderProcess, payload: str, batches: int, min_seconds: float) -> dict:
    """`receiver` moves `batches` batches of `payload`, and more until `min_seconds` passed."""
    moved = count = 0
    sent0, received0, start = sender.cpu_s(), _self_cpu_s(), time.perf_counter()
    while count < batches or time.perf_counter() - start < min_seconds:
        count += 1
        moved += receiver.receive(payload, count)
    seconds = time.perf_counter() - start
    sent = sender.cpu_s() - sent0 if receiver.remote else 0.0
    received = _self_cpu_s() - received0
    return {
        "gb_per_s": moved / GB / seconds,
        "sender_cpu_s_per_gb": sent / (moved / GB),
        "receiver_cpu_s_per_gb": received / (moved / GB),
        "bytes_per_batch": moved / count,
        "batches": count,
    }


def summarize(records: list[dict]) -> dict:
    """Per payload: each transport's gb_per_s over memcpy's and over grpc_stream's."""
    summary = {}
    for payload in PAYLOADS:
        mine = {r["transport"]: r["gb_per_s"] for r in records if r.get("payload") == payload}
        summary[payload] = {
            transport: {
                "over_memcpy": round(gb / mine["memcpy"], 4) if mine.get("memcpy") else None,
                "over_grpc_stream": round(gb / mine["grpc_stream"], 4) if mine.get("grpc_stream") else None,
            }
            for transport, gb in mine.items()
        }
    return summary


if __name__ == "__main__":  # the sending child: python -m batchplane.bench.delivery FOLDER SETTINGS_JSON
    serve(pathlib.Path(sys.argv[1]), PayloadSettings(**json.loads(sys.argv[2])))
