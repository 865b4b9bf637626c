"""`batchplane.client.vision`: Qwen2-VL-style inputs from a rank's delivered images — grids and
pixel rows checked against each other, vision cu_seqlens, and normalization per channel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchplane.client.vision import CLIP_MEAN, CLIP_STD, VisionBatchError, vision_inputs

ROW = 3 * 2 * 14 * 14  # C * t * p * p


def _images(grids: list[list[tuple[int, int, int]]], *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A subbatch of samples with these images' (t, h, w) grids, pixels random."""
    rng = np.random.default_rng(seed)
    flat = [g for sample in grids for g in sample]
    patches = sum(t * h * w for t, h, w in flat)
    per_sample = [sum(t * h * w for t, h, w in sample) for sample in grids]
    return {
        "pixel_values": torch.from_numpy(rng.integers(0, 256, (patches, ROW), dtype=np.uint8)),
        "pixel_values_offsets": torch.tensor(np.concatenate([[0], np.cumsum(per_sample)]), dtype=torch.int32),
        "image_grid_thw": torch.tensor(flat, dtype=torch.int64).reshape(-1, 3),
        "image_grid_thw_offsets": torch.tensor(np.concatenate([[0], np.cumsum([len(s) for s in grids])]), dtype=torch.int32),
    }


def test_grids_pixels_and_cu_seqlens_of_a_rank_s_images() -> None:
    images = _images([[(1, 2, 3), (2, 1, 1)], [], [(1, 4, 4)]])
    got = vision_inputs(images)
    assert got.pixel_values.dtype == torch.uint8 and got.pixel_values.data_ptr() == images["pixel_values"].data_ptr()  # no copy
    assert got.image_grid_thw.tolist() == [[1, 2, 3], [2, 1, 1], [1, 4, 4]] and got.num_images == 3
    assert got.cu_seqlens.dtype == torch.int32 and got.cu_seqlens.tolist() == [0, 6, 8, 24]


def test_no_images_gives_empty_inputs() -> None:
    got = vision_inputs(_images([[], []]))
    assert got.pixel_values.shape == (0, ROW) and got.image_grid_thw.shape == (0, 3) and got.cu_seqlens.tolist() == [0]


def test_normalized_pixels_equal_the_formula_per_channel() -> None:
    images = _images([[(2, 2, 2)]], seed=3)
    got = vision_inputs(images, dtype=torch.float32, device="cpu")
    raw = images["pixel_values"].numpy().astype(np.float64).reshape(-1, 3, ROW // 3) / 255
    want = (raw - np.array(CLIP_MEAN)[None, :, None]) / np.array(CLIP_STD)[None, :, None]
    assert got.pixel_values.dtype == torch.float32 and got.pixel_values.shape == (8, ROW)
    np.testing.assert_allclose(got.pixel_values.numpy().reshape(-1, 3, ROW // 3), want, atol=1e-5)
    half = vision_inputs(images, dtype=torch.bfloat16, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    np.testing.assert_allclose(half.pixel_values.float().numpy(), images["pixel_values"].numpy() / 127.5 - 1, atol=1e-2)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"image_grid_thw": torch.tensor([[1, 2, 3], [2, 1, 1], [1, 4, 5]])}, r"products sum to 28 patches, but pixel_values has 24 rows"),
        ({"image_grid_thw": torch.tensor([[1, 2, 3], [2, 1, 1], [1, 4, 4], [1, 1, 1]])}, r"sum to 25 patches"),
        ({"image_grid_thw": torch.tensor([[1, 2, 3, 1]])}, r"must be \[images, 3\]"),
        ({"image_grid_thw": torch.tensor([[1, 0, 3], [2, 1, 1], [1, 4, 6]])}, r"extent below 1"),
        ({"pixel_values": torch.zeros(24, ROW, dtype=torch.float32)}, r"must be uint8"),
        ({"pixel_values_offsets": torch.tensor([0, 7, 8, 24], dtype=torch.int32)}, r"cover 8 patches but pixel_values_offsets says 7"),
        ({"image_grid_thw": None}, r"no 'image_grid_thw'"),
    ],
)
def test_tensors_that_disagree_are_refused_saying_how(change, names) -> None:
    images = {**_images([[(1, 2, 3), (2, 1, 1)], [], [(1, 4, 4)]]), **change}
    images = {k: v for k, v in images.items() if v is not None}
    with pytest.raises(VisionBatchError, match=names):
        vision_inputs(images)


def test_a_row_the_channels_do_not_divide_and_a_non_float_dtype_are_refused() -> None:
    images = {"pixel_values": torch.zeros(2, 10, dtype=torch.uint8), "image_grid_thw": torch.tensor([[1, 1, 2]])}
    with pytest.raises(VisionBatchError, match="does not split into 3 channels"):
        vision_inputs(images, dtype=torch.float32)
    with pytest.raises(ValueError, match="floating dtype"):
        vision_inputs(_images([[(1, 1, 1)]]), dtype=torch.int32)
