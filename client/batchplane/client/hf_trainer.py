"""The Hugging Face `transformers.Trainer` on batchplane data: `batchplane.client.hf.Trainer`.

Imports transformers at import time, which is why `batchplane.client.hf` re-exports `Trainer`
lazily (module `__getattr__`): `import batchplane.client.hf` needs no transformers, and
`from batchplane.client.hf import Trainer` imports this module on first use.

What it changes in Hugging Face's loop (transformers 5.24; `trainer.py`'s `_run_epoch`), and why:

- Data. One item of the training "dataloader" is one training step: the step's whole batch dict
  as the rank's own `batchplane.client.Client` yields it. Each rank reads its own batches; nothing
  goes through accelerate's dataloader preparation (which, for an iterable dataset, reads on rank
  0 only and dispatches slices of it, `dispatch_batches`).
- Gradient accumulation. The step's microbatches are the accumulation (their number varies from
  step to step under a token budget, the same on every rank), so `gradient_accumulation_steps`
  must be 1; `training_step` runs forward and backward for every microbatch, under DDP's
  `no_sync` for all but the last.
- Loss. Every microbatch's loss is weighted by the step's exact token counts (see
  `loss_normalizer`), not Hugging Face's per-rank estimate `num_items_in_batch`.
- Length. `max_steps` defaults to the job's steps (`len(client)`); one Hugging Face "epoch" is
  the whole job (the job's own `epochs` say how often it passes over its sources). That count is
  an upper bound where bad samples are substituted: training ends where the data does, with the
  save Hugging Face makes at its last step (`_StopAtDataEnd`).
- Checkpoints. Rank 0 writes the client's state (`Client.state_dict()`, the same on every rank)
  into every checkpoint folder as `batchplane_data.json`; `train(resume_from_checkpoint=...)`
  loads it into every rank's client before iterating, and Hugging Face never skips batches itself
  (`ignore_data_skip` is forced on): the client resumes at the checkpoint's step, also against a
  data plane that kept running past it (it rewinds). Once a checkpoint is saved (Hugging Face's
  `on_save`, on every rank), each rank tells the data plane (`Client.checkpointed`) with the
  state that was saved: journal delivery then keeps its steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, has_length

from batchplane.client.client import Client
from batchplane.client.errors import DataPlaneError
from batchplane.client.hf import HF_IGNORE_INDEX, PACKED_ATTENTION, causal_lm_inputs

__all__ = ["DATA_STATE_NAME", "Trainer", "loss_normalizer"]

log = logging.getLogger(__name__)

#: The file in each checkpoint folder that holds the client's state (JSON).
DATA_STATE_NAME = "batchplane_data.json"


def loss_normalizer(global_loss_tokens: int, *, world: int, hf_factor: int = 1) -> float:
    """The `num_items_in_batch` that makes Hugging Face's summed loss of a microbatch the right
    share of the step's exact token mean under DDP.

    DDP averages gradients over the `world` ranks, so for the averaged gradient to be that of
    (sum over all ranks and microbatches of summed token losses) / global_loss_tokens, each rank
    back-propagates world * S / T for every microbatch whose summed token loss is S. Hugging
    Face's loss with `num_items_in_batch` = n is S / n, and its `compute_loss` multiplies that by
    `hf_factor` (the number of processes when `average_tokens_across_devices`, else 1), so
    n = T * hf_factor / world.

    Args:
        global_loss_tokens: The step's loss-carrying tokens over all ranks (T); 0 is taken as 1
            (a step without any target: every loss is an empty sum).
        world: The number of data-parallel ranks DDP averages over.
        hf_factor: What Hugging Face's `compute_loss` multiplies the loss by.
    Returns:
        n, a positive float.
    """
    return max(int(global_loss_tokens), 1) * hf_factor / world


class _StepLoader:
    """The training "dataloader": one item per step, the rank's own batch dict from its client.
    Its length is the job's number of steps (from step 0), as Hugging Face counts steps; an
    infinite job has none (len raises TypeError)."""

    def __init__(self, data: Any, steps: int | None) -> None:
        self.data = data
        self._steps = steps

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.data)

    def __len__(self) -> int:
        if self._steps is None:
            raise TypeError("the batchplane job has no length (epochs: infinite, or not known in advance)")
        return self._steps


class _EpochFromStep(transformers.TrainerCallback):
    """Sets `state.epoch` to global_step / steps per epoch after every step: Hugging Face counts
    it from the items read since `train()` began, which restart at 0 on a resume that skips no
    batches (ignore_data_skip)."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        state.epoch = state.global_step / max(self._trainer._steps_in_epoch, 1)


class _StopAtDataEnd(transformers.TrainerCallback):
    """Ends training where the job's data ends, which can be a few steps before `max_steps` (the
    job's length counted at the start is an upper bound when bad samples are substituted,
    `Client.num_steps`), with the save Hugging Face makes at its last step: its own flow
    (`DefaultFlowCallback`) does that at `max_steps` only. Without it the epoch would end on an
    exhausted iterator, unsaved."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(self._trainer.data, "ended", False) and not control.should_training_stop:
            log.info(
                "the job's data ends after step %d (of %d counted at the start): training ends there", state.global_step, state.max_steps
            )
            self._stop(args, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(self._trainer.data, "ended", False) and state.global_step < state.max_steps:  # the iterator ended before the count
            self._stop(args, state, control)

    @staticmethod
    def _stop(args: Any, state: Any, control: Any) -> None:
        state.max_steps = state.global_step
        control.should_training_stop = True
        if args.save_strategy == transformers.trainer_utils.SaveStrategy.STEPS:
            control.should_save = True


class _MarkCheckpoint(transformers.TrainerCallback):
    """After Hugging Face saved a checkpoint (`on_save`, on every rank): `Client.checkpointed`
    with the data state saved in it."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._trainer._mark_checkpoint()


class Trainer(transformers.Trainer):
    """A `transformers.Trainer` that trains a causal LM on the batches of a batchplane job.

        from batchplane.client.hf import Trainer
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir="out", learning_rate=3e-4, save_steps=500, report_to=[])
        trainer = Trainer(model=model, args=args)      # a Client from RANK and BATCHPLANE_ENDPOINTS
        trainer.train(resume_from_checkpoint=True)     # or no argument on a first start

    Run one process per rank (torchrun), one rank per data-parallel replica of the job's mesh.
    Each step's microbatches become Hugging Face inputs with `causal_lm_inputs` (unshifted labels,
    packed documents kept apart by `packed_attention`); every microbatch runs forward and backward
    on every rank, fillers too (with a zero loss), so DDP's collectives match.

    Args:
        model: A Hugging Face causal LM (or any module that takes `causal_lm_inputs`'s keywords).
        args: The `TrainingArguments`. `gradient_accumulation_steps` must be 1 (the step's
            microbatches are the accumulation); `max_steps` <= 0 (the default) trains the job's
            steps; `ignore_data_skip` is set to True (the client resumes the data itself);
            `per_device_train_batch_size` and the `dataloader_*` settings are unused (the job
            decides the batches).
        data: The rank's `batchplane.client.Client` (or an object with its interface: iteration,
            `len`, `state_dict`, `load_state_dict`, `rank`, `job`). Default: a Client from the
            environment (RANK, BATCHPLANE_ENDPOINTS or BATCHPLANE_CONSTRUCTOR) whose tensors go
            to the device the Trainer trains on (`args.device`).
        packed_attention: How packed microbatches keep documents apart (see
            `batchplane.client.hf.PACKED_ATTENTION`); unused for padded microbatches.
        **kwargs: The other arguments of `transformers.Trainer` (callbacks, optimizers,
            compute_loss_func, eval_dataset, ...), except `train_dataset`.
    Raises:
        ValueError: `train_dataset` is given, `gradient_accumulation_steps` is not 1, an unknown
            `packed_attention`, DeepSpeed or nn.DataParallel (several GPUs per process), a mesh
            with context, tensor or pipeline parallelism, a client of another rank or a mesh of
            another size than the processes, `max_steps` past the end of a finite job, or a job
            without a known length (epochs: infinite) and no `max_steps`.

    `trainer.data` is the client. Loss scaling: see `loss_normalizer`. Tested with transformers
    5.24, DDP on CPU (gloo); FSDP goes through accelerate's `no_sync` but is untested.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *,
        data: Any = None,
        packed_attention: str = "mask_4d",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("train_dataset") is not None:
            raise ValueError("train_dataset: batchplane's Trainer reads the job's batches from its client; pass data= (or nothing) instead")
        kwargs.pop("train_dataset", None)
        if packed_attention not in PACKED_ATTENTION:
            raise ValueError(f"packed_attention must be one of {', '.join(PACKED_ATTENTION)}, got {packed_attention!r}")
        if args is not None and args.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps must be 1, got {args.gradient_accumulation_steps}: each step's microbatches "
                "are its gradient accumulation (batchplane decides how many; set the job's batch.microbatches or token budget)"
            )
        super().__init__(model=model, args=args, **kwargs)
        self.packed_attention = packed_attention
        if self.is_deepspeed_enabled:
            raise ValueError(
                "DeepSpeed is not supported: its engine counts gradient accumulation itself, while each step's microbatches vary"
            )
        if self.args.n_gpu > 1:
            raise ValueError(f"n_gpu={self.args.n_gpu}: run one process per GPU (torchrun), not nn.DataParallel")
        if not self.args.ignore_data_skip:
            # The client resumes at the checkpoint's step; Hugging Face must not skip batches too.
            self.args.ignore_data_skip = True
        owned = data is None
        if owned:
            data = Client(device=self.args.device)
        self.data = data
        try:
            self._check_mesh()
            self._max_steps = self._resolve_max_steps()
        except BaseException:
            if owned:
                data.close()
            raise
        self._steps_in_epoch = self._max_steps
        self._saved_state: dict[str, Any] | None = None  # the data state of the checkpoint being saved
        self.add_callback(_EpochFromStep(self))
        self.add_callback(_StopAtDataEnd(self))
        self.add_callback(_MarkCheckpoint(self))

    # ---- checks at the edge ---------------------------------------------------------------

    def _check_mesh(self) -> None:
        mesh = self.data.job.mesh
        sizes = {axis: max(int(getattr(mesh, axis)), 1) for axis in ("dp", "cp", "tp", "pp")}
        others = {axis: n for axis, n in sizes.items() if axis != "dp" and n > 1}
        if others:
            shown = " ".join(f"{axis}={n}" for axis, n in others.items())
            raise ValueError(f"the job's mesh has {shown}: the Hugging Face Trainer trains data-parallel only (mesh: {{dp: N}})")
        world = self.accelerator.num_processes
        if sizes["dp"] != world:
            raise ValueError(f"the job's mesh has dp={sizes['dp']} ranks but the Trainer runs {world} processes")
        if int(self.data.rank) != self.args.process_index:
            raise ValueError(f"the client reads rank {self.data.rank}'s batches but this process is rank {self.args.process_index}")

    def _resolve_max_steps(self) -> int:
        job_steps, why = self._job_steps()
        wanted = self.args.max_steps
        if wanted > 0:
            if job_steps is not None and wanted > job_steps:
                raise ValueError(
                    f"max_steps={wanted} is past the end of the job's data ({job_steps} steps); leave max_steps unset to "
                    "train the whole job, or raise the job's epochs"
                )
            return wanted
        if job_steps is None:
            raise ValueError(f"set TrainingArguments(max_steps=...): {why}")
        return job_steps

    # ---- data ------------------------------------------------------------------------------

    def get_train_dataloader(self) -> _StepLoader:
        """One item per step, read by this rank from its own client (no accelerate wrapping)."""
        return _StepLoader(self.data, self._job_steps()[0])

    def _job_steps(self) -> tuple[int | None, str]:
        """(the job's steps, or None with why it has no length)."""
        try:
            return len(self.data), ""
        except TypeError as exc:
            return None, str(exc)

    def get_total_train_batch_size(self, args: transformers.TrainingArguments) -> int:
        """Samples per step over all ranks: the job's global batch size."""
        size = int(getattr(self.data.job, "global_batch_size", 0) or 0)
        return size if size > 0 else super().get_total_train_batch_size(args)

    def set_initial_training_values(
        self, args: transformers.TrainingArguments, dataloader: Any
    ) -> tuple[int, int, int, int, int, int, int]:
        """One epoch (the whole job, or `max_steps` of an infinite one), one update per item."""
        max_steps = self._max_steps
        steps_in_epoch = len(dataloader) if has_length(dataloader) else max_steps
        self._steps_in_epoch = steps_in_epoch
        per_step = self.get_total_train_batch_size(args)
        samples = max_steps * per_step
        # (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
        #  total_train_batch_size, steps_in_epoch, max_steps)
        return 1, steps_in_epoch, samples, samples, per_step, steps_in_epoch, max_steps

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, int | None]:
        """The next step's batch (num_batches is 1), and its global_loss_tokens."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, (batches[0]["global_loss_tokens"] if batches else None)

    # ---- one step --------------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward and backward of every microbatch of the step (`inputs` is the batch dict),
        gradients synchronized after the last one only; returns the detached sum of the losses
        back-propagated, whose mean over ranks (what Hugging Face logs) is the step's token-mean
        loss."""
        microbatches = inputs["microbatches"]
        world = self.accelerator.num_processes
        total = inputs["global_loss_tokens"]
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        step_loss = torch.zeros((), device=self.args.device)
        for i, microbatch in enumerate(microbatches):
            last = i == len(microbatches) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                loss = self._microbatch_loss(model, microbatch, global_loss_tokens=total, world=world)
                self.accelerator.backward(loss)
            step_loss += loss.detach().to(step_loss.device)
        return step_loss

    def _microbatch_loss(
        self, model: torch.nn.Module, microbatch: Mapping[str, Any], *, global_loss_tokens: int, world: int
    ) -> torch.Tensor:
        """world * (summed token loss) / global_loss_tokens of one microbatch, through
        `compute_loss` (so a subclass's or `compute_loss_func`'s loss applies)."""
        inputs = self._prepare_inputs(causal_lm_inputs(microbatch, packed_attention=self.packed_attention, dtype=self._mask_dtype()))
        summed = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        with self.compute_loss_context_manager():
            if summed:  # Hugging Face sums the token losses and divides by num_items_in_batch
                n = loss_normalizer(global_loss_tokens, world=world, hf_factor=self._hf_loss_factor())
                return self.compute_loss(model, inputs, num_items_in_batch=n)
            # A model without loss kwargs gives the microbatch's mean: rescale it to its share.
            count = int((inputs["labels"] != HF_IGNORE_INDEX).sum())
            if count == 0:  # a filler: the mean would be NaN; a zero loss through the whole model
                outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
                logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
                return logits.sum() * 0.0
            return self.compute_loss(model, inputs) * (count * world / max(int(global_loss_tokens), 1))

    def _hf_loss_factor(self) -> int:
        """What transformers' `compute_loss` multiplies a loss normalized by `num_items_in_batch`
        by (5.24: the processes over the tensor-parallel size when `average_tokens_across_devices`)."""
        if self.args.average_tokens_across_devices and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return self.accelerator.num_processes // self.get_tp_size()
        return 1

    def _mask_dtype(self) -> torch.dtype:
        """The dtype of a packed "mask_4d" attention mask: the autocast dtype, else the model's."""
        if self.args.bf16:
            return torch.bfloat16
        if self.args.fp16:
            return torch.float16
        dtype = getattr(self.model, "dtype", None)
        return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32

    # ---- accounting on a batch dict ---------------------------------------------------------

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """Hugging Face's 6 * tokens * parameters, over every microbatch of the step."""
        if "microbatches" not in inputs:
            return super().floating_point_ops(inputs)
        main = getattr(self.model, "main_input_name", "input_ids")
        return sum(super(Trainer, self).floating_point_ops({main: mb["input_ids"]}) for mb in inputs["microbatches"] if "input_ids" in mb)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        """Counts the step's input tokens over all ranks: padding included ("all") or only real
        tokens ("non_padding": the microbatches' num_tokens)."""
        mode = self.args.include_num_input_tokens_seen
        if mode == "no" or mode is False:
            return
        if "microbatches" not in inputs:
            return super()._track_num_input_tokens(inputs)
        if mode == "non_padding":
            count = sum(int(mb["num_tokens"]) for mb in inputs["microbatches"])
        else:
            count = sum(mb["input_ids"].numel() for mb in inputs["microbatches"] if "input_ids" in mb)
        tokens = torch.as_tensor(count, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(tokens).sum().item()

    # ---- checkpoints -------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """`transformers.Trainer.train`; with `resume_from_checkpoint` (a folder, or True for the
        last one in `args.output_dir`) the client first resumes at the checkpoint's step.

        Raises:
            ValueError: no checkpoint in `output_dir` (True), or a checkpoint without
                `batchplane_data.json` (not written by this Trainer).
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            self._load_data_state(str(resume_from_checkpoint))
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)

    def _load_data_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, DATA_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"checkpoint {checkpoint} has no {DATA_STATE_NAME}: it was not written by batchplane.client.hf.Trainer, "
                "so where the data resumes is unknown"
            )
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        self.data.load_state_dict(state)
        log.info("rank %d resumes the data at step %s from %s", self.args.process_index, state.get("next_step"), path)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Hugging Face's checkpoint, with the client's state written first (by the processes
        that save, rank 0), so every checkpoint with a trainer state has the data's too. Every rank
        keeps the state for `_mark_checkpoint` (the ranks' states are equal)."""
        state = self._saved_state = self.data.state_dict()
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, DATA_STATE_NAME)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(state, f)
            os.replace(path + ".tmp", path)
        super()._save_checkpoint(model, trial)

    def _mark_checkpoint(self) -> None:
        """After a save, on every rank (`on_save`): `Client.checkpointed` with the saved state
        (journal delivery keeps the checkpoint's steps); a failure is logged, the pod's earlier
        mark holds (it keeps more, never less)."""
        state, self._saved_state = self._saved_state, None
        checkpointed = getattr(self.data, "checkpointed", None)
        if state is None or checkpointed is None:
            return
        try:
            checkpointed(state)
        except DataPlaneError as exc:
            log.warning("the checkpoint at step %s was saved but not marked in the data plane: %s", state.get("next_step"), exc)
