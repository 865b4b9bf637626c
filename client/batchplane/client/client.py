"""The trainer-side client: an iterator of batches from the rank's constructor.

    client = Client()                      # rank and address from the environment
    for batch in client:
        for mb in batch["microbatches"]:
            loss = model(mb["input_ids"], ...)
        ...
        checkpoint["data"] = client.state_dict()

Each batch is a dict: "step", "rank" (global), "dp_rank", "cp_rank", "tp_rank", "pp_rank",
"microbatches" (a list of dicts of tensors plus "num_tokens", "loss_tokens", "filler",
"loss_weight", the microbatch's share t / T of the step's loss tokens, and "ignore_id", the
label of positions without a target), "loss_weight" (the rank's share, summed over its
microbatches), "global_loss_tokens" (loss-carrying tokens of the step over all ranks, to
normalize a summed loss), "sources" (names indexed by "sample_source"), "subbatches" (secondary
graphs' per-sample data for this rank by graph name, e.g. the images it encodes), "format" (how
the tensors are laid out: "labels", "ignore_id", "pad_id", "packing") and "data_wait_s" (how
long the iterator blocked for this batch).

Which tensor each consumer wants. `labels` are the next token, already shifted:
labels[t] = input_ids[t + 1] within a sample, `ignore_id` on each sample's last token and on
padding (batch["format"]["labels"] == "next_token"). Loss code in the Megatron-LM / torchtitan
style takes them as they are: cross_entropy(logits, labels). A Hugging Face causal LM shifts its
`labels` argument itself, so passing these trains on token t + 2: give it
`batchplane.client.hf.causal_lm_inputs(mb)` instead, which returns Hugging Face's unshifted
labels and, for packed microbatches, attention that never crosses a document.

The microbatches of a rank depend on where it sits in the mesh: a CP rank gets its slice of
every sequence (position ids of the full sequence), pipeline stages only what they use (the
first the inputs, the last labels and loss_mask), a TP peer the trainer broadcasts to only the
metadata. Under a token budget, the number of microbatches varies by step, the same on every
rank.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
from collections.abc import Iterator, Mapping
from concurrent import futures
from typing import Any

import torch

from batchplane.client.device import AUTO, DeviceCopier, resolve_device
from batchplane.client.endpoints import AddressBook
from batchplane.client.errors import InvalidRequestError
from batchplane.client.tensors import unpack
from batchplane.client.transport import ConstructorConnection
from batchplane.client.waits import NOTE_EVERY_S, WaitClock
from batchplane.v1 import constructor_pb2

#: The state_dict format: 5 adds "journal", journal cursors (journal delivery) as one JSON
#: string, "{}" without any; 4 holds the fingerprints as one JSON string, so that its keys never
#: change (torch.distributed.checkpoint loads into the keys of the current state); 3 (a mapping)
#: and 4 still load (without a cursor).
STATE_VERSION = 5
LOADABLE_VERSIONS = (3, 4, 5)
#: The fields of a journal cursor in the state ("journal"), as in `JournalCursor`.
CURSOR_FIELDS = ("manifest_version", "step", "offset")
#: The least state of the "journal" key: no cursor.
NO_CURSORS = "{}"
#: The most steps one call to the constructor carries (`Client.steps_per_call`): past 8, one
#: more message per call saves little (measured: 0.9 ms of client CPU per batch at one per call,
#: 0.24 ms at 8, 0.17 ms at 64).
MAX_CALL_STEPS = 8
#: Bytes of batches one call carries at most, by the size of the last batch: large batches come
#: one per call.
CALL_BYTES = 16 << 20
#: What a call's queue holds after its last batch.
_CALL_ENDED = object()

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call to the constructor, running on the fetch thread: its future (True past the end
    of data) and what it received, in order, then `_CALL_ENDED`."""

    future: futures.Future[bool]
    received: queue.SimpleQueue[Any]


class Client:
    """Iterates over the batches of one data-parallel rank.

    Args:
        address: The constructor's address ("host:port" or "unix:///path"). Default: the
            environment variable BATCHPLANE_CONSTRUCTOR, else the rank's entry in the endpoints
            file named by BATCHPLANE_ENDPOINTS (written by `batchplane up`; waited for when it
            does not exist yet, and read again when the constructor stops answering).
        rank: The global rank in the job's mesh. Default: the environment variable RANK (set by
            torchrun), else 0.
        device: Where tensors go before they are yielded. "auto" (default): the rank's own GPU
            when CUDA is available (cuda:LOCAL_RANK), else the CPU; "cuda", "cuda:i" or a
            torch.device; None or "cpu" keeps them on the CPU. Copies run on a side stream from
            pinned memory (see `batchplane.client.device`).
        pin_memory: Receive into pinned memory; default: when CUDA is available.
        timeout_s: How long one request keeps retrying an unavailable data plane (or waits for
            its endpoints file) before raising DataPlaneUnavailable.

    Batches come through the constructor's shared memory when it serves on a Unix socket with
    a slab socket beside it (tensors are views of it, no copy; BATCHPLANE_SHM=0 turns it off),
    else over the gRPC stream; `transport` says which ("shm" or "grpc"), and the first batch
    of each logs it. A shared-memory slab is released once every tensor of its step is dropped
    (see `batchplane.client.slabs`).
    Raises:
        InvalidRequestError: no address can be found, the rank is outside the job's mesh, or
            WORLD_SIZE disagrees with it.
        DataPlaneUnavailable: the constructor does not answer within `timeout_s`.
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
        self.rank = _resolve_rank(rank)
        self.device = resolve_device(device)
        self._copier = DeviceCopier(self.device) if self.device is not None and self.device.type == "cuda" else None
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._connection = ConstructorConnection(
            AddressBook(address, rank=self.rank), timeout_s=timeout_s, pin_slabs=self._copier is not None
        )
        self._transport = ""
        self._transports_logged: set[str] = set()
        info = self._connection.info()
        self._connection.slab_channel()  # connects the slab socket, when the constructor has one
        self.job = info.job
        self.sources = tuple(info.job.sources)
        m = info.job.mesh
        size = max(m.dp, 1) * max(m.cp, 1) * max(m.tp, 1) * max(m.pp, 1)
        shape = f"pp={max(m.pp, 1)} dp={m.dp} cp={max(m.cp, 1)} tp={max(m.tp, 1)}"
        if not 0 <= self.rank < size:
            raise InvalidRequestError(f"rank {self.rank} is outside the job's mesh of {size} ranks ({shape})")
        if self.rank not in info.ranks:
            raise InvalidRequestError(f"the constructor at {self.address} serves ranks {list(info.ranks)}, not rank {self.rank}")
        world = os.environ.get("WORLD_SIZE")
        if rank is None and world is not None and world.isdigit() and int(world) != size:
            raise InvalidRequestError(f"WORLD_SIZE={world} but the job's mesh has {size} ranks ({shape})")
        self._next_step = 0
        #: Where logical steps start in the journal (journal delivery): the last step yielded
        #: and the next one, where known (a batch's header says where the next one starts).
        self._cursors: dict[int, constructor_pb2.JournalCursor] = {}
        self._resume: dict[str, str] = {}
        self._resume_cursor: constructor_pb2.JournalCursor | None = None
        self._restart = True  # the first request says the trainer (re)starts there
        #: Groups of settings that changed since the checkpoint this client resumed from.
        self.resumed_across: tuple[str, ...] = ()
        self._report_warnings: set[str] = set()
        self._length: Any = None
        initializer = self._copier.bind_thread if self._copier is not None else None
        self._executor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchplane-fetch", initializer=initializer)
        self._max_batch_steps = max(info.max_batch_steps, 1)
        self._last_bytes: int | None = None  # the last batch's payload, for `steps_per_call`
        self._waits = WaitClock()
        self._noted = False  # the current wait was noted to the constructor
        #: The first step past the job's data, once a batch's header (or the end of data) said.
        self._end_step: int | None = None

    @property
    def address(self) -> str:
        """The constructor's address now."""
        return self._connection.address

    @property
    def transport(self) -> str:
        """How the last batch arrived: "shm" (a view of the constructor's shared memory, see
        `batchplane.client.slabs`) or "grpc" (streamed over the constructor's socket); before
        the first batch, "shm" when the constructor's slab socket is connected."""
        if self._transport:
            return self._transport
        return "shm" if self._connection.shm_session else "grpc"

    # ---- length --------------------------------------------------------------------------

    @property
    def num_steps(self) -> int | None:
        """Steps of the whole job, from step 0 to its end of data (what `len` gives; a client
        resumed at step c yields num_steps - c more); None when the job never ends or its length
        is not known (yet, or in advance: an adaptive mixture that may stop reading a source).
        Asks the planner, which waits for its loaders to register.

        An upper bound that becomes exact: bad samples met while reading (batch.bad_samples.policy
        substitute, the default) can end the data a few steps earlier than counted at the start;
        the count is exact once the planner has planned the end of the data, a few steps before
        the trainer reaches it. Iteration always ends at the real end, wherever that is."""
        if self._end_step is not None:
            return self._end_step
        return self._job_length().num_steps or None

    def _job_length(self) -> Any:
        if self._length is not None:
            return self._length
        length = self._connection.length()
        if length.exact or length.infinite:  # settled for the job's lifetime
            self._length = length
        return length

    def __len__(self) -> int:
        """The job's number of steps (`num_steps`: an upper bound that becomes exact), for LR
        schedules, `max_steps` and progress bars.

        Raises:
            TypeError: the job never ends (epochs: infinite), or its length is not known; the
                message says why.
        """
        if self._end_step is not None:
            return self._end_step
        length = self._job_length()
        if not length.num_steps:
            why = "its data never ends (epochs: infinite)" if length.infinite else length.unknown or "the planner does not know it"
            raise TypeError(f"the batchplane job {self.job.job_id!r} has no len(): {why}")
        return length.num_steps

    # ---- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yields batches from the next step on until the job's data ends.

        While the trainer works on step s, the batches after it are received in the background:
        one call to the constructor carries the next step's batch and, while batches are small,
        those of the steps after it as they are built (`steps_per_call`). A call asks for step
        s only once step s - 1 has been yielded, so a checkpoint taken after any step resumes
        against the same running data plane.
        """
        if self._past_end(self._next_step):
            return
        call = self._start_call(self._next_step)
        try:
            while True:
                self._waits.begin()
                item = self._receive(call)
                while item is _CALL_ENDED:
                    if call.future.result() or self._past_end(self._next_step):  # raises what ended the call
                        self._end_wait()
                        return  # the data ended
                    call = self._start_call(self._next_step)  # it ended early: ask again from there
                    item = self._receive(call)
                batch, copied, cursor, last = item
                if copied is not None and self._copier is not None:  # this thread's stream waits for the side stream's copies
                    self._copier.hand_over([*batch["microbatches"], *batch["subbatches"].values()], copied)
                batch["data_wait_s"] = self._end_wait()
                step = batch["step"]
                self._next_step = step + 1
                self._cursors = {} if cursor is None else {**{s: c for s, c in self._cursors.items() if s == step}, step + 1: cursor}
                if self._past_end(self._next_step):
                    yield batch
                    return  # the last step: nothing is asked for past it
                if last:
                    call = self._start_call(self._next_step)
                yield batch
        finally:
            call.future.cancel()

    @property
    def ended(self) -> bool:
        """Whether the job's data ends before the next step this client would yield (as far as it
        knows: a batch's header says where the data ends once the data plane knows)."""
        return self._past_end(self._next_step)

    def _past_end(self, step: int) -> bool:
        """Whether `step` is past the job's data, as far as this client knows (a batch's header
        said where the data ends, or a call ended at its end)."""
        return self._end_step is not None and step >= self._end_step

    def _receive(self, call: _Call) -> Any:
        """The next item of `call`, waiting as long as it takes; while the trainer waits, its
        wait is noted to the constructor every `NOTE_EVERY_S` (`waits`)."""
        while True:
            try:
                return call.received.get(timeout=NOTE_EVERY_S)
            except queue.Empty:
                self._connection.note_wait(self.rank, self._waits.measure())
                self._noted = True

    def _end_wait(self) -> float:
        """The trainer's wait ends; returns how long it was. A wait noted to the constructor is
        noted as over at once (its metrics stop counting it)."""
        waited = self._waits.end()
        if self._noted:
            self._noted = False
            self._connection.note_wait(self.rank, self._waits.measure())
        return waited

    def steps_per_call(self) -> int:
        """How many steps the next call to the constructor may carry: one at first, then as many
        of the last batch's size as fit in `CALL_BYTES`, at most `MAX_CALL_STEPS` and what the
        constructor serves (`GetInfoResponse.max_batch_steps`). Several small batches share one
        call's overhead (about 1 ms of CPU on each side in Python gRPC); large ones come one by
        one, so the client never holds much more than one step ahead."""
        if self._last_bytes is None:
            return 1
        return max(1, min(MAX_CALL_STEPS, self._max_batch_steps, CALL_BYTES // max(self._last_bytes, 1)))

    def _start_call(self, step: int) -> _Call:
        """Starts the call that fetches from `step` on (on the fetch thread)."""
        received: queue.SimpleQueue[Any] = queue.SimpleQueue()
        future = self._executor.submit(self._fetch, step, self.steps_per_call(), received)
        future.add_done_callback(lambda _: received.put(_CALL_ENDED))  # also when cancelled before it ran
        return _Call(future, received)

    def _fetch(self, step: int, count: int, received: queue.SimpleQueue[Any]) -> bool:
        """Fetches the batches of one call from `step` on (on the fetch thread): puts each, with
        the event of its device copies (None on the CPU), the journal cursor of the step after
        it (None with stream delivery) and whether it is the last the call carries, in
        `received`. Returns True past the end of data."""
        batches = self._connection.batches(
            self.rank,
            step,
            max_steps=count,
            pin=self.pin_memory,
            resume=self._resume,
            restart=self._restart,
            cursor=self._resume_cursor,
            data_wait=self._waits.measure,
        )
        for index, (header, storage) in enumerate(batches):
            self._resume, self._restart, self._resume_cursor = {}, False, None
            if header.end_of_data:
                self._end_step = header.step if self._end_step is None else min(self._end_step, header.step)
                return True
            if header.end_step > 0:
                self._end_step = header.end_step
            self._last_bytes = header.payload_bytes
            batch, copied = self._batch_of(header, storage)
            del storage  # the batch's tensors alone keep its slab or buffer
            received.put((batch, copied, header.journal_cursor if header.HasField("journal_cursor") else None, index == count - 1))
        return False

    def _batch_of(self, header: constructor_pb2.BatchHeader, storage: torch.Tensor) -> tuple[dict[str, Any], Any]:
        """A received batch as the trainer gets it, and the event of its device copies (None on
        the CPU)."""
        shm = header.HasField("shm")
        self._note_transport("shm" if shm else "grpc")
        groups = [unpack(storage, spec.tensors) for spec in header.microbatches]
        groups += [unpack(storage, sub.tensors) for sub in header.subbatches]
        del storage
        copied = None
        if self._copier is not None:
            groups, copied = self._copier.copy(groups)
            if isinstance(copied, torch.cuda.Event):
                copied.synchronize()  # its slab or receive buffer is reused once the copies are done and the host views dropped
        elif self.device is not None:
            groups = [{k: v.to(self.device) for k, v in group.items()} for group in groups]
        fmt = self.job.format
        microbatches = [
            {
                **tensors,
                "num_tokens": spec.num_tokens,
                "loss_tokens": spec.loss_tokens,
                "filler": spec.filler,
                "loss_weight": spec.loss_weight,
                "ignore_id": fmt.ignore_id,
            }
            for spec, tensors in zip(header.microbatches, groups)
        ]
        subbatches = {sub.name: tensors for sub, tensors in zip(header.subbatches, groups[len(header.microbatches) :])}
        return (
            {
                "step": header.step,
                "rank": header.rank,
                "dp_rank": header.dp_rank,
                "cp_rank": header.cp_rank,
                "tp_rank": header.tp_rank,
                "pp_rank": header.pp_rank,
                "microbatches": microbatches,
                "loss_weight": sum(spec.loss_weight for spec in header.microbatches),
                "subbatches": subbatches,
                "global_loss_tokens": header.global_loss_tokens,
                "sources": self.sources,
                "format": self.format,
            },
            copied,
        )

    def _note_transport(self, transport: str) -> None:
        self._transport = transport
        if transport not in self._transports_logged:
            self._transports_logged.add(transport)
            if transport == "shm":
                log.info("rank %d receives its batches through shared memory from the constructor at %s", self.rank, self.address)
            else:
                log.info("rank %d receives batches over the gRPC stream from the constructor at %s", self.rank, self.address)

    @property
    def format(self) -> dict[str, Any]:
        """How the job lays out its tensors: "labels" ("next_token": labels[t] = input_ids[t + 1]
        within a sample), "ignore_id", "pad_id", "packing", "max_length" (0: no limit),
        "length_policy" and "payload": the job's declared columns besides input_ids, each a dict
        of name, kind ("token", "sample" or "blob"), dtype, shape and fill (see the README's
        *Payload columns*)."""
        fmt = self.job.format
        return {
            "labels": fmt.labels or "next_token",
            "ignore_id": fmt.ignore_id,
            "pad_id": fmt.pad_id,
            "packing": fmt.packing,
            "max_length": fmt.max_length,
            "length_policy": fmt.length_policy,
            "payload": [{"name": c.name, "kind": c.kind, "dtype": c.dtype, "shape": tuple(c.shape), "fill": c.fill} for c in fmt.payload],
        }

    # ---- metric-driven mixing ------------------------------------------------------------

    def report(self, step: int, losses: Mapping[str, float]) -> bool:
        """Reports step `step`'s mean training loss per source, for a job whose mixture adapts to
        training (mixture.schedule.kind "adaptive"). One rank reports for the whole job, after
        reducing the ranks' per-source loss sums and sample counts (e.g. with all_reduce); the
        batch's "sources" names each microbatch's "sample_source" ids. The planner uses the
        report of step s to plan step s + delay_steps, so report every step.

        Returns:
            True when the report is recorded; False (logged once per reason) when the job's
            mixture is not adaptive or the step was already reported with other losses.
        Raises:
            InvalidRequestError: a name that is no source, or a loss that is not a finite
                number >= 0.
        """
        response = self._connection.report(step, {str(k): float(v) for k, v in losses.items()})
        if not response.accepted and response.reason not in self._report_warnings:
            self._report_warnings.add(response.reason)
            log.warning("report of step %d not used: %s", step, response.reason)
        return response.accepted

    # ---- checkpointing -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the step after the last one yielded, and the job and settings it
        belongs to (fingerprints per group of settings, see `load_state_dict`); with journal
        delivery also "journal", where that step and the last one yielded start in the journal
        (a JSON object: logical step -> the manifest version read, the written step and the DP
        slice in it; "{}" without any), so a resume after a change of DP, and any later one,
        reads on where it stopped, also when a framework adapter sets "next_step" back to the
        step in training (a checkpoint between its microbatches). Nothing in it is
        specific to the rank ("rank" is informational): ranks take the same steps, so the state
        that frameworks save from rank 0 only (Hugging Face Trainer, Lightning, accelerate) or
        de-duplicate across ranks (torch.distributed.checkpoint) restores every rank. The client
        is a `torch.distributed.checkpoint.stateful.Stateful`: `dcp.save({"data": client})`."""
        return {
            "version": STATE_VERSION,
            "job": self.job.job_id,
            "fingerprint": self.job.fingerprint,
            "fingerprints": json.dumps(dict(self.job.fingerprints), sort_keys=True),
            "rank": self.rank,
            "next_step": self._next_step,
            "journal": json.dumps({str(s): {name: getattr(c, name) for name in CURSOR_FIELDS} for s, c in sorted(self._cursors.items())}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at `state["next_step"]`, saved by this rank or any other, also against a data
        plane that kept running past it (a rewind: the planner re-plans from its ledger, so the
        batches are those the job delivered the first time), and across changes of the mixture,
        the mesh, the loaders or the batching: the planner re-plans from its ledger's record of
        the step before, and `resumed_across` names what changed.

        Raises:
            InvalidRequestError: a malformed state, or one whose data settings (sources,
                transforms, seed, epochs, shuffle) differ: its positions name other samples.
        """
        missing = {"version", "fingerprints", "next_step"} - set(state)
        if missing:
            raise InvalidRequestError(f"state_dict lacks {sorted(missing)}")
        if state["version"] not in LOADABLE_VERSIONS:
            raise InvalidRequestError(f"state_dict version {state['version']!r} is not one of {LOADABLE_VERSIONS}")
        step = state["next_step"]
        if not isinstance(step, int) or step < 0:
            raise InvalidRequestError(f"state_dict next_step must be an integer >= 0, got {step!r}")
        cursors = _journal_cursors(state.get("journal", NO_CURSORS))
        if cursors and step not in cursors:
            log.warning(
                "rank %d resumes at step %d but the state's journal cursors are for steps %s: the constructor takes the step "
                "to start at the journal step of the same number",
                self.rank,
                step,
                sorted(cursors),
            )
        then, now = _fingerprints(state["fingerprints"]), dict(self.job.fingerprints)
        if then.get("data") != now.get("data"):
            raise InvalidRequestError(
                f"state_dict is from job {state.get('job')!r} whose data settings (sources, transforms, seed, epochs or shuffle) "
                f"differ from job {self.job.job_id!r}: its positions name other samples, so it cannot resume here"
            )
        changed = tuple(name for name in now if then.get(name) != now[name])
        if changed:
            log.info(
                "rank %d resumes at step %d across changes of %s; the planner re-plans from its ledger", self.rank, step, ", ".join(changed)
            )
        self.resumed_across = changed
        self._end_step = None  # where the data ends is said again (a change of batching moves it)
        self._resume = then
        self._restart = True
        self._next_step = step
        self._resume_cursor = cursors.get(step)
        self._cursors = {} if self._resume_cursor is None else {step: self._resume_cursor}

    def checkpointed(self, state: Mapping[str, Any] | None = None) -> bool:
        """Tells the data plane that a checkpoint was saved, once the save succeeded: call it on
        every rank (also where only rank 0 writes the data state). With journal delivery the
        rank's constructor then keeps the journal's steps from the checkpoint's step on (its
        pod's checkpoint mark), and lets the reclaimer delete those before the lowest mark; a
        rank that never calls it keeps everything from where it started, and the producer is
        then paced by what the ranks consumed only. With stream delivery nothing is kept
        (logged once; the planner's ledger re-plans what it holds).

        Args:
            state: The saved `state_dict()` (its "next_step" is the checkpoint's step); None:
                the state now (`state_dict()`), for a checkpoint saved since the last batch.

        Returns:
            True when the checkpoint's mark is kept; False with stream delivery.
        Raises:
            InvalidRequestError: a malformed state.
            StepUnavailableError: a step this rank was not handed (before the step it resumed
                at, or more than one past its last batch), or one the journal already reclaimed.
            DataPlaneUnavailable: the mark could not be recorded within `timeout_s`.
        """
        step = self._next_step if state is None else state.get("next_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidRequestError(f"state_dict next_step must be an integer >= 0, got {step!r}")
        response = self._connection.mark_checkpoint(self.rank, step)
        if not response.accepted and response.reason not in self._report_warnings:
            self._report_warnings.add(response.reason)
            log.info("checkpoint at step %d not kept by the data plane: %s", step, response.reason)
        return response.accepted

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Ends the client, deterministically: cancels the step being received in the background,
        waits for the fetch thread to end, then closes the connection (no gRPC call or thread
        outlives it, so nothing of gRPC's is torn down at interpreter exit). Idempotent; the
        client serves no batch after it. Call it (or use the client as a context manager) before
        the process exits."""
        self._connection.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fingerprints(value: Any) -> dict[str, str]:
    """A state's fingerprints: a JSON object (version 4) or a mapping (version 3)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequestError(f"state_dict fingerprints are not JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"state_dict fingerprints must be a mapping of settings groups to hashes, got {type(value).__name__}")
    return {str(k): str(v) for k, v in value.items()}


def _journal_cursors(value: Any) -> dict[int, constructor_pb2.JournalCursor]:
    """A state's journal cursors: a JSON object of logical steps to objects of `CURSOR_FIELDS`
    (integers >= 0 each)."""
    try:
        cursors = json.loads(value) if isinstance(value, str) else None
    except ValueError as exc:
        raise InvalidRequestError(f"state_dict journal is not JSON: {exc}") from exc
    if not isinstance(cursors, dict) or not all(
        step.isdigit()
        and isinstance(fields, dict)
        and set(fields) == set(CURSOR_FIELDS)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fields.values())
        for step, fields in cursors.items()
    ):
        raise InvalidRequestError(
            f"state_dict journal must be a JSON object of steps to objects of integers >= 0 {list(CURSOR_FIELDS)}, got {value!r}"
        )
    return {int(step): constructor_pb2.JournalCursor(**fields) for step, fields in cursors.items()}


def _resolve_rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    text = os.environ.get("RANK", "0")
    if not text.lstrip("-").isdigit():
        raise InvalidRequestError(f"RANK={text!r} is not an integer")
    return int(text)
