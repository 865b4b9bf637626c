"""A tiny language model trained with data-parallel ranks fed by batchplane.

Run one process per rank (`batchplane demo` starts two):

    BATCHPLANE_ENDPOINTS=.../endpoints.json python -m batchplane.examples.tiny_lm \
        --rank 0 --world-size 2 --master-port 29512 --steps 300

Gradients are averaged over ranks with DistributedDataParallel (gloo, CPU). The loss of every
microbatch is summed over its tokens and divided by the step's loss-carrying tokens over all
ranks (`global_loss_tokens`), so a step's update is the exact token-mean gradient however the
planner balanced samples over ranks and microbatches.

Images (the demo's image-text source ships its pixels as blob columns, `batch.payload`): a tiny
patch encoder (a Linear of each 3x14x14 patch, normalized on the device by
`batchplane.client.vision.vision_inputs`) embeds every patch, and each embedding is added to
the embedding of its image placeholder token (one per patch, in front of the sample's caption),
as a Qwen2-VL-style model merges its vision tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from batchplane.client import Client
from batchplane.client.vision import vision_inputs

IGNORE_ID = -100
#: The demo's image placeholder token (`batchplane.demo.images.IMAGE_TOKEN_ID`).
IMAGE_TOKEN_ID = 1023
#: Values in a patch row: 3 channels x 14 x 14 pixels (`batchplane.demo.images.PAYLOAD`).
PATCH_VALUES = 3 * 14 * 14


class TinyLM(nn.Module):
    """Embedding, two causal convolution blocks and an output projection."""

    def __init__(self, vocab_size: int, dim: int = 64, kernel: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.kernel = kernel
        self.convs = nn.ModuleList([nn.Conv1d(dim, dim, kernel) for _ in range(2)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        self.patches = nn.Linear(PATCH_VALUES, dim)  # the tiny vision encoder

    def forward(self, input_ids: torch.Tensor, where: torch.Tensor, images: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [N, vocab] at the N positions where `where` ([B, L] bool) is True. `images`:
        the microbatch's pixel_values, image_grid_thw and their offsets (one row per sample)."""
        x = self.embed(input_ids)  # [B, L, D]
        if images is not None:
            x = x + self._vision(images, input_ids, x.shape)
        else:  # a job without pixels: the encoder still takes part (DDP wants every parameter used)
            x = x + 0.0 * sum(p.sum() for p in self.patches.parameters())
        for conv, mlp in zip(self.convs, self.mlps):
            h = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))  # causal: pad on the left
            x = x + conv(h).transpose(1, 2)
            x = x + mlp(x)
        return self.head(self.norm(x[where]))  # only positions with a label: no padding

    def _vision(self, images: dict[str, torch.Tensor], input_ids: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[B, L, D]: each patch's embedding at its placeholder token (sample b's patches are its
        first tokens), zero elsewhere. Runs on an empty set of patches too (DDP wants every
        parameter used)."""
        vision = vision_inputs(images, dtype=torch.float32, device=input_ids.device)
        embedded = self.patches(vision.pixel_values)  # [ΣP, D]
        offsets = images["pixel_values_offsets"].long()
        counts = offsets[1:] - offsets[:-1]
        rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
        columns = torch.arange(len(rows)) - torch.repeat_interleave(offsets[:-1], counts)
        if len(rows) and not bool((input_ids[rows, columns] == IMAGE_TOKEN_ID).all()):
            raise ValueError("a patch does not land on an image placeholder token")
        return torch.zeros(shape).index_put((rows, columns), embedded, accumulate=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--stats", type=pathlib.Path, help="write this rank's figures here as JSON")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.master_port}", rank=args.rank, world_size=args.world_size)
    model = nn.parallel.DistributedDataParallel(TinyLM(args.vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = {"rank": args.rank, "steps": 0, "samples": 0, "tokens": 0, "data_wait_s": 0.0, "compute_s": 0.0, "per_source": {}}
    losses: list[float] = []
    begin = time.perf_counter()
    with Client(rank=args.rank) as client:
        for batch in client:
            if batch["step"] >= args.steps:
                break
            started = time.perf_counter()
            loss_sum = torch.zeros(())
            microbatches = batch["microbatches"]
            for i, mb in enumerate(microbatches):
                sync = contextlib.nullcontext() if i == len(microbatches) - 1 else model.no_sync()
                with sync:
                    labels = mb["labels"].long()
                    where = labels != IGNORE_ID
                    images = mb if "pixel_values" in mb and len(mb["sample_row"]) == len(mb["input_ids"]) else None
                    loss = F.cross_entropy(model(mb["input_ids"].long(), where, images), labels[where], reduction="sum")
                    # DDP averages gradients over ranks; scale so the sum is the global token mean.
                    (loss * args.world_size / max(batch["global_loss_tokens"], 1)).backward()
                loss_sum += loss.detach()
                stats["samples"] += len(mb["sample_row"])
                stats["tokens"] += mb["num_tokens"]
                for k in mb["sample_source"].tolist():
                    name = batch["sources"][k]
                    stats["per_source"][name] = stats["per_source"].get(name, 0) + 1
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(loss_sum)
            step_loss = loss_sum.item() / max(batch["global_loss_tokens"], 1)
            losses.append(step_loss)
            stats["steps"] += 1
            stats["data_wait_s"] += batch["data_wait_s"]
            stats["compute_s"] += time.perf_counter() - started
            if args.rank == 0 and (batch["step"] % args.log_every == 0 or batch["step"] == args.steps - 1):
                elapsed = time.perf_counter() - begin
                print(
                    f"step {batch['step']:>4}/{args.steps}  loss {step_loss:6.3f}  "
                    f"{stats['tokens'] * args.world_size / elapsed:9.0f} tokens/s  "
                    f"data wait {100 * stats['data_wait_s'] / elapsed:4.1f}%",
                    flush=True,
                )
    stats["elapsed_s"] = time.perf_counter() - begin
    stats["first_loss"] = sum(losses[:10]) / max(len(losses[:10]), 1)
    stats["last_loss"] = sum(losses[-10:]) / max(len(losses[-10:]), 1)
    if args.stats:
        args.stats.write_text(json.dumps(stats))
    # Rank 0 hosts the rendezvous store: no rank tears down while another still needs it.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
