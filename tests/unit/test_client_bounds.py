"""The client allocates nothing from an unchecked constructor number: a batch header's payload
size must be what its tensors lay out and at most the client's maximum, else the call is a
ProtocolError naming the constructor (`batchplane.client.bounds`)."""

from __future__ import annotations

import pytest

from batchplane.client.bounds import MAX_BATCH_BYTES, check_batch_header
from batchplane.client.errors import ProtocolError
from batchplane.client.transport import ConstructorConnection
from batchplane.v1 import common_pb2, constructor_pb2


def header(payload_bytes: int, *tensors: tuple[str, str, list[int], int], sub: tuple = ()) -> constructor_pb2.BatchHeader:
    return constructor_pb2.BatchHeader(
        step=1,
        payload_bytes=payload_bytes,
        microbatches=[
            constructor_pb2.MicrobatchSpec(
                tensors=[constructor_pb2.TensorSpec(name=n, dtype=d, shape=s, offset=o) for n, d, s, o in tensors]
            )
        ],
        subbatches=[
            constructor_pb2.SubBatchSpec(
                name="images", tensors=[constructor_pb2.TensorSpec(name=n, dtype=d, shape=s, offset=o) for n, d, s, o in sub]
            )
        ],
    )


GOOD = (("input_ids", "int32", [2, 9], 0), ("labels", "int64", [2, 9], 128))  # 72 bytes -> 128, then 144 bytes


def test_a_header_whose_size_is_what_its_tensors_lay_out_passes() -> None:
    assert check_batch_header(header(128 + 192, *GOOD), address="c") == 320
    assert check_batch_header(header(128 + 144, *GOOD), address="c") == 272  # an unpadded end is fine
    assert check_batch_header(header(0), address="c") == 0  # end of data, or a rank that gets no tensors
    assert check_batch_header(header(384, *GOOD, sub=(("sample_row", "int64", [4], 320),)), address="c") == 384


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        (header(2**40, *GOOD), "announces 1099511627776 payload bytes, its tensors lay out 320"),
        (header(2**40), "announces 1099511627776"),
        (header(-1), "announces -1"),
        (header(200, *GOOD), "announces 200"),
        (header(384, *GOOD), "announces 384"),
        (header(2**40, ("x", "int8", [2**40], 0)), f"more than the client's {MAX_BATCH_BYTES}"),
        (header(64, ("x", "complex64", [2], 0)), "unknown dtype 'complex64'"),
        (header(64, ("x", "int8", [2], 3)), "offset 3"),
        (header(64, ("x", "int8", [2], -64)), "offset -64"),
        (header(64, ("x", "int8", [-2], 0)), "shape [-2]"),
    ],
)
def test_a_header_that_does_not_add_up_is_a_protocol_error(bad, names) -> None:
    with pytest.raises(ProtocolError, match="constructor at 10.1.1.1:7") as info:
        check_batch_header(bad, address="10.1.1.1:7")
    assert names in str(info.value)


class _Stub:
    def __init__(self, first: constructor_pb2.BatchHeader) -> None:
        self.first = first

    def GetBatch(self, request, timeout):  # noqa: N802 - the stub's method name
        return iter(
            [constructor_pb2.GetBatchResponse(header=self.first), constructor_pb2.GetBatchResponse(chunk=common_pb2.Chunk(data=b"x"))]
        )


def test_the_client_refuses_a_2_to_the_40_byte_header_before_allocating() -> None:
    connection = ConstructorConnection("127.0.0.1:9", timeout_s=1)
    try:
        connection._stub = _Stub(header(2**40))
        with pytest.raises(ProtocolError, match="announces 1099511627776 payload bytes"):
            connection.batch(0, 1, pin=False)
    finally:
        connection.close()


def test_the_sizes_it_checks_are_the_dtypes_the_client_lays_out() -> None:
    import torch

    from batchplane.client.bounds import ITEM_BYTES
    from batchplane.client.tensors import TORCH_DTYPES

    assert {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in TORCH_DTYPES.items()} == ITEM_BYTES
