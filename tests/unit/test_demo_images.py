"""Tests of the demo's image-text source: the writer and the `image_text` transform
(batchplane.demo.images)."""

from __future__ import annotations

import io
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from PIL import Image

from batchplane.core.config import SourceSettings
from batchplane.core.payload import PayloadColumn
from batchplane.demo.dataset import DEMO_SOURCES, ImageTextSource, write_demo_dataset
from batchplane.demo.images import (
    IMAGE_TOKEN_ID,
    PAYLOAD,
    RESOLUTIONS,
    SCHEMA,
    image_grid,
    image_text,
    patchify,
    pixel_patches,
    write_image_text_source,
)
from batchplane.demo.run import TRANSFORMS
from batchplane.loader.transforms import bind_transform, check_output

ROWS = 300
VOCAB = 1024


def _files(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("*.parquet"))


def _read(directory: pathlib.Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(path) for path in _files(directory))


def _jpeg(picture: np.ndarray, quality: int = 95) -> bytes:
    out = io.BytesIO()
    Image.fromarray(picture).save(out, format="JPEG", quality=quality)
    return out.getvalue()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("images")
    return write_image_text_source(directory, rows=ROWS, seed=0, files=2, row_group_rows=60, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def table(written: pathlib.Path) -> pa.Table:
    return _read(written)


def test_files_schema_and_row_groups(written: pathlib.Path) -> None:
    files = _files(written)
    assert [p.name for p in files] == ["part-00000.parquet", "part-00001.parquet"]
    assert sorted(p.name for p in written.iterdir()) == [p.name for p in files]  # no temporaries
    start = 0
    for path in files:
        parquet = pq.ParquetFile(path)
        assert parquet.schema_arrow == SCHEMA
        metadata = parquet.metadata
        assert metadata.num_row_groups > 1
        assert all(0 < metadata.row_group(g).num_rows <= 60 for g in range(metadata.num_row_groups))
        assert metadata.row_group(0).column(1).compression == "ZSTD"
        doc_id = pq.read_table(path, page_checksum_verification=True)["doc_id"].to_numpy()
        np.testing.assert_array_equal(doc_id, np.arange(start, start + len(doc_id)))
        start += len(doc_id)
    assert start == ROWS


def test_images_are_real_jpegs_at_skewed_resolutions(table: pa.Table) -> None:
    sizes = []
    for data in pc.list_flatten(table["images"]).to_pylist():
        with Image.open(io.BytesIO(data)) as image:
            assert image.format == "JPEG"
            image.load()
            sizes.append(image.size)
    known = {size for size, _ in RESOLUTIONS}
    assert set(sizes) <= known
    assert len(set(sizes)) >= 8
    longest = np.array([max(size) for size in sizes])
    assert np.mean(longest <= 224) > 0.75  # mostly small
    assert np.any(longest >= 448)  # with a tail of large ones
    tokens = np.array([np.prod(image_grid(*size)) for size in sizes])
    assert np.mean(tokens) > 1.3 * np.median(tokens)  # right-skewed image token counts


def test_images_per_sample_and_captions(table: pa.Table) -> None:
    counts = pc.list_value_length(table["images"]).to_numpy()
    histogram = np.bincount(counts, minlength=5)
    assert len(histogram) == 5  # 0..4 images
    assert histogram.argmax() == 1 and histogram[1] > 0.5 * ROWS  # mostly one image
    assert histogram[0] > 0 and histogram[3] + histogram[4] > 0  # some none, a tail of 3-4
    lengths = pc.list_value_length(table["caption"]).to_numpy()
    assert lengths.min() >= 8 and lengths.max() <= 48
    values = pc.list_flatten(table["caption"]).to_numpy()
    assert values.min() >= 0 and values.max() < VOCAB - 1  # the last id is the image token
    assert IMAGE_TOKEN_ID == VOCAB - 1
    assert len(np.unique(values)) > VOCAB // 2


def test_deterministic_for_a_seed(tmp_path: pathlib.Path) -> None:
    def write(name: str, seed: int) -> list[bytes]:
        directory = write_image_text_source(tmp_path / name, rows=40, seed=seed, row_group_rows=15)
        return [path.read_bytes() for path in _files(directory)]

    first = write("a", 3)
    assert write("b", 3) == first
    assert write("c", 4) != first
    assert write("a", 3) == first  # overwriting in place


@pytest.mark.parametrize(
    ("width", "height", "patch", "max_side", "grid"),
    [
        (64, 64, 14, 448, (5, 5)),  # 64/14 = 4.6 rounds up to 5
        (96, 96, 14, 448, (7, 7)),
        (128, 96, 14, 448, (9, 7)),  # 9.1 and 6.9 round to the nearest
        (224, 224, 14, 448, (16, 16)),
        (448, 448, 14, 448, (32, 32)),
        (512, 336, 14, 448, (32, 21)),  # scaled by 448/512 to 448x294
        (1000, 10, 14, 448, (32, 1)),  # at least one patch per side
        (7, 7, 14, 448, (1, 1)),
        (447, 447, 14, 447, (31, 31)),  # rounding never passes max_side
        (2000, 1000, 16, 512, (32, 16)),
    ],
)
def test_image_grid(width: int, height: int, patch: int, max_side: int, grid: tuple[int, int]) -> None:
    assert image_grid(width, height, patch=patch, max_side=max_side) == grid


def test_patchify_cuts_row_major_normalized_patches() -> None:
    picture = np.zeros((28, 56, 3), dtype=np.uint8)
    picture[:, :28] = (255, 0, 0)  # left patch red
    picture[:, 28:] = (0, 0, 255)  # right patch blue
    patches = patchify(_jpeg(picture), patch=28, max_side=448)
    assert patches.dtype == np.float32 and patches.shape == (2, 28 * 28 * 3)
    assert patches.min() >= 0.0 and patches.max() <= 1.0
    means = patches.reshape(2, 28, 28, 3).mean(axis=(1, 2))
    np.testing.assert_allclose(means, [[1, 0, 0], [0, 0, 1]], atol=0.1)

    resized = patchify(_jpeg(np.full((64, 64, 3), 128, np.uint8)), patch=14, max_side=448)
    assert resized.shape == (25, 14 * 14 * 3)  # resized to 70x70
    np.testing.assert_allclose(resized, 128 / 255, atol=0.02)
    assert patchify(b"not a jpeg") is None


def test_transform_output(table: pa.Table) -> None:
    out = image_text(table)
    ids, features = check_output(out, table.num_rows)  # the loader's contract
    assert set(features) == {"num_images", "image_tokens"}
    assert ids.null_count == 0
    captions = table["caption"].to_pylist()
    images = table["images"].to_pylist()
    for i, row in enumerate(ids.to_pylist()):
        sizes = [Image.open(io.BytesIO(data)).size for data in images[i]]
        expected_tokens = sum(int(np.prod(image_grid(*size))) for size in sizes)
        assert features["num_images"][i] == len(images[i])
        assert features["image_tokens"][i] == expected_tokens
        assert len(row) == expected_tokens + len(captions[i])
        assert row[:expected_tokens] == [IMAGE_TOKEN_ID] * expected_tokens
        assert row[expected_tokens:] == captions[i]


def _pixels_from_pil(data: bytes, *, patch: int, temporal: int) -> tuple[np.ndarray, list[int]]:
    """Ground truth with no code of ours beyond `image_grid`: PIL decodes and resizes, and the
    patches are cut one by one, channel first, each frame repeated."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    columns, rows = image_grid(*image.size, patch=patch)
    if image.size != (columns * patch, rows * patch):
        image = image.resize((columns * patch, rows * patch), Image.Resampling.BILINEAR)
    array = np.asarray(image)
    patches = [
        np.stack([array[y * patch : (y + 1) * patch, x * patch : (x + 1) * patch].transpose(2, 0, 1)] * temporal, axis=1).reshape(-1)
        for y in range(rows)
        for x in range(columns)
    ]
    return np.stack(patches), [1, rows, columns]


@pytest.mark.parametrize("temporal", [1, 2])
def test_pixels_travel_as_raw_patches_with_their_grids(table: pa.Table, temporal: int) -> None:
    batch = table.slice(0, 40)
    out = image_text(batch, pixels=True, temporal_patch=temporal)
    assert out["input_ids"].to_pylist() == image_text(batch)["input_ids"].to_pylist()  # the same tokens
    row_bytes = 3 * temporal * 14 * 14
    for i, images in enumerate(batch["images"].to_pylist()):
        pixels = np.asarray(out["pixel_values"][i].as_py() or [], np.uint8)
        grids = np.asarray(out["image_grid_thw"][i].as_py() or [], np.int64).reshape(-1, 3)
        expected = [_pixels_from_pil(data, patch=14, temporal=temporal) for data in images]
        want = np.concatenate([p for p, _ in expected]) if expected else np.zeros((0, row_bytes), np.uint8)
        assert np.array_equal(pixels.reshape(-1, row_bytes), want)
        assert grids.tolist() == [g for _, g in expected]
        # The grids' products are the patch rows and the sample's image placeholder tokens.
        assert int(np.prod(grids, axis=1).sum()) == len(want) == out["image_tokens"][i].as_py()
        assert out["input_ids"][i].as_py().count(IMAGE_TOKEN_ID) == len(want)


def test_pixel_patches_is_none_for_a_broken_jpeg() -> None:
    assert pixel_patches(b"\xff\xd8 not a jpeg") is None
    patches, grid = pixel_patches(_jpeg(np.full((28, 42, 3), 7, np.uint8)), patch=14)
    assert patches.dtype == np.uint8 and patches.shape == (6, 3 * 14 * 14) and grid == (2, 3)


def test_undecodable_images_reject_only_their_sample(table: pa.Table) -> None:
    rows = table.slice(0, 8).to_pylist()
    with_images = [i for i, row in enumerate(rows) if row["images"]][:3]
    assert len(with_images) == 3
    a, b, c = with_images
    rows[a]["images"][0] = b"\xff\xd8 not really a jpeg"
    rows[b]["images"][-1] = rows[b]["images"][-1][: len(rows[b]["images"][-1]) // 2]  # truncated
    rows[c]["images"].append(None)
    broken = pa.Table.from_pylist(rows, schema=SCHEMA)
    good = image_text(table.slice(0, 8))
    out = image_text(broken)
    ids, features = check_output(out, 8)
    valid = ids.is_valid().to_numpy(zero_copy_only=False)
    assert [i for i in range(8) if not valid[i]] == [a, b, c]
    for i in set(range(8)) - {a, b, c}:
        assert out["input_ids"][i] == good["input_ids"][i]
        assert out["image_tokens"][i] == good["image_tokens"][i]
    assert all(features["image_tokens"][i] == 0 for i in (a, b, c))


def test_text_only_and_empty_rows() -> None:
    image = _jpeg(np.full((96, 96, 3), 200, np.uint8))
    batch = pa.Table.from_pylist(
        [
            {"caption": [1, 2, 3], "images": [], "doc_id": 0},
            {"caption": [4, 5], "images": None, "doc_id": 1},
            {"caption": None, "images": [image], "doc_id": 2},
            {"caption": [6], "images": [image, image], "doc_id": 3},
        ],
        schema=SCHEMA,
    )
    out = image_text(batch, patch=14, max_side=448, image_token_id=7)
    assert out["input_ids"].to_pylist() == [[1, 2, 3], [4, 5], [7] * 49, [7] * 98 + [6]]
    assert out["num_images"].to_pylist() == [0, 0, 1, 2]
    assert out["image_tokens"].to_pylist() == [0, 0, 49, 98]
    empty = image_text(batch.slice(0, 0))
    assert check_output(empty, 0)[0].to_pylist() == []


def test_rejects_bad_arguments(table: pa.Table, tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="max_side"):
        image_text(table.slice(0, 2), patch=14, max_side=10)
    with pytest.raises(ValueError, match="image_token_id"):
        image_text(table.slice(0, 2), image_token_id=-1)
    with pytest.raises(ValueError, match="files"):
        write_image_text_source(tmp_path, rows=3, seed=0, files=4)


def test_demo_source_and_its_configured_transform(tmp_path: pathlib.Path) -> None:
    (images,) = [s for s in DEMO_SOURCES if isinstance(s, ImageTextSource)]
    assert images.name == "images" and images.name in TRANSFORMS
    small = ImageTextSource(name="pics", description="small", num_rows=30, files=2, rows_per_row_group=10)
    directory = write_demo_dataset(tmp_path, sources=(small,))["pics"]
    config = TRANSFORMS["images"]
    bound = bind_transform(
        0,
        SourceSettings(
            name="pics",
            path=str(directory),
            transform=config["transform"],
            transform_args=config["transform_args"],
            columns=tuple(config["columns"]),
        ),
        payload=tuple(PayloadColumn(**{**c, "shape": tuple(c["shape"])}) for c in PAYLOAD),  # the demo job declares them
    )
    batch = _read(directory).select(list(bound.columns))
    ids, features = bound(batch)
    assert bound.apply(batch).columns["pixel_values"].type == pa.list_(pa.uint8())
    assert len(ids) == 30 and ids.null_count == 0
    assert features["image_tokens"].sum() > 0
