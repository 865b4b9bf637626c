"""The client turns a payload into tensors that are views of the receive buffer (no copy)."""

from __future__ import annotations

import numpy as np
import torch

from batchplane.client.tensors import ReceiveBuffers, unpack
from batchplane.constructor.assemble import RankSamples, assemble
from batchplane.wire import PayloadReceiver, iter_chunks


def test_tensors_are_views_of_the_received_buffer_with_the_built_values() -> None:
    tokens = [np.arange(1, 6, dtype=np.int32), np.arange(10, 13, dtype=np.int32), np.array([7], np.int32)]
    samples = RankSamples(
        tokens=tokens,
        source=np.array([0, 1, 1], np.int32),
        row=np.array([4, 5, 6], np.int64),
        epoch=np.zeros(3, np.int32),
        offsets=np.array([0, 2, 3], np.int64),
    )
    built = assemble(samples, step=3, rank=0, pad_id=0, ignore_id=-100, token_dtype="int64", global_loss_tokens=6)
    storage, view = ReceiveBuffers().take(len(built.payload), pin=False)
    receiver = PayloadReceiver(view)
    for chunk in iter_chunks(built.payload, chunk_bytes=100):
        receiver.add(chunk)
    receiver.check_complete()
    start = storage.data_ptr()
    for layout in built.microbatches:
        tensors = unpack(storage, layout.tensors)
        for spec in layout.tensors:
            t = tensors[spec.name]
            assert t.data_ptr() == start + spec.offset  # a view, not a copy
            expected = np.frombuffer(built.payload, spec.dtype, int(np.prod(spec.shape)), spec.offset).reshape(spec.shape)
            assert np.array_equal(t.numpy(), expected)
    first = unpack(storage, built.microbatches[0].tensors)
    assert first["input_ids"].dtype == torch.int64
    assert first["attention_mask"].dtype == torch.bool
    assert first["input_ids"].tolist() == [[1, 2, 3, 4, 5], [10, 11, 12, 0, 0]]
    assert first["labels"].tolist() == [[2, 3, 4, 5, -100], [11, 12, -100, -100, -100]]


def test_an_empty_payload_allocates_an_empty_tensor() -> None:
    storage, view = ReceiveBuffers().take(0, pin=False)
    assert storage.numel() == 0
    assert len(view) == 0


def test_receive_buffers_are_reused_only_once_every_tensor_of_their_batch_is_gone() -> None:
    buffers = ReceiveBuffers(keep=2)
    first, view = buffers.take(1000, pin=False)
    view[:3] = b"abc"
    kept = first[:3].view(torch.uint8)  # a view the trainer keeps
    address = first.data_ptr()
    del first, view
    second = buffers.take(1000, pin=False)[0]
    assert second.data_ptr() != address, "a buffer a tensor still views is never received into"
    assert bytes(kept.numpy()) == b"abc"
    del kept
    third = buffers.take(900, pin=False)[0]
    assert third.data_ptr() == address and buffers.free == 0, "once the batch's tensors are gone its buffer is reused"
    del second, third
    assert buffers.free == 2
    small = buffers.take(100, pin=False)[0]
    assert small.data_ptr() != address and len(small) == 100, "a buffer over twice the size is not taken"
