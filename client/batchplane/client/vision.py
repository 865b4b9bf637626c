"""Qwen2-VL-style vision inputs from a rank's delivered images. Pure torch: no I/O, no grpc.

A secondary graph that delivers the image columns (`images.deliver("pixel_values",
"image_grid_thw")` in the strategy, both declared in the job's `batch.payload` as blobs) puts,
in each rank's `batch["subbatches"]["images"]`, exactly the images that rank encodes:

- `pixel_values` uint8 [ΣP, C·t·p·p]: one row per patch, its pixels channel first, then the
  t frames, then y, then x (raw 0..255);
- `image_grid_thw` int64 [n_images, 3]: (t, h, w) in patches per image, the blob's rows;
- `pixel_values_offsets`, `image_grid_thw_offsets` int32 [samples + 1]: each sample's rows.

A job without such a graph carries the same columns in each microbatch; `vision_inputs` takes
either mapping. The pixels are shipped as uint8 (a quarter of float32's bytes); with `dtype`,
they are moved to `device` first and normalized and cast there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

#: CLIP's (and Qwen2-VL's) per-channel pixel mean and standard deviation, on the [0, 1] scale.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

__all__ = ["CLIP_MEAN", "CLIP_STD", "VisionBatchError", "VisionInputs", "vision_inputs"]


class VisionBatchError(ValueError):
    """The delivered image tensors disagree with each other (the message says how)."""


@dataclasses.dataclass(frozen=True)
class VisionInputs:
    """A vision encoder's inputs for one rank's images.

    Attributes:
        pixel_values: [ΣP, C·t·p·p]: uint8 as delivered, or normalized in the asked dtype.
        image_grid_thw: int64 [n_images, 3], (t, h, w) per image; the products sum to ΣP.
        cu_seqlens: int32 [n_images + 1]: image i's patches are rows cu_seqlens[i]:cu_seqlens[i + 1].
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    cu_seqlens: torch.Tensor

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def vision_inputs(
    images: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
) -> VisionInputs:
    """The vision inputs of a rank's images (`batch["subbatches"]["images"]`, or a microbatch
    that carries the image columns).

    Args:
        images: Tensors by name: pixel_values, image_grid_thw (and, checked when present, their
            `_offsets`).
        dtype: A floating dtype to normalize the pixels to ((x / 255 - mean[c]) / std[c] per
            channel c); None keeps them uint8.
        device: Where the tensors go (the pixels are moved before they are normalized, so only
            uint8 bytes cross to it); None leaves them where they are.
        mean, std: Per-channel mean and standard deviation on the [0, 1] scale (CLIP's by default);
            their length is the channel count C, which must divide a pixel row.
    Returns:
        The pixel values, grids and vision cu_seqlens (on `device`).
    Raises:
        VisionBatchError: a missing tensor, pixels that are not uint8 [ΣP, row], grids that are
            not [n, 3] with positive entries, grid products that do not sum to ΣP (in all, or
            per sample when offsets are present), or a row that the channels do not divide.
        ValueError: `dtype` not a floating dtype, or mean and std of different lengths.
    """
    for name in ("pixel_values", "image_grid_thw"):
        if name not in images:
            raise VisionBatchError(
                f"no {name!r} among the tensors {sorted(images)}: does the strategy deliver it (DGraph.deliver) and the job declare it?"
            )
    pixels, grid = images["pixel_values"], images["image_grid_thw"]
    if pixels.dtype != torch.uint8 or pixels.dim() != 2:
        raise VisionBatchError(f"pixel_values must be uint8 [patches, row], got {pixels.dtype} {list(pixels.shape)}")
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise VisionBatchError(f"image_grid_thw must be [images, 3], got {list(grid.shape)}")
    grid = grid.to(torch.int64)
    if grid.numel() and int(grid.min()) < 1:
        raise VisionBatchError("image_grid_thw has an extent below 1")
    patches = grid.prod(dim=1)
    total = int(patches.sum())
    if total != pixels.shape[0]:
        raise VisionBatchError(f"the image grids' t*h*w products sum to {total} patches, but pixel_values has {pixels.shape[0]} rows")
    if "pixel_values_offsets" in images and "image_grid_thw_offsets" in images:
        _check_per_sample(patches, images["pixel_values_offsets"], images["image_grid_thw_offsets"])
    cu_seqlens = torch.zeros(len(patches) + 1, dtype=torch.int32)
    if len(patches):
        cu_seqlens[1:] = torch.cumsum(patches.cpu(), dim=0)
    if device is not None:
        pixels, grid, cu_seqlens = pixels.to(device, non_blocking=True), grid.to(device), cu_seqlens.to(device)
    else:
        cu_seqlens = cu_seqlens.to(grid.device)
    if dtype is not None:
        pixels = _normalize(pixels, dtype=dtype, mean=mean, std=std)
    return VisionInputs(pixels, grid, cu_seqlens)


def _check_per_sample(patches: torch.Tensor, pixel_offsets: torch.Tensor, grid_offsets: torch.Tensor) -> None:
    """Each sample's grid products sum to its pixel rows."""
    if pixel_offsets.shape != grid_offsets.shape:
        raise VisionBatchError(
            f"pixel_values_offsets {list(pixel_offsets.shape)} and image_grid_thw_offsets {list(grid_offsets.shape)} count other samples"
        )
    cumulative = torch.zeros(len(patches) + 1, dtype=torch.int64)
    if len(patches):
        cumulative[1:] = torch.cumsum(patches.cpu(), dim=0)
    g = grid_offsets.cpu().to(torch.int64)
    if len(g) and (int(g.min()) < 0 or int(g.max()) > len(patches)):
        raise VisionBatchError(f"image_grid_thw_offsets outside [0, {len(patches)}]")
    got = cumulative[g]
    want = pixel_offsets.cpu().to(torch.int64)
    bad = torch.nonzero(got != want).flatten()
    if len(bad):
        b = int(bad[0])
        raise VisionBatchError(
            f"at sample boundary {b}, the image grids cover {int(got[b])} patches but pixel_values_offsets says {int(want[b])}"
        )


def _normalize(pixels: torch.Tensor, *, dtype: torch.dtype, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    if len(mean) != len(std) or not mean:
        raise ValueError(f"mean and std need one entry per channel, got {len(mean)} and {len(std)}")
    channels = len(mean)
    rows, width = pixels.shape
    if width % channels:
        raise VisionBatchError(f"a pixel row of {width} values does not split into {channels} channels")
    scale = torch.tensor([1 / (255 * s) for s in std], dtype=torch.float32, device=pixels.device)
    shift = torch.tensor([m / s for m, s in zip(mean, std)], dtype=torch.float32, device=pixels.device)
    x = pixels.view(rows, channels, width // channels).to(torch.float32)
    return (x * scale[:, None] - shift[:, None]).to(dtype).view(rows, width)
