"""Lightning adapter of the client: a `LightningDataModule` whose training data is the rank's
batchplane steps and whose data state lives in Lightning's checkpoints (imports `lightning`).

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from batchplane.client.lightning import BatchplaneDataModule

    trainer = L.Trainer(max_epochs=1, strategy="ddp", callbacks=[ModelCheckpoint(every_n_train_steps=100)])
    trainer.fit(model, datamodule=BatchplaneDataModule())              # RANK, address from the environment
    trainer.fit(model, datamodule=BatchplaneDataModule(), ckpt_path="last.ckpt")   # restarted: the data resume too

One item of `train_dataloader()` is one training step: the batch dict of `Client` (its
"microbatches", "global_loss_tokens", ...; see `batchplane.client.client`). The whole job is one
Lightning epoch: set `max_epochs=1` (a later epoch finds the job's data ended and is empty) or
`max_steps`. The iterable is no DataLoader, so Lightning neither adds a DistributedSampler nor
re-shards it: each rank receives exactly its own share, planned by the data plane. The epoch ends
where the data does, which can be a few steps before `len()` (an upper bound where bad samples
are substituted): to checkpoint that last step, add `ModelCheckpoint(every_n_epochs=1,
save_on_train_epoch_end=True)` (one with `every_n_train_steps` saves on its steps only).

Resuming. Lightning saves `BatchplaneDataModule.state_dict()` in every checkpoint (rank 0's; the
state is rank-agnostic, so it restores every rank) and hands it back on
`trainer.fit(..., ckpt_path=...)` before the first batch is asked for; the data plane continues
at the step after the checkpoint, rewinding if it served further (Lightning 2.6 never skips
batches of an iterable on resume: it only restores its counters, and `len()` is the job's whole
length, so the epoch ends where the data does). After a checkpoint's save, training's next batch tells the data
plane (`Client.checkpointed`, on every rank), so journal delivery keeps that checkpoint's steps
and may reclaim older ones; a save at the very end of fit is not marked (whether it succeeded
is not known there), so the previous checkpoint's mark holds. The state is the step after the last batch that
reached `training_step`, recorded in `on_before_batch_transfer`: Lightning fetches one batch
ahead when the length is unknown (an infinite job), and that batch, not yet trained on, is
served again after a resume. A LightningModule's own `on_before_batch_transfer` still runs
(called from the DataModule's; Lightning warns that both are overridden).

Variable microbatches. A step holds a list of microbatches whose length may change from step to
step (token budgets; the same on every rank). Either loop them with manual optimization, one
backward per microbatch, each on its share of the step's token-weighted loss:

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            ...

        def training_step(self, batch):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            # Summed token losses over every rank / the step's loss tokens; DDP averages
            # gradients over ranks, hence the world size.
            scale = self.trainer.world_size / max(batch["global_loss_tokens"], 1)
            for mb in batch["microbatches"]:
                logits = self(mb["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), mb["labels"].flatten().long(),
                                       ignore_index=mb["ignore_id"], reduction="sum")
                self.manual_backward(loss * scale)
            optimizer.step()

(Lightning's DDP prepares the gradient reduction before every `manual_backward`, so each
microbatch's gradients are reduced correctly), or return the sum of the scaled microbatch
losses from `training_step` under automatic optimization (one backward, holding every
microbatch's activations at once). Keep `accumulate_grad_batches=1`: a batchplane step already
is the whole global batch. Labels are pre-shifted (labels[t] = input_ids[t + 1]).

Does no I/O of its own; the client talks to the data plane.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from batchplane.client.client import Client
from batchplane.client.device import AUTO
from batchplane.client.errors import DataPlaneError, InvalidRequestError

__all__ = ["BatchplaneDataModule"]

log = logging.getLogger(__name__)


class BatchplaneDataModule(pl.LightningDataModule):
    """The rank's batchplane steps as Lightning's training data, resumable from Lightning
    checkpoints.

    The client is created on first use (`setup("fit")` or `train_dataloader()`), once the
    trainer knows the rank.

    Args:
        address: The constructor's address; default: the environment, as for `Client`
            (BATCHPLANE_CONSTRUCTOR, or the rank's entry of BATCHPLANE_ENDPOINTS).
        rank: The global rank in the job's mesh; default: the environment variable RANK (set by
            torchrun, checked against WORLD_SIZE by the client), else the trainer's global rank
            (checked against the trainer's world size).
        device: Where the tensors go. "auto" (default): the trainer's root device (Lightning's
            own `batch_to_device` then has nothing left to move); else as for `Client`.
        pin_memory: As for `Client`.
        timeout_s: As for `Client`: how long a request retries an unavailable data plane.
    Raises:
        InvalidRequestError: (on first use) the rank is outside the job's mesh, or the
            trainer's world size is not the mesh's size; see also `Client`.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        rank: int | None = None,
        device: str | torch.device | None = AUTO,
        pin_memory: bool | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__()
        self._address = address
        self._rank = rank
        self._device = device
        self._pin_memory = pin_memory
        self._timeout_s = timeout_s
        self._client: Client | None = None
        #: A state loaded before the client exists (applied when it is created).
        self._pending: dict[str, Any] | None = None
        #: The step after the last batch handed to training_step; None before the first.
        self._next_step: int | None = None
        #: The state Lightning last took for a checkpoint, not yet marked (`_mark_saved`).
        self._saved: dict[str, Any] | None = None

    # ---- the client ------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        """The rank's client (created on first use)."""
        if self._client is None:
            self._client = self._create_client()
            if self._pending is not None:
                self._client.load_state_dict(self._pending)
                self._pending = None
        return self._client

    def _create_client(self) -> Client:
        trainer = self._trainer_or_none()
        rank, world = self._rank, None
        if rank is None and trainer is not None and "RANK" not in os.environ:
            rank, world = trainer.global_rank, trainer.world_size
        device = self._device
        if isinstance(device, str) and device == AUTO and trainer is not None:
            device = trainer.strategy.root_device
        client = Client(self._address, rank=rank, device=device, pin_memory=self._pin_memory, timeout_s=self._timeout_s)
        if world is not None:
            m = client.job.mesh
            size = max(m.dp, 1) * max(m.cp, 1) * max(m.tp, 1) * max(m.pp, 1)
            if world != size:
                client.close()
                raise InvalidRequestError(f"the trainer runs {world} ranks but the batchplane job's mesh has {size}")
        return client

    def _trainer_or_none(self) -> pl.Trainer | None:
        return getattr(self, "trainer", None)

    # ---- LightningDataModule ---------------------------------------------------------------

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.client  # noqa: B018 - creates it on every rank, where the trainer knows the rank

    def train_dataloader(self) -> _Steps:
        """The rank's steps: one batch dict per training step (no DataLoader)."""
        self.client  # noqa: B018
        return _Steps(self)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Records the step that reaches training_step now (a checkpoint taken after it resumes
        at the next one), then runs the LightningModule's own hook if it has one. First tells
        the data plane about a checkpoint saved since the last batch (`Client.checkpointed`):
        training went on, so its save succeeded."""
        self._mark_saved()
        if isinstance(batch, Mapping) and "step" in batch and "microbatches" in batch:
            self._next_step = int(batch["step"]) + 1
        trainer = self._trainer_or_none()
        module = trainer.lightning_module if trainer is not None else None
        if module is not None and is_overridden("on_before_batch_transfer", module):
            batch = module.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The client's state (`Client.state_dict`: plain values, rank-agnostic) at the step
        after the last batch handed to training_step; {} before the client exists and nothing
        was loaded."""
        if self._client is None:
            return dict(self._pending or {})
        state = self._client.state_dict()
        if self._next_step is not None:
            state["next_step"] = self._next_step
        self._saved = dict(state)  # Lightning asks for it to save a checkpoint: marked once training goes on
        return state

    def _mark_saved(self) -> None:
        """`Client.checkpointed` for the state last saved, if any (a failure is logged: the
        pod's earlier mark keeps holding, which keeps more, never less)."""
        saved, self._saved = self._saved, None
        if saved is None or self._client is None:
            return
        try:
            self._client.checkpointed(saved)
        except DataPlaneError as exc:
            log.warning("the checkpoint at step %s was saved but not marked in the data plane: %s", saved.get("next_step"), exc)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resumes at the state's step (any rank's state; see `Client.load_state_dict`).

        Raises:
            InvalidRequestError: a malformed state or one of another job's data.
        """
        if not state_dict:
            return
        state = dict(state_dict)
        self._next_step = None
        if self._client is None:
            self._pending = state
        else:
            self._client.load_state_dict(state)

    def teardown(self, stage: str) -> None:
        """Closes the client at the end of fit; a later fit continues where this one stopped."""
        if stage == "fit" and self._client is not None:
            state = self.state_dict()
            self._saved = None  # a save at the end of fit may have failed: the earlier mark holds
            self._client.close()
            self._client = None
            self._pending = state
            self._next_step = None


class _Steps:
    """What `train_dataloader` returns: iterates the client from its next step; `len` is the
    job's whole length (Lightning counts the steps a resumed epoch already had). Stateful for
    Lightning (its loop state), through the DataModule, so Lightning takes the loader as
    resumable; both restore the same state."""

    def __init__(self, module: BatchplaneDataModule) -> None:
        self._module = module

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._module.client)

    def __len__(self) -> int:
        return len(self._module.client)

    def state_dict(self) -> dict[str, Any]:
        return self._module.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._module.load_state_dict(state_dict)
