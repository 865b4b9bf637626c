"""A trainer rank with a colocated torch DataLoader, the baseline `batchplane bench delivery`
measures batchplane against (its Part B): one process per rank, as torchrun starts them.

    python -m batchplane.examples.dataloader_rank --rank 0 --world 2 --microbatch 16 \
        --microbatches 2 data/web data/code

Its `DataLoader(num_workers=1, prefetch_factor=2, persistent_workers=True)` reads the sources'
Parquet files with pyarrow (`ParquetTokens`), shards them with a seeded `DistributedSampler`
and pads each microbatch as batchplane's constructor does (`collate`). It lives in the client
package because it needs torch, which the services never import.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Sequence

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, DistributedSampler

PAD_ID = 0
IGNORE_ID = -100


def parquet_files(folders: Sequence[str | pathlib.Path]) -> list[pathlib.Path]:
    """The Parquet files of the sources' folders, source after source, each folder's sorted."""
    return [f for folder in folders for f in sorted(pathlib.Path(folder).glob("*.parquet"))]


class ParquetTokens:
    """A map-style dataset of every row's `input_ids` in `files` (in order): item i is row i's
    token ids (an int32 array). The length comes from the files' footers; the rows are read
    with pyarrow on first access (in the DataLoader's worker), all at once."""

    def __init__(self, files: Sequence[pathlib.Path]) -> None:
        self.files = list(files)
        self._length = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        self._values: np.ndarray | None = None
        self._offsets: np.ndarray | None = None

    def __len__(self) -> int:
        return self._length

    def _load(self) -> None:
        values, offsets, base = [], [np.zeros(1, np.int64)], 0
        for f in self.files:
            for chunk in pq.read_table(f, columns=["input_ids"]).column("input_ids").chunks:
                chunk_offsets = chunk.offsets.to_numpy().astype(np.int64)
                values.append(chunk.values.to_numpy()[chunk_offsets[0] : chunk_offsets[-1]])
                offsets.append(chunk_offsets[1:] - chunk_offsets[0] + base)
                base += int(chunk_offsets[-1] - chunk_offsets[0])
        self._values, self._offsets = np.concatenate(values), np.concatenate(offsets)

    def __getitem__(self, index: int) -> np.ndarray:
        if self._values is None:
            self._load()
        return self._values[self._offsets[index] : self._offsets[index + 1]]


def collate(samples: Sequence[np.ndarray], *, pad_id: int = PAD_ID, ignore_id: int = IGNORE_ID) -> dict:
    """One padded microbatch of `samples` (token id arrays), as the constructor lays it out:
    input_ids [B, L] int64 (L: the longest), labels (the next token; `ignore_id` on each row's
    last token and on padding), attention_mask (bool), position_ids (0 .. length - 1, 0 on
    padding)."""
    lengths = np.fromiter((len(s) for s in samples), np.int64, len(samples))
    width = max(int(lengths.max(initial=0)), 1)
    ids = np.full((len(samples), width), pad_id, np.int64)
    labels = np.full((len(samples), width), ignore_id, np.int64)
    for r, tokens in enumerate(samples):
        ids[r, : len(tokens)] = tokens
        labels[r, : len(tokens) - 1] = tokens[1:]
    arange = np.arange(width)
    mask = arange[None, :] < lengths[:, None]
    positions = np.where(mask, arange[None, :], 0)
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "attention_mask": torch.from_numpy(mask),
        "position_ids": torch.from_numpy(positions),
    }


def make_loader(files: Sequence[pathlib.Path], *, rank: int, world: int, microbatch: int, seed: int = 0):
    """Rank `rank`'s DataLoader: its DistributedSampler share, `microbatch` samples a batch."""
    dataset = ParquetTokens(files)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(
        dataset,
        batch_size=microbatch,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate,
        num_workers=1,
        prefetch_factor=2,
        persistent_workers=True,
    )


def main(argv: list[str] | None = None) -> int:
    """One rank's process: takes its steps as fast as its DataLoader gives them, writing one
    JSON line per step to stdout ({"step", "received", "samples"}), then "done". After its first
    step it waits for a line "go" on stdin (the harness sends it once every rank has its first
    step), and after its last it keeps its workers until stdin closes (so the harness reads
    their CPU time)."""
    parser = argparse.ArgumentParser(description="a rank with a colocated DataLoader (bench delivery)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--microbatch", type=int, required=True, help="samples per microbatch")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    parser.add_argument("sources", nargs="+", help="source folders, in job order")
    args = parser.parse_args(argv)
    loader = make_loader(parquet_files(args.sources), rank=args.rank, world=args.world, microbatch=args.microbatch)
    batches = iter(loader)
    steps = len(loader) // args.microbatches
    for step in range(steps):
        microbatches = [next(batches) for _ in range(args.microbatches)]
        samples = sum(len(mb["input_ids"]) for mb in microbatches)
        print(json.dumps({"step": step, "received": time.time(), "samples": samples}), flush=True)
        if step == 0:
            sys.stdin.readline()  # "go": every rank has its first step (its start-up is behind it)
    print("done", flush=True)
    sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
