"""`batchplane bench vlm` with tiny sizes: the DataLoader side's microbatches carry exactly the
demo transform's pixels and grids for their rows (the transform itself is checked against Pillow
in test_demo_images.py and test_vlm_pixels.py), and both systems' records have the documented
shape. No timing assertions.

The record test starts processes and Unix sockets in a temporary folder (a small job with
TLS, and DataLoader rank processes), as the bench does."""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DistributedSampler

from batchplane.bench import BENCHMARKS, load, vlm
from batchplane.demo.images import image_text
from batchplane.examples import dataloader_rank, vlm_rank

RECORD_FIELDS = {
    "system",
    "workers",
    "ranks",
    "samples",
    "steps",
    "images",
    "seconds",
    "samples_per_s",
    "data_wait_s_per_step_mean",
    "data_wait_s_per_step_p95",
    "cpu_s_per_1k_samples",
    "rss_mb_per_rank",
    "pss_mb_per_rank",
    "processes",
    "transport",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    return vlm.write_data(tmp_path_factory.mktemp("data"), image_rows=40, text_rows=24, seed=1)


def _image_rows(folder: pathlib.Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(f, columns=["caption", "images"]) for f in dataloader_rank.parquet_files([folder])])


def _text_rows(folder: pathlib.Path) -> list[list[int]]:
    return [row for f in dataloader_rank.parquet_files([folder]) for row in pq.read_table(f).column("input_ids").to_pylist()]


def test_vlm_is_a_registered_benchmark() -> None:
    assert BENCHMARKS["vlm"] == "batchplane.bench.vlm" and load("vlm") is vlm
    parser = argparse.ArgumentParser()
    vlm.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.ranks, args.workers, args.step_seconds, args.image_rows) == (2, None, 0.05, 1500)
    assert pathlib.Path(args.strategy).is_file()


def test_the_transform_is_loaded_by_name() -> None:
    assert vlm_rank.load_transform(vlm.TRANSFORM) is image_text
    with pytest.raises(ValueError, match="package.module:callable"):
        vlm_rank.load_transform("batchplane.demo.images.image_text")


def test_dataloader_microbatches_carry_the_transforms_pixels(data: dict[str, pathlib.Path]) -> None:
    images = _image_rows(data["images"])
    text = _text_rows(data["chat"])
    truth = image_text(images, pixels=True)  # every image row through the demo transform at once
    want_ids = truth.column("input_ids").to_pylist() + text
    want_pixels = [np.array(p, np.uint8).reshape(-1, vlm_rank.PIXEL_ROW) for p in truth.column("pixel_values").to_pylist()]
    want_grids = [np.array(g, np.int64).reshape(-1, 3) for g in truth.column("image_grid_thw").to_pylist()]
    want_pixels += [np.zeros((0, vlm_rank.PIXEL_ROW), np.uint8)] * len(text)
    want_grids += [np.zeros((0, 3), np.int64)] * len(text)
    microbatch, seen = 4, 0
    for rank in (0, 1):
        loader = vlm_rank.make_loader(
            dataloader_rank.parquet_files([data["images"]]),
            dataloader_rank.parquet_files([data["chat"]]),
            rank=rank,
            world=2,
            microbatch=microbatch,
            workers=1,
        )
        order = list(DistributedSampler(range(len(want_ids)), num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True))
        for m, batch in enumerate(loader):
            rows = order[m * microbatch : (m + 1) * microbatch]
            pixels = np.concatenate([want_pixels[i] for i in rows])
            grids = np.concatenate([want_grids[i] for i in rows])
            assert batch["pixel_values"].dtype.is_floating_point is False and batch["pixel_values"].numpy().dtype == np.uint8
            np.testing.assert_array_equal(batch["pixel_values"].numpy(), pixels, err_msg=f"rank {rank} microbatch {m}")
            np.testing.assert_array_equal(batch["image_grid_thw"].numpy(), grids, err_msg=f"rank {rank} microbatch {m}")
            assert int(batch["image_grid_thw"].prod(dim=1).sum()) == batch["pixel_values"].shape[0]
            mask = batch["attention_mask"].numpy()
            for r, i in enumerate(rows):
                assert batch["input_ids"][r, : mask[r].sum()].tolist() == want_ids[i]
            seen += int(grids.shape[0])
        del loader
    assert seen > 0, "the microbatches carried images"


def test_records_of_both_systems(data: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    records = [
        vlm.run_dataloader(tmp_path / "dl", data, ranks=2, workers=1, microbatch=2, step_seconds=0.0, memory_interval_s=0.25),
        vlm.run_batchplane(tmp_path / "bp", data, ranks=2, batch=8, step_seconds=0.0, memory_interval_s=0.25),
    ]
    assert [(r["system"], r["workers"]) for r in records] == [("dataloader", 1), ("batchplane", None)]
    for r in records:
        assert RECORD_FIELDS <= r.keys() and r["ranks"] == 2
        for key in (
            "samples",
            "images",
            "samples_per_s",
            "cpu_s_per_1k_samples",
            "rss_mb_per_rank",
            "pss_mb_per_rank",
            "data_wait_s_per_step_mean",
        ):
            assert r[key] > 0, (r["system"], key)
        assert r["data_wait_s_per_step_p95"] >= 0 and 0 < r["samples"] <= 64
    dataloader, batchplane = records
    assert dataloader["processes"] == 4 and dataloader["transport"] is None  # two ranks and their workers
    assert batchplane["transport"] == "shm", "with TLS on the constructor serves its pod's ranks through shared memory"
    assert batchplane["rss_mb_per_rank"] == pytest.approx(
        batchplane["trainer_rss_mb_per_rank"] + batchplane["services_rss_mb_per_rank"], abs=0.2
    )
    summary = vlm.summarize(records)
    assert set(summary) == {"dataloader_w1", "batchplane"}
    assert summary["batchplane"]["samples_per_s"] == batchplane["samples_per_s"] and summary["batchplane"]["runs"] == 1
