"""A vision-language trainer rank for `batchplane bench vlm`: one process per rank, as torchrun
starts them, taking its batches either from batchplane or from a colocated torch DataLoader that
does the same JPEG decode and patchify itself.

    python -m batchplane.examples.vlm_rank --system dataloader --rank 0 --world 2 \
        --microbatch 8 --workers 2 --images data/images --text data/chat
    BATCHPLANE_ENDPOINTS=.../endpoints.json python -m batchplane.examples.vlm_rank \
        --system batchplane --rank 0

- dataloader: a `DataLoader(num_workers=W, prefetch_factor=2, persistent_workers=True)` over
  `ImageTextRows` (the image source's rows, then the text source's, read with pyarrow in each
  worker), sharded by a seeded `DistributedSampler` (shuffle, drop_last). Each worker runs the
  image source's transform, loaded by its import path as a user's DataLoader calls its own
  preprocessing (`--transform`, default the demo's `batchplane.demo.images:image_text` with
  pixels), once per microbatch on that microbatch's image rows (`__getitems__`), and `collate`
  pads the tokens as the constructor does and concatenates the microbatch's pixel_values and
  image_grid_thw. A step is `--microbatches` microbatches.
- batchplane: a `Client` of the rank; its pixels are `batch["subbatches"]["images"]` (the images
  this rank encodes, as `examples/strategies/vlm.py` delivers them).

Either way the rank reads every pixel byte it received (`touch`), then spends `--step-seconds`
(its "forward and backward"), and writes one JSON line per step to stdout: {"step", "wait_s"
(time blocked on the next batch), "received" (Unix time), "samples", "images", "pixel_bytes"}.
After its first step it waits for a line "go" on stdin (the harness sends it once every rank has
its first step); after its last it prints {"done": true, "transport"} and keeps its process (and
its DataLoader workers) until stdin closes, so the harness reads their CPU time and memory.

It lives in the client package because it needs torch, which the services never import; it
never imports service code (the transform is imported by name at run time, as a user's would be).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, DistributedSampler

from batchplane.examples.dataloader_rank import collate as collate_tokens
from batchplane.examples.dataloader_rank import parquet_files

#: The demo's image-text transform and the arguments a vision-language job gives it.
DEFAULT_TRANSFORM = "batchplane.demo.images:image_text"
DEFAULT_TRANSFORM_ARGS: Mapping[str, Any] = {"pixels": True}
#: A uint8 pixel row of the demo transform's patches (3 channels x 14 x 14).
PIXEL_ROW = 3 * 14 * 14


def load_transform(path: str) -> Callable[..., pa.Table]:
    """The callable named by `path` ("package.module:callable"), imported now.

    Raises:
        ValueError: `path` is not of that form.
        ImportError, AttributeError: no such module or callable.
    """
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"a transform is named 'package.module:callable', got {path!r}")
    return getattr(importlib.import_module(module), name)


class ImageTextRows:
    """A map-style dataset of an image-text source's rows (index 0 .. image rows - 1) followed by
    a text source's (their `input_ids`). The sizes come from the files' footers; the rows are
    read with pyarrow on first access (in each DataLoader worker), all at once.

    `__getitems__` (what the DataLoader's fetcher calls with a microbatch's indices) runs the
    transform once on that microbatch's image rows, as batchplane's loader runs it on a batch;
    each sample is a dict of numpy arrays: input_ids (int32), pixel_values (uint8 [P, row]) and
    image_grid_thw (int64 [images, 3]), the last two empty for a text sample.
    """

    def __init__(
        self,
        image_files: Sequence[pathlib.Path],
        text_files: Sequence[pathlib.Path],
        *,
        transform: str = DEFAULT_TRANSFORM,
        transform_args: Mapping[str, Any] = DEFAULT_TRANSFORM_ARGS,
    ) -> None:
        self.image_files, self.text_files = list(image_files), list(text_files)
        self.transform_path, self.transform_args = transform, dict(transform_args)
        self.image_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in self.image_files)
        self.text_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in self.text_files)
        self._images: pa.Table | None = None
        self._text: pa.ChunkedArray | None = None
        self._transform: Callable[..., pa.Table] | None = None

    def __len__(self) -> int:
        return self.image_rows + self.text_rows

    def _load(self) -> None:
        self._transform = load_transform(self.transform_path)
        self._images = pa.concat_tables([pq.read_table(f, columns=["caption", "images"]) for f in self.image_files]).combine_chunks()
        text = [pq.read_table(f, columns=["input_ids"]).column("input_ids") for f in self.text_files]
        self._text = pa.chunked_array([c for column in text for c in column.chunks], type=pa.list_(pa.int32()))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        if self._transform is None:
            self._load()
        indices = [int(i) for i in indices]
        image_indices = [i for i in indices if i < self.image_rows]
        out: dict[int, dict[str, np.ndarray]] = {}
        if image_indices:
            table = self._transform(self._images.take(image_indices), **self.transform_args)
            out.update(zip(image_indices, _samples(table)))
        for i in indices:
            if i >= self.image_rows:
                ids = self._text[i - self.image_rows].values.to_numpy(zero_copy_only=False)
                out[i] = {
                    "input_ids": ids,
                    "pixel_values": np.zeros((0, PIXEL_ROW), np.uint8),
                    "image_grid_thw": np.zeros((0, 3), np.int64),
                }
        return [out[i] for i in indices]


def _samples(table: pa.Table) -> list[dict[str, np.ndarray]]:
    """Each row of a transform's output as numpy arrays (a rejected row has no tokens and no
    images), without per-element Python."""
    ids = table.column("input_ids").combine_chunks()
    pixels = table.column("pixel_values").combine_chunks()
    grids = table.column("image_grid_thw").combine_chunks()
    id_values, id_offsets = ids.values.to_numpy(zero_copy_only=False), ids.offsets.to_numpy()
    pixel_values, pixel_offsets = pixels.values.to_numpy(zero_copy_only=False), pixels.offsets.to_numpy()
    grid_values, grid_offsets = grids.values.to_numpy(zero_copy_only=False), grids.offsets.to_numpy()
    return [
        {
            "input_ids": id_values[id_offsets[r] : id_offsets[r + 1]],
            "pixel_values": pixel_values[pixel_offsets[r] : pixel_offsets[r + 1]].reshape(-1, PIXEL_ROW),
            "image_grid_thw": grid_values[grid_offsets[r] : grid_offsets[r + 1]].reshape(-1, 3),
        }
        for r in range(table.num_rows)
    ]


def collate(samples: Sequence[Mapping[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """One microbatch of `samples`: the tokens padded as `dataloader_rank.collate` (and the
    constructor) pads them (input_ids, labels, attention_mask, position_ids), and the samples'
    pixel_values (uint8 [ΣP, row]) and image_grid_thw (int64 [images, 3]) concatenated in
    sample order."""
    out = collate_tokens([s["input_ids"] for s in samples])
    out["pixel_values"] = torch.from_numpy(
        np.concatenate([s["pixel_values"] for s in samples]) if samples else np.zeros((0, PIXEL_ROW), np.uint8)
    )
    out["image_grid_thw"] = torch.from_numpy(
        np.concatenate([s["image_grid_thw"] for s in samples]) if samples else np.zeros((0, 3), np.int64)
    )
    return out


def make_loader(
    image_files: Sequence[pathlib.Path],
    text_files: Sequence[pathlib.Path],
    *,
    rank: int,
    world: int,
    microbatch: int,
    workers: int,
    transform: str = DEFAULT_TRANSFORM,
    transform_args: Mapping[str, Any] = DEFAULT_TRANSFORM_ARGS,
    seed: int = 0,
) -> DataLoader:
    """Rank `rank`'s DataLoader: its DistributedSampler share, `microbatch` samples a batch,
    `workers` worker processes (>= 1) each prefetching 2 batches."""
    dataset = ImageTextRows(image_files, text_files, transform=transform, transform_args=transform_args)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(
        dataset,
        batch_size=microbatch,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate,
        num_workers=workers,
        prefetch_factor=2,
        persistent_workers=True,
    )


def touch(pixels: Sequence[torch.Tensor]) -> int:
    """Reads every byte of `pixels` (as a trainer's copy to its device would); returns their bytes."""
    total = 0
    for p in pixels:
        if p.numel():
            p.max()
        total += p.numel() * p.element_size()
    return total


@dataclasses.dataclass
class _Feed:
    """Where a rank's steps come from: `steps` yields (samples, pixel tensors, grid tensors) per
    step; `transport()` says how the last batch came (batchplane) or None; `keep` is held until
    the process ends (the DataLoader's iterator: its workers stay, so their CPU time is read)."""

    steps: Iterator[tuple[int, list[torch.Tensor], list[torch.Tensor]]]
    transport: Callable[[], str | None]
    keep: object = None


def _dataloader_steps(args: argparse.Namespace) -> _Feed:
    loader = make_loader(
        parquet_files(args.images),
        parquet_files(args.text),
        rank=args.rank,
        world=args.world,
        microbatch=args.microbatch,
        workers=args.workers,
        transform=args.transform,
        transform_args=json.loads(args.transform_args),
    )
    batches = iter(loader)  # kept (with its workers) after the last step, until the process ends

    def steps() -> Iterator[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
        for _ in range(len(loader) // args.microbatches):
            microbatches = [next(batches) for _ in range(args.microbatches)]
            yield (
                sum(len(mb["input_ids"]) for mb in microbatches),
                [mb["pixel_values"] for mb in microbatches],
                [mb["image_grid_thw"] for mb in microbatches],
            )

    return _Feed(steps(), lambda: None, keep=batches)


def _batchplane_steps(args: argparse.Namespace) -> _Feed:
    from batchplane.client import Client

    client = Client(rank=args.rank, device=None, timeout_s=args.timeout)
    transport: list[str] = []

    def steps() -> Iterator[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
        with client:
            for batch in client:
                transport[:] = [client.transport]
                images = batch.get("subbatches", {}).get("images", {})
                pixels = [images["pixel_values"]] if "pixel_values" in images else []
                grids = [images["image_grid_thw"]] if "image_grid_thw" in images else []
                yield sum(len(mb["sample_row"]) for mb in batch["microbatches"]), pixels, grids
                del batch, images, pixels, grids  # the slab of this step is released

    return _Feed(steps(), lambda: transport[0] if transport else None)


def main(argv: list[str] | None = None) -> int:
    """One rank's process (see the module docstring)."""
    parser = argparse.ArgumentParser(description="a vision-language rank (bench vlm)")
    parser.add_argument("--system", choices=("dataloader", "batchplane"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="compute time per step (default 0.05)")
    parser.add_argument("--world", type=int, default=1, help="dataloader: ranks")
    parser.add_argument("--microbatch", type=int, default=8, help="dataloader: samples per microbatch")
    parser.add_argument("--microbatches", type=int, default=2, help="dataloader: microbatches per step (default 2)")
    parser.add_argument("--workers", type=int, default=1, help="dataloader: worker processes (default 1)")
    parser.add_argument("--images", nargs="+", default=[], help="dataloader: the image-text source's folder")
    parser.add_argument("--text", nargs="+", default=[], help="dataloader: the text source's folder")
    parser.add_argument(
        "--transform", default=DEFAULT_TRANSFORM, help=f"dataloader: the image rows' transform (default {DEFAULT_TRANSFORM})"
    )
    parser.add_argument(
        "--transform-args", default=json.dumps(dict(DEFAULT_TRANSFORM_ARGS)), help="dataloader: its keyword arguments (JSON)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="batchplane: the client's deadline per batch, seconds")
    args = parser.parse_args(argv)
    feed = (_dataloader_steps if args.system == "dataloader" else _batchplane_steps)(args)
    step = 0
    while True:
        begin = time.perf_counter()
        taken = next(feed.steps, None)
        waited = time.perf_counter() - begin
        if taken is None:
            break
        samples, pixels, grids = taken
        pixel_bytes = touch(pixels)
        line = {
            "step": step,
            "wait_s": waited,
            "received": time.time(),
            "samples": samples,
            "images": sum(int(g.shape[0]) for g in grids),
            "pixel_bytes": pixel_bytes,
        }
        del taken, pixels, grids
        print(json.dumps(line), flush=True)
        if step == 0:
            sys.stdin.readline()  # "go": every rank has its first step (its start-up is behind it)
        time.sleep(args.step_seconds)
        step += 1
    print(json.dumps({"done": True, "transport": feed.transport()}), flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
