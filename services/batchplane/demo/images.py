"""A synthetic image-text source for the demo, and the transform that decodes and patchifies it.

`write_image_text_source` writes Parquet files ``part-00000.parquet``, ... with the schema

    caption: list<int32>    caption token ids in [0, vocab_size - 1), 8 to 48 tokens
    images:  list<binary>   0 to 4 JPEG-encoded RGB images (quality 85)
    doc_id:  int64          the row's global index over the files in sorted file order

compressed with zstd and with page checksums. The images are real JPEGs of smooth synthetic
pictures (gradients, waves, a little noise) at mixed resolutions from `RESOLUTIONS`, mostly
64x64 to 224x224 with a tail up to 448x448 and 512x336; most samples carry one image, some none,
a tail three or four. Everything derives from ``seed``, so the same arguments write the same
bytes with the same numpy, Pillow and pyarrow versions.

`image_text` is the source's loader transform (see `batchplane.loader.transforms`): it really
decodes every image, resizes it to a whole number of patches and cuts it into normalized float32
patches, as a vision-language model's input pipeline does, so its per-sample cost is far above
a text source's. Each image becomes one `image_token_id` per patch in front of the caption.

The writer does file I/O; the transform does none.
"""

from __future__ import annotations

import io
import os
import pathlib
import zlib
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image, ImageChops

__all__ = [
    "IMAGE_COUNT_WEIGHTS",
    "IMAGE_TOKEN_ID",
    "RESOLUTIONS",
    "SCHEMA",
    "image_grid",
    "PAYLOAD",
    "image_text",
    "patchify",
    "pixel_patches",
    "write_image_text_source",
]

#: The Arrow schema of every file `write_image_text_source` writes.
SCHEMA = pa.schema([("caption", pa.list_(pa.int32())), ("images", pa.list_(pa.binary())), ("doc_id", pa.int64())])

#: The image placeholder token: the last id of the demo's 1024-token vocabulary. Captions
#: written here never use it (they draw from ``[0, vocab_size - 1)``).
IMAGE_TOKEN_ID = 1023

#: Image sizes as (width, height) and their probabilities: 86% from 64x64 to 224x224, a tail
#: of 320x240, 336x336, 448x448 and 512x336.
RESOLUTIONS: tuple[tuple[tuple[int, int], float], ...] = (
    ((64, 64), 0.14),
    ((96, 96), 0.12),
    ((128, 96), 0.12),
    ((128, 128), 0.14),
    ((160, 160), 0.10),
    ((192, 144), 0.10),
    ((224, 224), 0.14),
    ((320, 240), 0.06),
    ((336, 336), 0.04),
    ((448, 448), 0.03),
    ((512, 336), 0.01),
)

#: Probability of 0, 1, 2, 3 and 4 images in a sample.
IMAGE_COUNT_WEIGHTS: tuple[float, ...] = (0.15, 0.60, 0.13, 0.07, 0.05)

#: Caption lengths: lognormal with this median (tokens) and log-sigma, clipped to the range.
_CAPTION_MEDIAN, _CAPTION_SIGMA, _CAPTION_RANGE = 20.0, 0.4, (8, 48)
_JPEG_QUALITY = 85
#: Base pictures generated per resolution; each image is a shifted, tinted copy of one.
_VARIANTS = 3

# Sub-streams derived from (seed, crc32("images")); fixed so that adding one never shifts another.
_STREAM_LAYOUT = 0
_STREAM_CAPTIONS = 1
_STREAM_PICTURES = 2
_STREAM_VARIATION = 3


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(b"images"), stream])


# ---- writing ---------------------------------------------------------------------------------


def write_image_text_source(
    directory: pathlib.Path,
    *,
    rows: int,
    seed: int,
    files: int = 2,
    row_group_rows: int = 250,
    vocab_size: int = 1024,
    progress: Callable[[int, int], None] | None = None,
) -> pathlib.Path:
    """Writes `rows` synthetic image-text samples as Parquet files under `directory`.

    Files are written through a temporary name, then renamed; existing files of the same names
    are overwritten. About 2,000 rows write in about a second.

    Args:
        directory: Where the files go; created if missing.
        rows: Total rows over all files (>= 1).
        seed: Seed of every random draw.
        files: Number of files the rows are split over as evenly as possible, earlier files
            larger; in ``[1, rows]``.
        row_group_rows: Rows per row group (the last group of a file may be smaller); >= 1.
        vocab_size: Caption ids are in ``[0, vocab_size - 1)``; the last id is left to the image
            token. At least 3.
        progress: Called as ``progress(rows_written, rows)`` after each row group.

    Returns:
        `directory`.

    Raises:
        ValueError: an argument out of range.
    """
    problems = []
    if rows < 1:
        problems.append(f"rows must be >= 1, got {rows}")
    if not 1 <= files <= max(rows, 1):
        problems.append(f"files must be in [1, rows], got {files}")
    if row_group_rows < 1:
        problems.append(f"row_group_rows must be >= 1, got {row_group_rows}")
    if not 3 <= vocab_size <= 2**31:
        problems.append(f"vocab_size must be in [3, 2**31], got {vocab_size}")
    if problems:
        raise ValueError("write_image_text_source: " + "; ".join(problems))
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    layout = _rng(seed, _STREAM_LAYOUT)
    counts = layout.choice(len(IMAGE_COUNT_WEIGHTS), size=rows, p=IMAGE_COUNT_WEIGHTS)
    sizes = layout.choice(len(RESOLUTIONS), size=int(counts.sum()), p=[p for _, p in RESOLUTIONS])
    caption_lengths = np.clip(np.rint(_CAPTION_MEDIAN * np.exp(_CAPTION_SIGMA * layout.standard_normal(rows))), *_CAPTION_RANGE).astype(
        np.int64
    )
    captions = _captions(caption_lengths, vocab_size=vocab_size - 1, rng=_rng(seed, _STREAM_CAPTIONS))
    bases = _base_pictures(_rng(seed, _STREAM_PICTURES))
    variation = _rng(seed, _STREAM_VARIATION)

    caption_offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(caption_lengths, out=caption_offsets[1:])
    image_offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(counts, out=image_offsets[1:])
    written = 0
    for index, part in enumerate(np.array_split(np.arange(rows), files)):
        path = directory / f"part-{index:05d}.parquet"
        tmp = directory / f".{path.name}.tmp"
        with pq.ParquetWriter(tmp, SCHEMA, compression="zstd", write_page_checksum=True) as writer:
            for start in range(int(part[0]), int(part[-1]) + 1, row_group_rows):
                stop = min(start + row_group_rows, int(part[-1]) + 1)
                first, last = image_offsets[start], image_offsets[stop]
                jpegs = [_encode(_vary(bases[k], variation)) for k in sizes[first:last]]
                table = pa.Table.from_arrays(
                    [
                        pa.ListArray.from_arrays(
                            pa.array(caption_offsets[start : stop + 1] - caption_offsets[start], pa.int32()),
                            pa.array(captions[caption_offsets[start] : caption_offsets[stop]]),
                        ),
                        pa.ListArray.from_arrays(
                            pa.array(image_offsets[start : stop + 1] - first, pa.int32()),
                            pa.array(jpegs, pa.binary()),
                        ),
                        pa.array(np.arange(start, stop, dtype=np.int64)),
                    ],
                    schema=SCHEMA,
                )
                writer.write_table(table, row_group_size=stop - start)
                written += stop - start
                if progress is not None:
                    progress(written, rows)
        os.replace(tmp, path)
    return directory


def _captions(lengths: np.ndarray, *, vocab_size: int, rng: np.random.Generator) -> np.ndarray:
    """Caption ids of all rows, concatenated (int32): a sparse order-1 Markov chain over
    ``[0, vocab_size)`` with 5% uniform noise, so a language model can learn something."""
    successors = rng.integers(0, vocab_size, size=(vocab_size, 3))
    width = int(lengths.max())
    uniform = rng.integers(0, vocab_size, size=(len(lengths), width))
    choice = rng.choice(3, size=(len(lengths), width), p=[6 / 11, 3 / 11, 2 / 11])
    noise = rng.random((len(lengths), width)) < 0.05
    grid = np.empty((len(lengths), width), dtype=np.int64)
    grid[:, 0] = uniform[:, 0]
    for t in range(1, width):
        step = successors[grid[:, t - 1], choice[:, t]]
        grid[:, t] = np.where(noise[:, t], uniform[:, t], step)
    return grid[np.arange(width)[None, :] < lengths[:, None]].astype(np.int32)


def _base_pictures(rng: np.random.Generator) -> list[list[Image.Image]]:
    """`_VARIANTS` smooth RGB pictures per entry of `RESOLUTIONS`: crops of `_VARIANTS`
    canvases of gradients, waves and a little noise."""
    side = max(max(size) for size, _ in RESOLUTIONS)
    x = np.linspace(0, 1, side, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, side, dtype=np.float32)[:, None]
    canvases = []
    for _ in range(_VARIANTS):
        canvas = np.empty((side, side, 3), dtype=np.float32)
        for c in range(3):
            a = rng.uniform(-1, 1, size=3)
            canvas[..., c] = 128 + 60 * (a[0] * x + a[1] * y + a[2] * x * y)
            for fx, fy, phase in rng.uniform((0.5, 0.5, 0), (6, 6, 2 * np.pi), size=(3, 3)):
                # sin(u + v) = sin u cos v + cos u sin v: two outer products instead of side**2 sines.
                u, v = 2 * np.pi * fx * x + phase, 2 * np.pi * fy * y
                canvas[..., c] += rng.uniform(10, 40) * (np.sin(u) * np.cos(v) + np.cos(u) * np.sin(v))
        canvas += rng.normal(0, 3, size=canvas.shape).astype(np.float32)
        canvases.append(np.clip(canvas, 0, 255).astype(np.uint8))
    bases = []
    for (width, height), _ in RESOLUTIONS:
        variants = []
        for canvas in canvases:
            top, left = int(rng.integers(side - height + 1)), int(rng.integers(side - width + 1))
            variants.append(Image.fromarray(canvas[top : top + height, left : left + width]))
        bases.append(variants)
    return bases


def _vary(variants: list[Image.Image], rng: np.random.Generator) -> Image.Image:
    """One of `variants`, circularly shifted and tinted."""
    picture = variants[int(rng.integers(len(variants)))]
    width, height = picture.size
    shifted = ImageChops.offset(picture, int(rng.integers(width)), int(rng.integers(height)))
    ramp = np.arange(256)
    lut = np.clip(ramp[None, :] + rng.integers(-24, 25, size=(3, 1)), 0, 255)
    return shifted.point(lut.ravel().tolist())


def _encode(picture: Image.Image) -> bytes:
    out = io.BytesIO()
    picture.save(out, format="JPEG", quality=_JPEG_QUALITY)
    return out.getvalue()


# ---- the transform ---------------------------------------------------------------------------


def image_grid(width: int, height: int, *, patch: int = 14, max_side: int = 448) -> tuple[int, int]:
    """Patches per row and per column of a `width` x `height` image once resized.

    The image is scaled down (never up) so its longer side is at most `max_side`, keeping the
    aspect ratio; each side is then rounded to the nearest multiple of `patch`, at least one
    patch and at most ``max_side // patch`` patches.

    Args:
        width: Image width in pixels (>= 1).
        height: Image height in pixels (>= 1).
        patch: Patch side in pixels.
        max_side: Largest side in pixels after resizing (>= patch).

    Returns:
        ``(columns, rows)``; the image contributes ``columns * rows`` image tokens.
    """
    scale = min(1.0, max_side / max(width, height))
    most = max_side // patch
    columns = min(most, max(1, round(width * scale / patch)))
    rows = min(most, max(1, round(height * scale / patch)))
    return columns, rows


def _decode_on_grid(data: bytes, *, patch: int, max_side: int) -> tuple[Image.Image, tuple[int, int]] | None:
    """One JPEG decoded in full to RGB and resized (bilinear) to its `image_grid` of patches:
    (the image, (rows, columns)); None when `data` is not a decodable JPEG."""
    try:
        with Image.open(io.BytesIO(data), formats=("JPEG",)) as image:
            rgb = image.convert("RGB")  # decodes every pixel; a truncated file raises here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    columns, rows = image_grid(*rgb.size, patch=patch, max_side=max_side)
    size = (columns * patch, rows * patch)
    if rgb.size != size:
        rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    return rgb, (rows, columns)


def patchify(data: bytes, *, patch: int = 14, max_side: int = 448) -> np.ndarray | None:
    """Decodes one JPEG and cuts it into patches.

    The image is decoded in full, converted to RGB, resized (bilinear) to the grid of
    `image_grid` and split into non-overlapping `patch` x `patch` patches in row-major order.

    Args:
        data: JPEG bytes.
        patch: Patch side in pixels.
        max_side: Largest side in pixels after resizing.

    Returns:
        float32 array ``[num_patches, patch * patch * 3]`` with values in [0, 1], each row one
        patch's pixels in (y, x, channel) order; None when `data` is not a decodable JPEG.
    """
    decoded = _decode_on_grid(data, patch=patch, max_side=max_side)
    if decoded is None:
        return None
    rgb, (rows, columns) = decoded
    pixels = np.asarray(rgb, dtype=np.float32) * np.float32(1 / 255)
    return pixels.reshape(rows, patch, columns, patch, 3).transpose(0, 2, 1, 3, 4).reshape(rows * columns, patch * patch * 3)


def pixel_patches(
    data: bytes, *, patch: int = 14, max_side: int = 448, temporal_patch: int = 1
) -> tuple[np.ndarray, tuple[int, int]] | None:
    """Decodes one JPEG into raw pixel patches as a Qwen2-VL-style vision encoder takes them.

    The image is decoded, resized to the grid of `image_grid` like `patchify`, and cut into
    patches in row-major order; each patch row holds its pixels channel first, then the
    `temporal_patch` frames (a still image repeats itself, as Qwen2-VL's processor does), then
    y, then x: uint8 ``[rows * columns, 3 * temporal_patch * patch * patch]``. Values stay raw
    (0..255): the trainer normalizes them on its device, so the bytes shipped are a quarter of
    float32 patches.

    Returns:
        (the patches, (rows, columns)); None when `data` is not a decodable JPEG.
    """
    decoded = _decode_on_grid(data, patch=patch, max_side=max_side)
    if decoded is None:
        return None
    rgb, (rows, columns) = decoded
    pixels = np.asarray(rgb, dtype=np.uint8).reshape(rows, patch, columns, patch, 3)
    channel_first = pixels.transpose(0, 2, 4, 1, 3)  # [rows, columns, 3, patch, patch]
    frames = np.broadcast_to(channel_first[:, :, :, None], (rows, columns, 3, temporal_patch, patch, patch))
    return np.ascontiguousarray(frames).reshape(rows * columns, 3 * temporal_patch * patch * patch), (rows, columns)


def image_text(
    batch: pa.Table,
    *,
    patch: int = 14,
    max_side: int = 448,
    image_token_id: int = IMAGE_TOKEN_ID,
    caption_column: str = "caption",
    images_column: str = "images",
    pixels: bool = False,
    temporal_patch: int = 1,
) -> pa.Table:
    """The image-text transform: decodes and patchifies each sample's images.

    Every image is decoded and patchified (real work: full JPEG decode, resize, patches). The
    sample's `input_ids` are `image_token_id` once per patch of each image, images in order,
    followed by the caption's ids, as the token sequence a vision-language backbone sees.

    With `pixels`, the images travel too, as the job's payload columns (declare them in
    `batch.payload`, see `PAYLOAD`): `pixel_values`, a blob of uint8 rows
    ``[patches, 3 * temporal_patch * patch * patch]`` (`pixel_patches`), and
    `image_grid_thw`, a blob of int64 rows ``[images, 3]`` = (1, rows, columns) per image,
    whose products sum to the sample's patch rows and to its image tokens. Without it, the
    patches are only counted (float32 patches, `patchify`).

    A sample with an image that is not a decodable JPEG (or a null image) is rejected (null
    `input_ids`); its neighbours are unaffected. A sample with no images (or a null image list)
    is text-only. A null caption counts as empty.

    Args:
        batch: Rows with a `caption_column` of token-id lists and an `images_column` of lists
            of JPEG bytes.
        patch: Patch side in pixels (>= 1).
        max_side: Longest image side in pixels after resizing (>= patch).
        image_token_id: Token id standing for one image patch; in ``[0, 2**31)``.
        caption_column: Name of the caption column.
        images_column: Name of the image column.
        pixels: Ship the pixels (`pixel_values`, `image_grid_thw`).
        temporal_patch: Frames per patch row (Qwen2-VL: 2); >= 1.

    Returns:
        One row per input row: `input_ids` (list<int32>, null for a rejected sample), the
        per-sample features `num_images` and `image_tokens` (int32; null for a rejected
        sample), and with `pixels` the two payload columns.

    Raises:
        ValueError: `patch`, `max_side`, `temporal_patch` or `image_token_id` out of range.
        KeyError: a named column is missing.
        pyarrow.ArrowInvalid: caption ids that are not integers fitting in int32.
    """
    if patch < 1 or max_side < patch:
        raise ValueError(f"need patch >= 1 and max_side >= patch, got patch={patch}, max_side={max_side}")
    if not 0 <= image_token_id < 2**31:
        raise ValueError(f"image_token_id must be in [0, 2**31), got {image_token_id}")
    if temporal_patch < 1:
        raise ValueError(f"temporal_patch must be >= 1, got {temporal_patch}")
    images = batch.column(images_column).combine_chunks()
    captions = batch.column(caption_column).combine_chunks().cast(pa.list_(pa.int32()))
    n = batch.num_rows

    num_images = pc.fill_null(pc.list_value_length(images), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(images).to_pylist()  # bytes (or None) per image, rows in order
    if pixels:
        decoded = [
            None if data is None else pixel_patches(data, patch=patch, max_side=max_side, temporal_patch=temporal_patch) for data in flat
        ]
        tokens_per_image = np.array([-1 if d is None else len(d[0]) for d in decoded], dtype=np.int64)
    else:
        tokens_per_image = np.array([-1 if data is None else _patch_count(data, patch, max_side) for data in flat], dtype=np.int64)
    owner = np.repeat(np.arange(n), num_images)
    rejected = np.zeros(n, dtype=bool)
    rejected[owner[tokens_per_image < 0]] = True
    image_tokens = np.bincount(owner, weights=np.maximum(tokens_per_image, 0), minlength=n).astype(np.int64)
    image_tokens[rejected] = 0

    stored_lengths = pc.fill_null(pc.list_value_length(captions), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    caption_values = pc.list_flatten(captions).to_numpy(zero_copy_only=False)[np.repeat(~rejected, stored_lengths)]
    caption_lengths = np.where(rejected, 0, stored_lengths)

    lengths = image_tokens + caption_lengths
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.full(int(offsets[-1]), image_token_id, dtype=np.int32)
    caption_starts = offsets[:-1] + image_tokens  # where each row's caption goes
    caption_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(caption_lengths, out=caption_offsets[1:])
    shift = np.repeat(caption_starts - caption_offsets[:-1], caption_lengths)
    values[np.arange(len(caption_values)) + shift] = caption_values
    input_ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values), mask=pa.array(rejected))
    columns = {
        "input_ids": input_ids,
        "num_images": pa.array(num_images.astype(np.int32), mask=rejected),
        "image_tokens": pa.array(image_tokens.astype(np.int32), mask=rejected),
    }
    if pixels:
        columns.update(_pixel_columns(decoded, owner, rejected, patch=patch, temporal_patch=temporal_patch))
    return pa.table(columns)


#: The payload columns `image_text(pixels=True)` returns, for a job's `batch.payload` (patch 14,
#: temporal_patch 1; a row is 3 * temporal_patch * patch * patch bytes).
PAYLOAD = (
    {"name": "pixel_values", "kind": "blob", "dtype": "uint8", "shape": [3 * 14 * 14]},
    {"name": "image_grid_thw", "kind": "blob", "dtype": "int64", "shape": [3]},
)


def _pixel_columns(
    decoded: list[tuple[np.ndarray, tuple[int, int]] | None], owner: np.ndarray, rejected: np.ndarray, *, patch: int, temporal_patch: int
) -> dict[str, pa.Array]:
    """`pixel_values` and `image_grid_thw` of every sample (none for a rejected one), as flat
    list arrays (blob rows flattened), with no per-pixel Python."""
    n = len(rejected)
    keep = [i for i, d in enumerate(decoded) if d is not None and not rejected[owner[i]]]
    row_bytes = 3 * temporal_patch * patch * patch
    patches = np.zeros(n, np.int64)
    np.add.at(patches, owner[keep], [len(decoded[i][0]) for i in keep])
    images = np.bincount(owner[keep], minlength=n).astype(np.int64)
    pixel_offsets = np.zeros(n + 1, np.int64)
    np.cumsum(patches * row_bytes, out=pixel_offsets[1:])
    grid_offsets = np.zeros(n + 1, np.int64)
    np.cumsum(images * 3, out=grid_offsets[1:])
    pixel_values = np.concatenate([decoded[i][0].reshape(-1) for i in keep]) if keep else np.zeros(0, np.uint8)
    grids = np.array([(1, *decoded[i][1]) for i in keep], np.int64).reshape(-1)
    return {
        "pixel_values": pa.ListArray.from_arrays(pa.array(pixel_offsets.astype(np.int32)), pa.array(pixel_values)),
        "image_grid_thw": pa.ListArray.from_arrays(pa.array(grid_offsets.astype(np.int32)), pa.array(grids)),
    }


def _patch_count(data: bytes, patch: int, max_side: int) -> int:
    """Patches of one image after `patchify`; -1 when it does not decode."""
    patches = patchify(data, patch=patch, max_side=max_side)
    return -1 if patches is None else len(patches)
