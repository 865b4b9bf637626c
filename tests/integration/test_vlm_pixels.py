"""A vision-language job with real processes: the example strategy vlm.py delivers each image's
pixels (`images.deliver("pixel_values", "image_grid_thw")`) to the rank that encodes it, over a
mesh of two data-parallel ranks served by two constructors.

Checked against ground truth that is not our code (Pillow decodes each row's JPEGs, resizes them
to the grid `image_grid` gives, and the patches are cut here by hand): over one epoch, every
image of every good sample reaches exactly one rank's `subbatches["images"]`, in the slot of the
subbatch that names its sample, byte-identical; some samples' images go to the rank of the other
DP bucket (fetched by the other constructor); the microbatches carry no pixels; and the image
loader sent each sample once per constructor that needs it (its samples-sent counter), refusing
no fetch.
"""

from __future__ import annotations

import io
import json
import os
import pathlib

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from batchplane.client import Client
from batchplane.demo.images import IMAGE_TOKEN_ID, PAYLOAD, image_grid, write_image_text_source
from harness import run_ranks, scrape, start_cluster, write_job, write_source

pytestmark = pytest.mark.integration

REPO = pathlib.Path(__file__).resolve().parents[2]
PATCH = 14


def _by_hand(jpeg: bytes) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One JPEG's patches [rows * columns, 3 * 14 * 14] (channel, y, x per row) and (1, rows, columns)."""
    with Image.open(io.BytesIO(jpeg)) as image:
        rgb = image.convert("RGB")
    columns, rows = image_grid(*rgb.size, patch=PATCH, max_side=448)
    if rgb.size != (columns * PATCH, rows * PATCH):
        rgb = rgb.resize((columns * PATCH, rows * PATCH), Image.Resampling.BILINEAR)
    pixels = np.asarray(rgb)
    patches = []
    for r in range(rows):
        for c in range(columns):
            block = pixels[r * PATCH : (r + 1) * PATCH, c * PATCH : (c + 1) * PATCH, :]  # [y, x, channel]
            patches.append(np.stack([block[:, :, ch].reshape(-1) for ch in range(3)]).reshape(-1))
    return np.array(patches, np.uint8).reshape(-1, 3 * PATCH * PATCH), (1, rows, columns)


def _ground_truth(folder: pathlib.Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per row (over the files in sorted order) with at least one image: its pixels and grids."""
    out = {}
    row = 0
    for path in sorted(folder.glob("*.parquet")):
        for images in pq.read_table(path, columns=["images"]).column("images").to_pylist():
            if images:
                decoded = [_by_hand(j) for j in images]
                out[row] = (np.concatenate([p for p, _ in decoded]), np.array([g for _, g in decoded], np.int64))
            row += 1
    return out


def test_each_image_reaches_the_rank_that_encodes_it_byte_identical(tmp_path: pathlib.Path) -> None:
    images = write_image_text_source(tmp_path / "images", rows=80, seed=5, files=2, row_group_rows=20)
    text = write_source(tmp_path, "text", list(np.random.default_rng(1).integers(8, 120, 80)), seed=2)
    image_source = {
        "name": "images",
        "path": str(images),
        "transform": "batchplane.demo.images:image_text",
        "columns": ["caption", "images"],
        "transform_args": {"patch": PATCH, "max_side": 448, "image_token_id": IMAGE_TOKEN_ID, "pixels": True},
    }
    config = write_job(
        tmp_path / "job.yaml",
        [text],
        sources=[image_source, {"name": "text", "path": str(text.path)}],
        strategy=str(REPO / "examples" / "strategies" / "vlm.py"),
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32", "payload": [dict(c) for c in PAYLOAD]},
        mesh={"dp": 2},
        constructors={"ranks_per_constructor": 1},
        loaders={"count": 2},
    )
    truth = _ground_truth(images)
    received: dict[int, list[tuple[int, int, np.ndarray, np.ndarray]]] = {0: [], 1: []}  # rank -> (source, row, pixels, grid)
    trained: dict[tuple[int, int], int] = {}
    sources: list[str] = []
    cluster = start_cluster(config)
    try:
        os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)

        def run(rank: int) -> None:
            with Client(rank=rank, timeout_s=60) as client:
                for batch in client:
                    if rank == 0 and not sources:
                        sources.extend(batch["sources"])
                    for mb in batch["microbatches"]:
                        assert not {"pixel_values", "pixel_values_offsets", "image_grid_thw", "image_grid_thw_offsets"} & set(mb)
                        for key in zip(mb["sample_source"].tolist(), mb["sample_row"].tolist()):
                            trained[key] = rank
                    sub = batch["subbatches"]["images"]
                    pixels, grid = sub["pixel_values"].numpy(), sub["image_grid_thw"].numpy()
                    po, go = sub["pixel_values_offsets"].numpy(), sub["image_grid_thw_offsets"].numpy()
                    assert len(po) == len(go) == len(sub["sample_row"]) + 1
                    for b, key in enumerate(zip(sub["sample_source"].tolist(), sub["sample_row"].tolist())):
                        received[rank].append((*key, pixels[po[b] : po[b + 1]].copy(), grid[go[b] : go[b + 1]].copy()))

        run_ranks(run, [0, 1])
        images_index = sources.index("images")
        got = [(rank, *entry) for rank, entries in received.items() for entry in entries]
        assert all(source == images_index for _, source, *_ in got), "only image samples are encoded"
        rows = [row for _, _, row, _, _ in got]
        assert sorted(rows) == sorted(truth), "every image sample of the epoch is delivered exactly once"
        for rank, source, row, pixels, grid in got:
            want_pixels, want_grid = truth[row]
            np.testing.assert_array_equal(grid, want_grid, err_msg=f"grid of row {row}")
            assert pixels.dtype == np.uint8 and np.array_equal(pixels, want_pixels), f"pixels of row {row} on rank {rank}"
        elsewhere = [(row, rank) for rank, source, row, _, _ in got if trained[(source, row)] != rank]
        assert elsewhere, "some images are encoded by the rank of the other DP bucket"
        assert len(elsewhere) < len(got)

        # Each constructor fetched each sample once: the one training it, and the one whose rank
        # encodes its images when that is the other one. Had the plan's copies been too few, the
        # loader would have freed a sample before its second fetcher came (NOT_FOUND, the job
        # fails); the count shows no constructor fetched a sample twice.
        metrics = json.loads(cluster.endpoints_path.read_text())["metrics"]
        pages = [scrape(url) for name, url in metrics.items() if name.startswith("loader")]
        assert len(pages) == 2
        sent = sum(page.get('batchplane_loader_samples_sent_total{source="images"}', 0.0) for page in pages)
        image_samples = sum(1 for source, _ in trained if source == images_index)
        assert sent == image_samples + len(elsewhere), (sent, image_samples, len(elsewhere))
        assert not any(v for page in pages for k, v in page.items() if k.startswith("batchplane_loader_fetches_refused_total"))
    finally:
        cluster.stop()
