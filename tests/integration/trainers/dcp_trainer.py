"""A plain data-parallel trainer over `Client()` that checkpoints with
torch.distributed.checkpoint, as on a cluster (tests/integration/test_kill_resume_dcp.py runs
it under `torchrun --nproc_per_node 2`, gloo, CPU).

Every `--every` steps it saves a checkpoint `<ckpt>/step-<n>` (n steps trained):
  --format dcp:   dcp.save({"model": ..., "optim": ..., "data": client}) from every rank (the
                  client is a Stateful; DCP keeps one copy of its rank-agnostic state);
  --format torch: rank 0 alone torch.save()s {"model", "optim", "data": client.state_dict()},
                  as Hugging Face Trainer, Lightning and accelerate save.
Started again, it restores the latest complete checkpoint into every rank (dcp.load, or
torch.load of rank 0's file) and continues to the end of data. Per rank and step it appends one
JSON line to `<out>/rank<r>.jsonl`, flushed: the step, (source, row) of every sample of every
microbatch, a hash of every tensor and the step's loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from hashes import tensor_hashes

from batchplane.client import Client

VOCAB = 512  # token ids are hashed into a small vocabulary: a test model


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids.long() % VOCAB))


def latest_checkpoint(folder: pathlib.Path, fmt: str) -> tuple[int, pathlib.Path] | None:
    """The newest complete checkpoint: a DCP folder with its .metadata (written last), or a
    torch file (renamed into place when complete)."""
    found = []
    for path in folder.glob("step-*"):
        match = re.fullmatch(r"step-(\d+)" + (r"\.pt" if fmt == "torch" else ""), path.name)
        if match and (fmt == "torch" or (path / ".metadata").is_file()):
            found.append((int(match.group(1)), path))
    return max(found) if found else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--ckpt", type=pathlib.Path, required=True)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--format", choices=("dcp", "torch"), default="dcp")
    parser.add_argument("--step-sleep-s", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    args.ckpt.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    client = Client(timeout_s=60)

    # Every rank restores the same checkpoint: rank 0 picks it.
    choice = [latest_checkpoint(args.ckpt, args.format) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    resumed = {"checkpoint": None}
    if choice[0] is not None:
        step, path = choice[0]
        if args.format == "dcp":
            model_state, optim_state = get_state_dict(model, optim)
            state = {"model": model_state, "optim": optim_state, "data": client}
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
            resumed = {"checkpoint": step}
        else:
            saved = torch.load(path, weights_only=True)
            model.module.load_state_dict(saved["model"])
            optim.load_state_dict(saved["optim"])
            client.load_state_dict(saved["data"])
            resumed = {"checkpoint": step, "state_of_rank": saved["data"]["rank"]}
    resumed["state"] = client.state_dict()
    (args.out / f"resumed{rank}.json").write_text(json.dumps(resumed))

    world = dist.get_world_size()
    with open(args.out / f"rank{rank}.jsonl", "a") as lines:
        for batch in client:
            optim.zero_grad()
            scale = world / max(batch["global_loss_tokens"], 1)  # DDP averages over ranks
            total = 0.0
            microbatches = batch["microbatches"]
            for i, mb in enumerate(microbatches):
                labels = mb["labels"].long()
                ignore = mb["ignore_id"]
                labels = torch.where(labels == ignore, ignore, labels % VOCAB)
                with model.no_sync() if i < len(microbatches) - 1 else contextlib.nullcontext():
                    logits = model(mb["input_ids"])
                    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore, reduction="sum")
                    (loss * scale).backward()
                total += float(loss)
            optim.step()
            line = {
                "step": batch["step"],
                "samples": [list(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())) for mb in microbatches],
                "hashes": tensor_hashes(microbatches),
                "loss_sum": total,
            }
            lines.write(json.dumps(line) + "\n")
            lines.flush()
            trained = batch["step"] + 1
            if trained % args.every == 0:
                save(args, trained, model, optim, client, rank)
            time.sleep(args.step_sleep_s)
    (args.out / f"done{rank}.json").write_text(json.dumps({"state": client.state_dict()}))
    client.close()
    dist.barrier()
    dist.destroy_process_group()


def save(args: argparse.Namespace, trained: int, model: torch.nn.Module, optim: torch.optim.Optimizer, client: Client, rank: int) -> None:
    if args.format == "dcp":
        model_state, optim_state = get_state_dict(model, optim)
        dcp.save({"model": model_state, "optim": optim_state, "data": client}, checkpoint_id=str(args.ckpt / f"step-{trained}"))
        return
    if rank == 0:
        path = args.ckpt / f"step-{trained}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(), "data": client.state_dict()}, tmp)
        os.replace(tmp, path)
    dist.barrier()


if __name__ == "__main__":
    main()
