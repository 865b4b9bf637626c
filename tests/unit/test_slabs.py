"""The constructor's shared-memory slabs: the pure bookkeeping (size classes, reuse, the cap,
who holds what), the pool's placements, the bounds on a request's shared-memory fields, and a
slab's fd passed to another process giving byte-identical views."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time

import grpc
import pytest

from batchplane.constructor.bounds import MAX_RELEASED_SLABS, check_released_slabs
from batchplane.constructor.slabs import FULL, MIN_SLAB_BYTES, TOO_LARGE, Session, SlabBook, SlabPool, SlabServer, size_class
from batchplane.core.errors import InvalidArgument
from batchplane.core.rpc import status_of
from batchplane.v1 import common_pb2, constructor_pb2
from batchplane.wire import chunk_messages

MiB = 1 << 20


@pytest.mark.parametrize(
    ("nbytes", "size"), [(0, MiB), (1, MiB), (MiB, MiB), (MiB + 1, 2 * MiB), (3 * MiB, 4 * MiB), (4 * MiB, 4 * MiB), (5 * MiB, 8 * MiB)]
)
def test_size_classes_are_powers_of_two_from_one_mib(nbytes: int, size: int) -> None:
    assert size_class(nbytes) == size


def test_a_slab_is_reused_once_its_batch_is_gone_and_no_session_holds_it() -> None:
    book = SlabBook(16 * MiB)
    first = book.acquire(MiB // 2)
    assert first.new and first.size == MIN_SLAB_BYTES
    book.hold(first.slab, "s")
    assert not book.disown(first.slab)  # still held by the session
    assert book.acquire(MiB).slab != first.slab
    assert book.release(first.slab, "s")  # now free
    again = book.acquire(100)
    assert (again.slab, again.new) == (first.slab, False)
    assert book.allocated_bytes == 2 * MiB


def test_a_session_that_ends_releases_its_slabs() -> None:
    book = SlabBook(16 * MiB)
    a, b = book.acquire(MiB), book.acquire(MiB)
    for s in (a, b):
        book.hold(s.slab, "gone")
        book.hold(s.slab, "other") if s is b else None
        book.disown(s.slab)
    assert book.end_session("gone") == [a.slab]  # b is still held by the other session
    assert book.free_slabs() == 1
    assert book.holds(b.slab, "other") and not book.holds(b.slab, "gone")


def test_the_cap_refuses_and_free_slabs_of_other_sizes_make_room() -> None:
    book = SlabBook(4 * MiB)
    assert book.acquire(5 * MiB) == TOO_LARGE
    small = [book.acquire(MiB) for _ in range(4)]
    assert book.acquire(MiB) == FULL  # all busy
    for s in small[:2]:
        book.disown(s.slab)
    big = book.acquire(2 * MiB)  # two free 1 MiB slabs are destroyed for it
    assert big.new and sorted(big.retire) == sorted(s.slab for s in small[:2])
    assert book.allocated_bytes == 4 * MiB == book.cap_bytes
    assert book.slabs == 3


@dataclasses.dataclass(frozen=True)
class Built:  # stands for the pipeline's BuiltBatch: frozen, holding a bytearray (unhashable)
    payload: bytearray


def _session() -> Session:
    return Session(None)  # type: ignore[arg-type] - placements never send


def test_ranks_served_the_same_batch_share_its_slab_and_it_is_reused_after() -> None:
    pool = SlabPool(8 * MiB)
    batch = Built(bytearray(os.urandom(3000)))
    one, two = _session(), _session()
    for s in (one, two):
        pool.open_session(s)
    a = pool.place(batch, b"extra", one)
    b = pool.place(batch, b"extra", two)
    assert a == b and a.length == 3005
    c = pool.place(batch, b"other", two)  # another rank's extra bytes: a slab of its own
    assert c.slab != a.slab
    slab = pool._slabs[a.slab]
    assert bytes(slab.map[: a.length]) == bytes(batch.payload) + b"extra"
    del batch
    gc.collect()
    newer = Built(bytearray(b"n" * 64))
    pool.release(one, [a.slab])
    assert pool.place(newer, b"", one).slab not in (a.slab, c.slab)  # a is still held by two
    pool.release(two, [a.slab, c.slab])
    reused = pool.place(Built(bytearray(b"r" * 128)), b"", one)
    assert reused.slab in (a.slab, c.slab)
    assert bytes(pool._slabs[reused.slab].map[:128]) == b"r" * 128
    pool.close()


def test_a_pool_past_its_cap_refuses_so_the_batch_goes_over_grpc() -> None:
    pool = SlabPool(2 * MiB)
    s = _session()
    pool.open_session(s)
    kept = [Built(bytearray(MiB)) for _ in range(3)]
    assert pool.place(kept[0], b"", s).slab and pool.place(kept[1], b"", s).slab
    assert pool.place(kept[2], b"", s) == FULL
    assert pool.place(Built(bytearray(3 * MiB)), b"", s) == TOO_LARGE
    pool.end_session(s)
    pool.close()


def test_released_slabs_are_bounded_and_must_be_held() -> None:
    held = {3, 4}
    check_released_slabs([3, 4], session="ab" * 16, holds=held.__contains__)
    check_released_slabs([99], session="unknown", holds=None)  # an unknown session: served over gRPC
    cases = [
        ([5], "ab" * 16, held.__contains__, "not held"),
        ([3, 3], "ab" * 16, held.__contains__, "repeated"),
        (list(range(MAX_RELEASED_SLABS + 1)), "ab" * 16, None, "at most"),
        ([], "x" * 33, None, "shm_session"),
    ]
    for released, session, holds, message in cases:
        with pytest.raises(InvalidArgument, match=message) as caught:
            check_released_slabs(released, session=session, holds=holds)
        assert status_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT


def test_chunks_serialized_once_are_the_bytes_protobuf_writes() -> None:
    payload = os.urandom(2 * MiB + 77)
    for field, cls in ((2, constructor_pb2.GetBatchResponse),):
        expected = [cls(chunk=common_pb2.Chunk(data=payload[i : i + MiB])).SerializeToString() for i in range(0, len(payload), MiB)]
        assert list(chunk_messages(memoryview(payload), field=field)) == expected
    assert [constructor_pb2.GetBatchResponse.FromString(m).chunk.data for m in chunk_messages(b"abc", field=2, chunk_bytes=2)] == [
        b"ab",
        b"c",
    ]


CHILD = textwrap.dedent(
    """
    import hashlib, pathlib, sys
    from batchplane.client.slabs import SlabChannel
    from batchplane.v1 import constructor_pb2
    channel = SlabChannel(pathlib.Path(sys.argv[1]), timeout_s=10)
    print(channel.session, flush=True)
    for line in sys.stdin:
        slab, offset, length = map(int, line.split())
        view = channel.view(constructor_pb2.ShmPlacement(slab=slab, offset=offset, length=length), length)
        print(hashlib.sha256(view.numpy().tobytes()).hexdigest(), view.numpy().flags.writeable, flush=True)
    """
)


def test_an_fd_passed_to_another_process_gives_byte_identical_views() -> None:
    with tempfile.TemporaryDirectory() as folder:
        pool = SlabPool(8 * MiB)
        server = SlabServer(pathlib.Path(folder) / "c.sock.slabs", pool, max_sessions=2).start()
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(server.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            session = pool.session(child.stdout.readline().strip())
            assert session is not None
            batches = [Built(bytearray(os.urandom(n))) for n in (5000, 3 * MiB + 64)]
            for batch in batches:
                placement = pool.place(batch, b"tail", session)
                server.send_slab(session, placement.slab)
                child.stdin.write(f"{placement.slab} {placement.offset} {placement.length}\n")
                child.stdin.flush()
                digest, writable = child.stdout.readline().split()
                assert digest == hashlib.sha256(bytes(batch.payload) + b"tail").hexdigest()
                assert writable == "True"
            assert pool.sessions == 1
        finally:
            child.stdin.close()
            child.wait(timeout=30)
            child.stdout.close()
        # The child exited: its session ended, and with it every slab it held.
        give_up = time.monotonic() + 10
        while pool.sessions and time.monotonic() < give_up:
            time.sleep(0.01)
        assert pool.sessions == 0 and pool._book.holds(placement.slab, session.id) is False
        server.stop()
