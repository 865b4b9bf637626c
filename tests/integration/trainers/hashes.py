"""What the test trainers record of every tensor they train on: a short hash of its dtype, shape
and bytes, per microbatch (`"<microbatch>.<name>"`), so runs compare tensor for tensor. Shared by
the trainer scripts (run with this folder first on their path) and the tests that compare with
them."""

from __future__ import annotations

import hashlib

import torch


def tensor_hashes(microbatches: list[dict]) -> dict[str, str]:
    out = {}
    for i, mb in enumerate(microbatches):
        for name, value in sorted(mb.items()):
            if isinstance(value, torch.Tensor):
                t = value.detach().cpu().contiguous()
                out[f"{i}.{name}"] = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes()).hexdigest()[:16]
    return out
