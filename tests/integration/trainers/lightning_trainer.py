"""A tiny Lightning trainer over batchplane (tests/integration/test_lightning.py runs it).

`lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp")`, which starts the second rank
itself (this script again), trains an embedding + linear LM on `BatchplaneDataModule` with
manual optimization (one `manual_backward` per microbatch on its token-weighted loss), saves
Lightning checkpoints every `--every` steps and appends, per rank per step, one JSON line to
`<out>/rank<r>.jsonl`: the step, Lightning's global step, (source, row) of every sample of every
microbatch and a hash of every tensor. `--resume CKPT` resumes with `fit(ckpt_path=CKPT)`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from hashes import tensor_hashes

from batchplane.client.lightning import BatchplaneDataModule

VOCAB = 512  # token ids are hashed into a small vocabulary: a test model


class TinyLM(L.LightningModule):
    def __init__(self, out: pathlib.Path) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.out = out
        self._lines = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids.long() % VOCAB))

    def training_step(self, batch: dict) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        scale = self.trainer.world_size / max(batch["global_loss_tokens"], 1)
        total = 0.0
        for mb in batch["microbatches"]:
            labels = mb["labels"].long()
            ignore = mb["ignore_id"]
            labels = torch.where(labels == ignore, ignore, labels % VOCAB)
            loss = F.cross_entropy(self(mb["input_ids"]).flatten(0, 1), labels.flatten(), ignore_index=ignore, reduction="sum")
            self.manual_backward(loss * scale)
            total += float(loss)
        optimizer.step()
        if self._lines is None:
            self._lines = open(self.out / f"rank{self.global_rank}.jsonl", "a")
        line = {
            "step": batch["step"],
            "global_step": self.trainer.global_step - 1,  # counted by optimizer.step() above
            "rank": self.global_rank,
            "samples": [list(zip(mb["sample_source"].tolist(), mb["sample_row"].tolist())) for mb in batch["microbatches"]],
            "hashes": tensor_hashes(batch["microbatches"]),
            "loss_sum": total,
        }
        self._lines.write(json.dumps(line) + "\n")
        self._lines.flush()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--ckpt-dir", type=pathlib.Path, required=True)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save-at-end", action="store_true", help="a second ModelCheckpoint, at the epoch's end: end-step=N.ckpt")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    datamodule = BatchplaneDataModule(timeout_s=60)
    checkpoints = ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}", every_n_train_steps=args.every, save_top_k=-1)
    at_end = [ModelCheckpoint(dirpath=args.ckpt_dir, filename="end-{step}", every_n_epochs=1, save_on_train_epoch_end=True)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1 if args.max_steps == -1 else None,
        max_steps=args.max_steps,
        callbacks=[checkpoints, *(at_end if args.save_at_end else [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLM(args.out), datamodule=datamodule, ckpt_path=args.resume)
    with open(args.out / f"done{trainer.global_rank}.json", "w") as f:
        json.dump({"global_step": trainer.global_step, "state": datamodule.state_dict(), "rank_env": os.environ.get("RANK")}, f)


if __name__ == "__main__":
    main()
