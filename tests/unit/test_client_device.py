"""Where a rank's tensors go (`client.device`): the rank's own GPU from LOCAL_RANK, the one
visible device, explicit devices, the CPU; and the fetch thread selecting its device before it
touches CUDA. CPU only: the CUDA copies themselves run where a GPU is (see the closing notes)."""

from __future__ import annotations

import threading
from concurrent import futures

import pytest
import torch

from batchplane.client.device import DeviceCopier, resolve_device
from batchplane.client.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("device", "env", "available", "count", "expected"),
    [
        ("auto", {"LOCAL_RANK": "3"}, True, 8, torch.device("cuda", 3)),
        ("auto", {"LOCAL_RANK": "3"}, False, 0, None),  # no CUDA: the CPU
        ("auto", {"LOCAL_RANK": "5"}, True, 1, torch.device("cuda", 0)),  # one visible device per process
        ("cuda", {"LOCAL_RANK": "2"}, True, 4, torch.device("cuda", 2)),
        ("cuda:1", {"LOCAL_RANK": "2"}, True, 4, torch.device("cuda", 1)),  # explicit wins
        (torch.device("cuda", 0), {"LOCAL_RANK": "2"}, True, 4, torch.device("cuda", 0)),
        ("auto", {}, True, 1, torch.device("cuda", 0)),
        (None, {"LOCAL_RANK": "1"}, True, 4, None),
        ("cpu", {"LOCAL_RANK": "1"}, True, 4, None),
    ],
)
def test_the_device_of_a_rank(device, env, available, count, expected) -> None:
    assert resolve_device(device, environ=env, cuda_available=available, device_count=count) == expected


@pytest.mark.parametrize(
    ("device", "env", "available", "count", "match"),
    [
        ("cuda", {}, False, 0, "CUDA is not available"),
        ("cuda:0", {}, False, 0, "CUDA is not available"),
        ("auto", {"LOCAL_RANK": "x"}, True, 2, "LOCAL_RANK='x' is not an integer"),
        ("auto", {"LOCAL_RANK": "4"}, True, 2, "LOCAL_RANK=4 but only 2 CUDA devices"),
    ],
)
def test_a_device_that_cannot_be_used_is_refused_naming_why(device, env, available, count, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        resolve_device(device, environ=env, cuda_available=available, device_count=count)


def test_the_fetch_thread_selects_the_ranks_device_before_anything_else(monkeypatch) -> None:
    """A new thread does not inherit torch.cuda.set_device: the client's fetch executor selects
    the rank's device in its initializer, on the thread that then receives and copies."""
    selected: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: selected.append((threading.current_thread().name, d)))
    copier = DeviceCopier(torch.device("cuda", 3))
    with futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchplane-fetch", initializer=copier.bind_thread) as pool:
        worker = pool.submit(lambda: threading.current_thread().name).result()
    assert selected == [(worker, torch.device("cuda", 3))]
    assert worker != threading.current_thread().name
