"""`batchplane bench delivery` with tiny sizes: the JSON shape of both parts, the client's gRPC
path delivering tensors byte-identical to the pre-built payload, and the DataLoader baseline's
microbatches equal to padded rows built straight from the Parquet files. No timing assertions.

It starts processes and Unix sockets in a temporary folder (the bench's own sending child, and
a small job with DataLoader processes), as the bench does."""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchplane.bench import BENCHMARKS, delivery
from batchplane.bench import dataloader
from batchplane.bench.transport import text_sources
from batchplane.examples import dataloader_rank
from batchplane.constructor.assemble import tensors_of
from batchplane.demo.dataset import write_demo_dataset

TINY = delivery.PayloadSettings(seed=3, microbatches=2, rows=3, seq=64, images=4, distinct=2)
TRANSPORT_FIELDS = {
    "payload",
    "transport",
    "gb_per_s",
    "cpu_s_per_gb",
    "sender_cpu_s_per_gb",
    "receiver_cpu_s_per_gb",
    "bytes_per_batch",
    "batches",
}
SAMPLE_FIELDS = {"system", "ranks", "global_batch", "dp_microbatches", "samples_per_s", "cpu_s_per_1k_samples"}


def test_delivery_is_a_registered_benchmark() -> None:
    assert BENCHMARKS["delivery"] == "batchplane.bench.delivery"
    parser = argparse.ArgumentParser()
    delivery.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.repeats, args.ranks, args.skip_samples, args.shape) == (5, None, False, None)
    assert parser.parse_args(["--shape", "64x2", "--shape", "256X16"]).shape == [(64, 2), (256, 16)]
    for bad in ("64", "64x", "x2", "64x0", "0x2", "64x2x1", "-64x2", "sixty-four x 2"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--shape", bad])


def test_a_shape_that_does_not_split_into_whole_microbatches_is_refused_before_any_run(tmp_path: pathlib.Path) -> None:
    parser = argparse.ArgumentParser()
    delivery.add_arguments(parser)
    args = parser.parse_args(["--ranks", "2", "--ranks", "8", "--shape", "64x2", "--shape", "80x4"])
    with pytest.raises(ValueError, match=r"--shape 80x4: 80 samples a step are not 8 ranks x 4 whole microbatches"):
        dataloader.run_samples(args, tmp_path / "samples", progress=lambda line: None)
    assert not (tmp_path / "samples").exists(), "refused before writing data or starting a run"


def test_payloads_are_seeded_and_shaped_as_documented() -> None:
    payloads = delivery.build_payloads(TINY)
    again = delivery.build_payloads(TINY)
    assert all(bytes(a.payload) == bytes(b.payload) for name in payloads for a, b in zip(payloads[name], again[name]))
    assert bytes(payloads["pixels"][0].payload) != bytes(payloads["pixels"][1].payload)
    tokens = tensors_of(payloads["tokens"][0])
    assert len(tokens) == TINY.microbatches
    for mb in tokens:
        assert mb["input_ids"].shape == (TINY.rows, TINY.seq) and mb["attention_mask"].dtype == np.bool_
        lengths = mb["attention_mask"].sum(axis=1)
        for r, n in enumerate(lengths):
            assert (mb["labels"][r, : n - 1] == mb["input_ids"][r, 1:n]).all() and (mb["labels"][r, n - 1 :] == -100).all()
    (pixels,) = tensors_of(payloads["pixels"][0])
    thw, cu = pixels["image_grid_thw"], pixels["cu_seqlens"]
    assert thw.shape == (TINY.images, 3) and pixels["pixel_values"].shape == (int(thw.prod(axis=1).sum()), delivery.PATCH_DIM)
    assert (np.diff(cu) == thw.prod(axis=1)).all() and cu[0] == 0
    sides = set((thw[:, 1:] * delivery.PATCH).ravel().tolist())
    assert sides <= set(delivery.SIDES)


def test_grpc_delivers_the_prebuilt_tensors_byte_for_byte(tmp_path: pathlib.Path) -> None:
    payloads = delivery.build_payloads(TINY)
    with delivery.SenderProcess(tmp_path / "send", TINY) as sender:
        receiver = delivery.ClientReceiver(sender.constructor_address, shm=False)
        try:
            for payload in delivery.PAYLOADS:
                for step in (1, 2):  # both distinct batches
                    built = payloads[payload][step % TINY.distinct]
                    moved = receiver.receive(payload, step)
                    expected = tensors_of(built)
                    assert moved == delivery.tensor_bytes(built) > 0
                    assert [list(g) for g in receiver.last] == [list(g) for g in expected]
                    for got, want in zip(receiver.last, expected):
                        for name, array in want.items():
                            received = got[name].numpy()
                            assert received.dtype == array.dtype and received.shape == array.shape
                            assert received.tobytes() == array.tobytes(), (payload, step, name)
        finally:
            receiver.close()


def test_transport_records_have_the_documented_shape(tmp_path: pathlib.Path) -> None:
    records = delivery.measure_transports(TINY, folder=tmp_path / "t", batches=1, repeats=1, progress=lambda message: None)
    transports = {r["transport"] for r in records}
    assert {"memcpy", "grpc_stream", "grpc"} <= transports <= {"memcpy", "grpc_stream", "grpc", "shm"}
    assert {r["payload"] for r in records} == set(delivery.PAYLOADS)
    assert len(records) == 2 * len(transports)
    for r in records:
        assert TRANSPORT_FIELDS <= r.keys()
        assert r["gb_per_s"] > 0 and r["cpu_s_per_gb"] > 0 and r["bytes_per_batch"] > 0 and r["batches"] == 1
        assert r["verified"] is True, r
        assert r["cpu_s_per_gb"] == pytest.approx(r["sender_cpu_s_per_gb"] + r["receiver_cpu_s_per_gb"], abs=2e-4)
    summary = delivery.summarize(records)
    for payload in delivery.PAYLOADS:
        assert summary[payload]["memcpy"]["over_memcpy"] == 1.0
        assert summary[payload]["grpc_stream"]["over_grpc_stream"] == 1.0
        assert set(summary[payload]) == transports


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    return write_demo_dataset(tmp_path_factory.mktemp("data"), sources=text_sources(400), vocab_size=512, seed=0)


def _rows(data: dict[str, pathlib.Path]) -> list[list[int]]:
    """Every row's input_ids straight from the Parquet files, sources in job order."""
    return [row for f in dataloader_rank.parquet_files(list(data.values())) for row in pq.read_table(f).column("input_ids").to_pylist()]


def _padded(rows: list[list[int]]) -> dict[str, np.ndarray]:
    width = max(len(r) for r in rows)
    out = {
        "input_ids": np.zeros((len(rows), width), np.int64),
        "labels": np.full((len(rows), width), -100, np.int64),
        "attention_mask": np.zeros((len(rows), width), bool),
        "position_ids": np.zeros((len(rows), width), np.int64),
    }
    for r, row in enumerate(rows):
        for t, token in enumerate(row):
            out["input_ids"][r, t] = token
            out["attention_mask"][r, t] = True
            out["position_ids"][r, t] = t
            if t + 1 < len(row):
                out["labels"][r, t] = row[t + 1]
    return out


def test_the_dataset_reads_every_parquet_row(data: dict[str, pathlib.Path]) -> None:
    rows = _rows(data)
    dataset = dataloader_rank.ParquetTokens(dataloader_rank.parquet_files(list(data.values())))
    assert len(dataset) == len(rows) == 400
    assert all(dataset[i].tolist() == row for i, row in enumerate(rows))


def test_dataloader_microbatches_are_the_padded_parquet_rows(data: dict[str, pathlib.Path]) -> None:
    from torch.utils.data import DistributedSampler

    rows = _rows(data)
    files = dataloader_rank.parquet_files(list(data.values()))
    for rank in (0, 1):
        loader = dataloader_rank.make_loader(files, rank=rank, world=2, microbatch=4)
        order = list(DistributedSampler(range(len(rows)), num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True))
        for m, batch in zip(range(3), loader):
            expected = _padded([rows[i] for i in order[m * 4 : (m + 1) * 4]])
            assert list(batch) == list(expected)
            for name, array in expected.items():
                assert batch[name].numpy().dtype == array.dtype
                np.testing.assert_array_equal(batch[name].numpy(), array, err_msg=f"rank {rank} microbatch {m} {name}")
        del loader


def test_sample_records_of_both_systems(data: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    records = [
        dataloader.run_dataloader(tmp_path / "dl", data, ranks=2, batch=16, microbatches=2),
        dataloader.run_batchplane(tmp_path / "bp", data, ranks=2, batch=16, microbatches=2, loaders=2, ranks_per_constructor=2),
        dataloader.run_dataloader(tmp_path / "dl4", data, ranks=2, batch=16, microbatches=4),
    ]
    assert [r["system"] for r in records] == ["dataloader", "batchplane", "dataloader"]
    for r in records:
        assert SAMPLE_FIELDS <= r.keys() and r["ranks"] == 2 and r["global_batch"] == 16
        assert r["samples_per_s"] > 0 and r["cpu_s_per_1k_samples"] > 0
        assert 0 < r["samples"] <= 400
    assert [r["dp_microbatches"] for r in records] == [2, 2, 4]
    assert records[0]["processes"] == 4  # two ranks and their DataLoader workers
    summary = dataloader.summarize_samples(records)
    assert [(s["ranks"], s["global_batch"], s["dp_microbatches"]) for s in summary] == [(2, 16, 2), (2, 16, 4)]
    assert set(summary[0]) == {"ranks", "global_batch", "dp_microbatches", "batchplane", "dataloader", "batchplane_over_dataloader"}
    assert summary[0]["dataloader"]["samples_per_s"] == records[0]["samples_per_s"]
    ratio = summary[0]["batchplane_over_dataloader"]["cpu_s_per_1k_samples"]
    assert ratio == round(records[1]["cpu_s_per_1k_samples"] / records[0]["cpu_s_per_1k_samples"], 4)
    assert "batchplane" not in summary[1] and "batchplane_over_dataloader" not in summary[1]
    # CPU per step by part: every process of each system is in one, and they add up to its total
    assert set(records[0]["cpu_ms_per_step"]) == set(records[2]["cpu_ms_per_step"]) == {"rank", "worker"}
    assert set(records[1]["cpu_ms_per_step"]) == {"planner", "loader", "constructor", "trainer"}
    for r in records:
        assert all(ms >= 0 for ms in r["cpu_ms_per_step"].values())
        per_step_ms = r["cpu_s_per_1k_samples"] * r["global_batch"]
        assert sum(r["cpu_ms_per_step"].values()) == pytest.approx(per_step_ms, rel=1e-3, abs=0.01)
    assert summary[0]["batchplane"]["cpu_ms_per_step"] == records[1]["cpu_ms_per_step"]


def test_the_summary_takes_each_parts_median_counting_a_missing_part_as_zero() -> None:
    def record(cpu_ms: dict[str, float]) -> dict:
        shape = {"ranks": 2, "global_batch": 64, "dp_microbatches": 2}
        return {"system": "batchplane", **shape, "samples_per_s": 1.0, "cpu_s_per_1k_samples": 1.0, "cpu_ms_per_step": cpu_ms}

    runs = [record({"planner": 4.0, "loader": 2.0}), record({"planner": 1.0, "loader": 6.0, "other": 3.0}), record({"planner": 2.0})]
    (summary,) = dataloader.summarize_samples(runs)
    assert summary["batchplane"]["cpu_ms_per_step"] == {"loader": 2.0, "other": 0.0, "planner": 2.0}
