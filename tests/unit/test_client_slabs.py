"""The client's side of shared-memory delivery against a real slab socket in this process: the
release rule (a slab is released once every tensor of its step is dropped), copy-on-write
mappings, retired slabs and a constructor that went away, and hostile placements."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from batchplane.client.errors import ProtocolError
from batchplane.client.slabs import SlabChannel, slab_socket
from batchplane.client.tensors import unpack
from batchplane.constructor.slabs import SlabPool, SlabServer
from batchplane.v1 import constructor_pb2

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Built:
    payload: bytearray


@pytest.fixture
def served(tmp_path):
    pool = SlabPool(8 * MiB)
    server = SlabServer(tmp_path / "c.sock.slabs", pool, max_sessions=4).start()
    channel = SlabChannel(server.path, timeout_s=5)
    session = pool.session(channel.session)
    yield pool, server, channel, session
    channel.close()
    server.stop()


def _serve(pool, server, session, batch, extra=b""):
    placement = pool.place(batch, extra, session)
    server.send_slab(session, placement.slab)
    return constructor_pb2.ShmPlacement(slab=placement.slab, offset=placement.offset, length=placement.length)


def _spec(name, dtype, shape, offset):
    return constructor_pb2.TensorSpec(name=name, dtype=dtype, shape=shape, offset=offset)


def test_a_slab_is_released_once_every_tensor_of_its_step_is_dropped(served) -> None:
    pool, server, channel, session = served
    batch = Built(bytearray(torch.arange(32, dtype=torch.int64).numpy().tobytes()))
    placement = _serve(pool, server, session, batch)
    storage = channel.view(placement, 256)
    tensors = unpack(storage, [_spec("a", "int64", [16], 0), _spec("b", "int64", [4, 4], 128)])
    del storage
    assert tensors["b"][1, 1].item() == 21
    channel.poll()
    assert channel.take_releases() == []
    a = tensors.pop("a")
    gc.collect()
    channel.poll()
    assert channel.take_releases() == []  # "b" still views the slab
    del tensors, a
    channel.poll()
    assert channel.take_releases() == [placement.slab]
    assert channel.take_releases() == []  # reported once
    assert pool.holds(session, placement.slab)  # until the request that reports it


def test_trainer_writes_stay_private_and_a_reused_slab_shows_the_new_batch(served) -> None:
    pool, server, channel, session = served
    first = Built(bytearray(b"\x01" * 4096))
    placement = _serve(pool, server, session, first)
    view = channel.view(placement, 4096)
    view.fill_(9)  # in place, as a trainer may: copy on write
    assert bytes(pool._slabs[placement.slab].map[:4096]) == b"\x01" * 4096
    del view, first
    gc.collect()
    channel.poll()
    pool.release(session, channel.take_releases())
    second = _serve(pool, server, session, Built(bytearray(b"\x02" * 4096)))
    assert second.slab == placement.slab  # reused, and its fd not sent again
    assert channel.mapped() == 1
    assert bytes(channel.view(second, 4096).numpy()) == b"\x02" * 4096


def test_slabs_of_a_constructor_that_went_away_are_unmapped_with_their_tensors(served) -> None:
    pool, server, channel, session = served
    kept = channel.view(_serve(pool, server, session, Built(bytearray(100))), 100)
    dropped = channel.view(_serve(pool, server, session, Built(bytearray(200))), 200)
    assert channel.mapped() == 2
    server.stop()  # its sessions' sockets close with the process in real life
    session.sock.close()
    del dropped
    channel.poll()
    assert not channel.alive
    assert channel.mapped() == 1  # the dropped one's slab is gone, the kept one stays
    del kept
    gc.collect()
    assert channel.mapped() == 0


def test_a_placement_outside_the_slab_or_of_another_size_is_refused(served) -> None:
    pool, server, channel, session = served
    good = _serve(pool, server, session, Built(bytearray(128)))
    for bad, payload in (
        (constructor_pb2.ShmPlacement(slab=good.slab, offset=MiB, length=128), 128),
        (constructor_pb2.ShmPlacement(slab=good.slab, offset=3, length=128), 128),
        (constructor_pb2.ShmPlacement(slab=good.slab, offset=0, length=64), 128),
    ):
        with pytest.raises(ProtocolError):
            channel.view(bad, payload)


def test_a_slab_that_never_arrives_is_a_protocol_error(tmp_path) -> None:
    pool = SlabPool(8 * MiB)
    server = SlabServer(tmp_path / "c.sock.slabs", pool, max_sessions=1).start()
    try:
        channel = SlabChannel(server.path, timeout_s=0.2)
        with pytest.raises(ProtocolError, match="never arrived"):
            channel.view(constructor_pb2.ShmPlacement(slab=7, offset=0, length=64), 64)
        assert not channel.alive  # the session is given up: the client connects again, or uses gRPC
    finally:
        server.stop()


def test_a_client_past_the_sessions_bound_is_closed_at_once(tmp_path) -> None:
    pool = SlabPool(MiB)
    server = SlabServer(tmp_path / "c.sock.slabs", pool, max_sessions=1).start()
    try:
        first = SlabChannel(server.path, timeout_s=1)
        with pytest.raises((ConnectionError, ProtocolError)):
            SlabChannel(server.path, timeout_s=1)
        assert pool.sessions == 1 and first.alive
    finally:
        server.stop()


def test_the_slab_socket_is_used_only_for_a_unix_address_where_it_exists(tmp_path, monkeypatch) -> None:
    pool = SlabPool(MiB)
    server = SlabServer(tmp_path / "c.sock.slabs", pool, max_sessions=1).start()
    try:
        assert slab_socket(f"unix://{tmp_path}/c.sock") == server.path
        assert slab_socket(f"unix://{tmp_path}/other.sock") is None
        assert slab_socket("127.0.0.1:5000") is None
        monkeypatch.setenv("BATCHPLANE_SHM", "0")
        assert slab_socket(f"unix://{tmp_path}/c.sock") is None
    finally:
        server.stop()


def test_a_slab_the_constructor_retires_is_unmapped_once_unused(tmp_path) -> None:
    pool = SlabPool(2 * MiB)
    server = SlabServer(tmp_path / "c.sock.slabs", pool, max_sessions=1).start()
    channel = SlabChannel(server.path, timeout_s=5)
    try:
        session = pool.session(channel.session)
        small = Built(bytearray(b"s" * 1000))
        first = _serve(pool, server, session, small)
        view = channel.view(first, 1000)
        del view, small
        gc.collect()
        channel.poll()
        pool.release(session, channel.take_releases())
        big = Built(bytearray(b"b" * (MiB + 1)))  # needs the whole cap: the free 1 MiB slab is destroyed
        second = _serve(pool, server, session, big)
        assert second.slab != first.slab
        assert bytes(channel.view(second, MiB + 1).numpy()[:4]) == b"bbbb"
        channel.poll()
        assert channel.mapped() == 1  # the retired slab is unmapped
    finally:
        channel.close()
        server.stop()
