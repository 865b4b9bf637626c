"""torchtitan adapter of the client: a data loader for torchtitan's Trainer and checkpointer
(imports `torchtitan` and, through it, `torchdata`).

    from batchplane.client.torchtitan import BatchplaneDataLoader

    config = ...                                  # a torchtitan Trainer.Config
    config.dataloader = BatchplaneDataLoader.Config(
        microbatches_per_step=4,                  # gradient_accumulation_steps x pipeline microbatches
    )
    # config.training.steps = len(batchplane.client.Client())   # end on the job's last step

torchtitan's `Trainer.train_step` calls `next(data_iterator)` a fixed number of times per step
(gradient_accumulation_steps x pipeline-parallel microbatches); this loader yields one
`(input_dict, labels)` pair per batchplane microbatch: input_dict = {"input": input_ids,
"positions": position_ids} (int64; positions restart at 0 on every packed document, which is
how torchtitan's flex and varlen attention build document masks, and index RoPE), labels int64,
pre-shifted (labels[t] = input_ids[t + 1], torchtitan's convention) with the job's ignore_id
written as torchtitan's IGNORE_INDEX (-100). A step of the job must therefore hold exactly
`microbatches_per_step` microbatches: a job that plans another number (or a variable one, under
a token budget) is refused with InvalidRequestError before any of its microbatches is yielded,
rather than letting torchtitan's steps drift across batchplane's.

Checkpoints. torchtitan's CheckpointManager saves `state_dict()` with torch.distributed.checkpoint
under "dataloader": {"dp_rank_<i>": the client's state, plus the microbatch to resume at,
"world_size": dp degree}, as torchtitan's own ParallelAwareDataloader keys it, so DCP keeps every
rank's entry. The entries are equal (the client's state is rank-agnostic), so `load_state_dict`
takes this rank's entry or any other, and a checkpoint taken between the microbatches of a step
resumes at the next microbatch. DCP looks up this rank's key on load: a restart with a larger DP
degree finds no entry for the new ranks (load one rank's entry into every loader instead). After
a save, the next microbatch asked for tells the data plane (`Client.checkpointed`, on every
rank, with the entry saved): training went on, so the save succeeded (with torchtitan's async
checkpointing it may still be writing), and journal delivery keeps that checkpoint's steps; a
failure to mark is logged and the earlier mark holds, which keeps more, never less.

End of data: the iterator stops (StopIteration); torchtitan's `batch_generator` turns that into
its DataloaderExhaustedError and the train loop ends ("Ran out of data"). Since a step is whole or
absent, no batchplane step is ever cut. To have the last step checkpointed, mix `EndWithData` into
the Trainer: it ends training with the last step of the data, which torchtitan then saves as its
last (`training.steps` = `len(client)` alone is not enough: that count is an upper bound where bad
samples are substituted).

Not supported: context parallelism (torchtitan slices sequences itself in
`post_dataloading_process`; a batchplane job with cp > 1 is refused, as it would be sliced
twice); pipeline stages that receive no input_ids or labels (torchtitan reads both on every rank)
are refused naming the stage.

Does no I/O of its own; the client talks to the data plane.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX

from batchplane.client.client import Client
from batchplane.client.errors import DataPlaneError, InvalidRequestError

__all__ = ["BatchplaneDataLoader", "EndWithData"]

log = logging.getLogger(__name__)

_ENTRY_PREFIX = "dp_rank_"


class BatchplaneDataLoader(BaseDataLoader):
    """The rank's batchplane microbatches as torchtitan's `(input_dict, labels)` pairs, one per
    `next()`, with a Stateful state for torchtitan's CheckpointManager.

    Built by torchtitan's Trainer as `config.dataloader.build(dp_world_size=..., dp_rank=...,
    tokenizer=..., seq_len=..., local_batch_size=..., snapshot_every_n_steps=...)`; only the DP
    rank and degree are used (the job plans lengths and batch sizes). The client takes the
    global rank and the address from the environment (RANK, BATCHPLANE_ENDPOINTS), as torchrun
    and `batchplane up` set them.

    Args:
        config: The loader's Config: `microbatches_per_step` (required: gradient accumulation
            steps x pipeline microbatches of the trainer), `address` (the constructor's, default
            from the environment), `positions` (give "positions"; False for a model that takes
            none), `timeout_s` (how long a request retries an unavailable data plane).
        dp_world_size: The trainer's data-parallel degree; must be the job's mesh.dp.
        dp_rank: This rank's data-parallel rank; must be the one the job's mesh gives it.
        client: A client to use instead of creating one (tests).
    Raises:
        ValueError: `microbatches_per_step` < 1.
        InvalidRequestError: the job's mesh, microbatches per step, label format or context
            parallelism do not fit the trainer (the message says which); see also `Client`.
            While iterating: a step whose number of microbatches differs, or a microbatch
            without input_ids or labels.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "batchplane"
        """Informational: the data come from the batchplane job the client connects to."""

        address: str | None = None
        """The constructor's address; default: BATCHPLANE_CONSTRUCTOR or BATCHPLANE_ENDPOINTS."""

        microbatches_per_step: int = 0
        """Microbatches torchtitan takes per step: gradient_accumulation_steps x pipeline
        microbatches (1 without PP). Required."""

        positions: bool = True
        """Give the microbatches' position ids as input_dict["positions"]."""

        timeout_s: float = 300.0
        """How long one request retries an unavailable data plane before raising."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        client: Client | None = None,
        **unused: Any,  # tokenizer, seq_len, local_batch_size, snapshot_every_n_steps
    ) -> None:
        if config.microbatches_per_step < 1:
            raise ValueError(
                "BatchplaneDataLoader.Config.microbatches_per_step must be >= 1 (torchtitan's "
                f"gradient_accumulation_steps x pipeline microbatches), got {config.microbatches_per_step}"
            )
        self.config = config
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.microbatches_per_step = config.microbatches_per_step
        self._rank_id = f"{_ENTRY_PREFIX}{dp_rank}"
        self._client = client if client is not None else Client(config.address, device=None, timeout_s=config.timeout_s)
        try:
            self._check_job()
        except BaseException:
            if client is None:
                self._client.close()
            raise
        # Position: the step being yielded and how many of its microbatches were handed out.
        self._step: int | None = None
        self._handed: int = 0
        # A resumed position's microbatch: skipped from step `_resume_step` when it arrives.
        self._resume_step: int | None = None
        self._skip: int = 0
        self._checked_rank = False
        self._saved: dict[str, Any] | None = None  # the entry last saved, marked at the next microbatch

    def _check_job(self) -> None:
        job = self._client.job
        m = job.mesh
        if m.dp != self.dp_world_size:
            raise InvalidRequestError(
                f"torchtitan's data-parallel degree is {self.dp_world_size} but the batchplane job's mesh.dp is {m.dp}"
            )
        if max(m.cp, 1) > 1:
            raise InvalidRequestError(
                f"the batchplane job has mesh.cp={m.cp}: torchtitan slices sequences for context parallelism itself "
                "(post_dataloading_process), so they would be sliced twice; give torchtitan whole sequences"
            )
        if job.microbatches != self.microbatches_per_step:
            raise InvalidRequestError(
                f"the batchplane job plans batch.microbatches={job.microbatches} per rank and step but torchtitan takes "
                f"{self.microbatches_per_step} (microbatches_per_step: gradient_accumulation_steps x pipeline microbatches); "
                "make them equal, or steps would drift apart"
            )
        labels = self._client.format["labels"]
        if labels != "next_token":
            raise InvalidRequestError(f"the batchplane job's labels are {labels!r}; torchtitan wants next-token labels")

    # ---- iteration -----------------------------------------------------------------------

    @property
    def client(self) -> Client:
        """The rank's client."""
        return self._client

    @property
    def num_steps(self) -> int | None:
        """The job's steps (see `Client.num_steps`), e.g. for torchtitan's training.steps."""
        return self._client.num_steps

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Yields `(input_dict, labels)` per microbatch from the next position on until the
        job's data ends."""
        if self._step is not None and self._handed < self.microbatches_per_step:
            self._load_entry(self._entry())  # an earlier iterator stopped inside a step
        ignore_id = self._client.format["ignore_id"]
        for batch in self._client:
            step, microbatches = batch["step"], batch["microbatches"]
            self._check_batch(batch)
            first = self._skip if step == self._resume_step else 0
            self._resume_step, self._skip = None, 0
            self._step, self._handed = step, first
            for index in range(first, len(microbatches)):
                pair = self._pair(microbatches[index], ignore_id, batch)
                self._mark_saved()
                self._handed = index + 1  # before the yield: a checkpoint now resumes after it
                yield pair

    def _check_batch(self, batch: Mapping[str, Any]) -> None:
        count = len(batch["microbatches"])
        if count != self.microbatches_per_step:
            raise InvalidRequestError(
                f"step {batch['step']} of the batchplane job has {count} microbatches on rank {batch['rank']} but torchtitan "
                f"takes {self.microbatches_per_step} per step (gradient_accumulation_steps x pipeline microbatches); a job "
                "with a variable number (balance.method token_budget) cannot feed torchtitan's fixed accumulation"
            )
        if not self._checked_rank:
            if batch["dp_rank"] != self.dp_rank:
                raise InvalidRequestError(
                    f"global rank {batch['rank']} is data-parallel rank {self.dp_rank} in torchtitan's mesh but "
                    f"{batch['dp_rank']} in the batchplane job's (mesh.order): the ranks would train on each other's data"
                )
            self._checked_rank = True

    def _pair(self, mb: Mapping[str, Any], ignore_id: int, batch: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        missing = [name for name in ("input_ids", "labels") if name not in mb]
        if missing:
            raise InvalidRequestError(
                f"pipeline stage {batch['pp_rank']} receives no {' or '.join(missing)}, which torchtitan reads on every rank "
                "(constructors.pp_middle_tensors)"
            )
        labels = mb["labels"].to(torch.long)
        if ignore_id != IGNORE_INDEX:
            labels = labels.masked_fill(labels == ignore_id, IGNORE_INDEX)
        inputs = {"input": mb["input_ids"].to(torch.long)}
        if self.config.positions and "position_ids" in mb:
            inputs["positions"] = mb["position_ids"].to(torch.long)
        return inputs, labels

    # ---- checkpointing -------------------------------------------------------------------

    def _entry(self) -> dict[str, Any]:
        """Where this loader resumes: the client's state at the step, and the microbatch of it."""
        state = self._client.state_dict()
        if self._step is None:
            microbatch = self._skip
        elif self._handed >= self.microbatches_per_step:
            state["next_step"], microbatch = self._step + 1, 0
        else:
            state["next_step"], microbatch = self._step, self._handed
        return {**state, "microbatch": microbatch, "microbatches_per_step": self.microbatches_per_step}

    def state_dict(self) -> dict[str, Any]:
        """{"dp_rank_<i>": {the client's state (plain values), "microbatch": the next one of
        its step, "microbatches_per_step"}, "world_size": the DP degree}."""
        entry = self._saved = self._entry()  # torchtitan asks for it to save a checkpoint
        return {self._rank_id: entry, "world_size": self.dp_world_size}

    def _mark_saved(self) -> None:
        """`Client.checkpointed` for the entry last saved, if any (see the module docstring)."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        try:
            self._client.checkpointed(saved)
        except DataPlaneError as exc:
            log.warning("the checkpoint at step %s was saved but not marked in the data plane: %s", saved.get("next_step"), exc)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resumes at the saved step and microbatch: this rank's entry, else any rank's (they are
        equal); also a bare entry or a `Client.state_dict()`. An empty state is a fresh start.

        Raises:
            InvalidRequestError: no entry in a non-empty state, a mid-step position saved with
                another number of microbatches per step, or a state the client refuses.
        """
        self._saved = None  # DCP asked for the state to load into, not to save it
        if not state_dict:
            return
        entry = _pick_entry(state_dict, self._rank_id)
        if entry is None:
            raise InvalidRequestError(f"the data loader state has no {_ENTRY_PREFIX}<i> entry: {sorted(state_dict)}")
        saved_world = state_dict.get("world_size")
        if saved_world is not None and saved_world != self.dp_world_size:
            log.info("data-parallel degree %s -> %d: the state is rank-agnostic, the planner re-plans", saved_world, self.dp_world_size)
        self._load_entry(entry)

    def _load_entry(self, entry: Mapping[str, Any]) -> None:
        microbatch = int(entry.get("microbatch", 0))
        saved_per_step = entry.get("microbatches_per_step", self.microbatches_per_step)
        if microbatch and saved_per_step != self.microbatches_per_step:
            raise InvalidRequestError(
                f"the checkpoint stopped at microbatch {microbatch} of {saved_per_step} of a step; this loader takes "
                f"{self.microbatches_per_step} per step, so the rest of that step has no place"
            )
        client_state = {k: v for k, v in entry.items() if k not in ("microbatch", "microbatches_per_step")}
        self._client.load_state_dict(client_state)
        self._step, self._handed = None, 0
        self._resume_step, self._skip = int(client_state["next_step"]), microbatch

    @property
    def ended(self) -> bool:
        """Whether the job's data ends after the microbatches handed out so far: every one of the
        step in progress is handed, and the client knows no step follows (`Client.ended`)."""
        return (self._step is None or self._handed >= self.microbatches_per_step) and self._client.ended

    def close(self) -> None:
        """Closes the client."""
        self._client.close()


class EndWithData:
    """Mixed into torchtitan's Trainer (`class Trainer(EndWithData, torchtitan.trainer.Trainer)`),
    training ends with the step after which the job's data ends, and torchtitan's checkpointer
    saves that step as the last one: `training.steps` is lowered to it once the loader knows
    (`BatchplaneDataLoader.ended`). Without it a job whose data ends before `training.steps` (the
    job's length counted at the start is an upper bound where bad samples are substituted) ends
    on torchtitan's DataloaderExhaustedError, its last steps unsaved."""

    dataloader: Any
    config: Any
    step: int

    def train_step(self, data_iterator: Any) -> Any:
        result = super().train_step(data_iterator)  # type: ignore[misc]  # the Trainer's, next in the MRO
        training = self.config.training
        if getattr(self.dataloader, "ended", False) and self.step < training.steps:
            log.info("the job's data ends after step %d (training.steps was %d): training ends there", self.step, training.steps)
            training.steps = self.step
        return result


def _pick_entry(state: Mapping[str, Any], own: str) -> Mapping[str, Any] | None:
    if own in state:
        return state[own]
    ranks = sorted(
        (int(key[len(_ENTRY_PREFIX) :]), key) for key in state if key.startswith(_ENTRY_PREFIX) and key[len(_ENTRY_PREFIX) :].isdigit()
    )
    if ranks:
        return state[ranks[0][1]]
    if "next_step" in state:
        return state
    return None
