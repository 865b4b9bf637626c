"""The trainer-side client: an iterator of batches from the rank's constructor.

    client = Client()                      # rank and address from the environment
    for batch in client:
        for mb in batch["microbatches"]:
            loss = model(mb["input_ids"], ...)
        ...
        checkpoint["data"] = client.state_dict()

Each batch is a dict: "step", "rank" (global), "dp_rank", "cp_rank", "tp_rank", "pp_rank",
"microbatches" (a list of dicts of tensors plus "num_tokens", "loss_tokens", "filler" and
"loss_weight", the microbatch's share t / T of the step's loss tokens), "loss_weight" (the
rank's share, summed over its microbatches), "global_loss_tokens" (loss-carrying tokens of the
step over all ranks, to normalize a summed loss), "sources" (names indexed by "sample_source"),
"subbatches" (secondary graphs' per-sample data for this rank by graph name, e.g. the images it
encodes) and "data_wait_s" (how long the iterator blocked for this batch).

The microbatches of a rank depend on where it sits in the mesh: a CP rank gets its slice of
every sequence (position ids of the full sequence), pipeline stages only what they use (the
first the inputs, the last labels and loss_mask), a TP peer the trainer broadcasts to only the
metadata. Under a token budget, the number of microbatches varies by step, the same on every
rank.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from collections.abc import Iterator, Mapping
from concurrent import futures
from typing import Any

import torch

from batchplane.client.errors import InvalidRequestError
from batchplane.client.tensors import unpack
from batchplane.client.transport import ConstructorConnection

STATE_VERSION = 3

log = logging.getLogger(__name__)
ENV_ADDRESS = "BATCHPLANE_CONSTRUCTOR"
ENV_ENDPOINTS = "BATCHPLANE_ENDPOINTS"


class Client:
    """Iterates over the batches of one data-parallel rank.

    Args:
        address: The constructor's address ("host:port" or "unix:///path"). Default: the
            environment variable BATCHPLANE_CONSTRUCTOR, else the rank's entry in the endpoints
            file named by BATCHPLANE_ENDPOINTS (written by `batchplane up`).
        rank: The global rank in the job's mesh. Default: the environment variable RANK (set by
            torchrun), else 0.
        device: Move tensors there (non_blocking) before yielding, e.g. "cuda"; None keeps them
            on the CPU.
        pin_memory: Receive into pinned memory; default: when CUDA is available.
        timeout_s: How long one request keeps retrying an unavailable data plane before raising
            DataPlaneUnavailable.
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
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.rank = _resolve_rank(rank)
        self.address = _resolve_address(address, self.rank)
        self.device = torch.device(device) if device is not None else None
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._connection = ConstructorConnection(self.address, timeout_s=timeout_s)
        info = self._connection.info()
        self.job = info.job
        self.sources = tuple(info.job.sources)
        m = info.job.mesh
        size = max(m.dp, 1) * max(m.cp, 1) * max(m.tp, 1) * max(m.pp, 1)
        shape = f"pp={max(m.pp, 1)} dp={m.dp} cp={max(m.cp, 1)} tp={max(m.tp, 1)}"
        if not 0 <= self.rank < size:
            raise InvalidRequestError(f"rank {self.rank} is outside the job's mesh of {size} ranks ({shape})")
        if self.rank not in info.ranks:
            raise InvalidRequestError(
                f"the constructor at {self.address} serves ranks {list(info.ranks)}, not rank {self.rank}"
            )
        world = os.environ.get("WORLD_SIZE")
        if rank is None and world is not None and world.isdigit() and int(world) != size:
            raise InvalidRequestError(f"WORLD_SIZE={world} but the job's mesh has {size} ranks ({shape})")
        self._next_step = 0
        self._resume: dict[str, str] = {}
        #: Groups of settings that changed since the checkpoint this client resumed from.
        self.resumed_across: tuple[str, ...] = ()
        self._report_warnings: set[str] = set()
        self._executor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchplane-fetch")

    # ---- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yields batches from the next step on until the job's data ends.

        While the trainer works on step s, step s + 1 is received in the background; step s + 2
        is not asked for before step s + 1 is yielded, so a checkpoint taken after any step
        resumes against the same running data plane.
        """
        pending = self._executor.submit(self._fetch, self._next_step)
        try:
            while True:
                begin = time.perf_counter()
                batch = pending.result()
                if batch is None:
                    return
                batch["data_wait_s"] = time.perf_counter() - begin
                self._next_step = batch["step"] + 1
                pending = self._executor.submit(self._fetch, self._next_step)
                yield batch
        finally:
            pending.cancel()

    def _fetch(self, step: int) -> dict[str, Any] | None:
        header, storage = self._connection.batch(self.rank, step, pin=self.pin_memory, resume=self._resume)
        self._resume = {}
        if header.end_of_data:
            return None
        microbatches = []
        for spec in header.microbatches:
            tensors = unpack(storage, spec.tensors)
            if self.device is not None:
                tensors = {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
            microbatches.append(
                {**tensors, "num_tokens": spec.num_tokens, "loss_tokens": spec.loss_tokens, "filler": spec.filler, "loss_weight": spec.loss_weight}
            )
        subbatches = {}
        for sub in header.subbatches:
            tensors = unpack(storage, sub.tensors)
            if self.device is not None:
                tensors = {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}
            subbatches[sub.name] = tensors
        return {
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
        belongs to (fingerprints per group of settings, see `load_state_dict`)."""
        return {
            "version": STATE_VERSION,
            "job": self.job.job_id,
            "fingerprint": self.job.fingerprint,
            "fingerprints": dict(self.job.fingerprints),
            "rank": self.rank,
            "next_step": self._next_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at `state["next_step"]`, also across changes of the mixture, the mesh (any
        rank's state then serves every new rank: they all resume at the same step), the
        loaders or the batching: the planner re-plans from its ledger's record of the step
        before, and `resumed_across` names what changed.

        Raises:
            InvalidRequestError: a malformed state, one whose data settings (sources,
                transforms, seed, epochs, shuffle) differ, or another rank's state on an
                unchanged mesh.
        """
        missing = {"version", "fingerprints", "rank", "next_step"} - set(state)
        if missing:
            raise InvalidRequestError(f"state_dict lacks {sorted(missing)}")
        if state["version"] != STATE_VERSION:
            raise InvalidRequestError(f"state_dict version {state['version']} is not {STATE_VERSION}")
        step = state["next_step"]
        if not isinstance(step, int) or step < 0:
            raise InvalidRequestError(f"state_dict next_step must be an integer >= 0, got {step!r}")
        then, now = dict(state["fingerprints"]), dict(self.job.fingerprints)
        if then.get("data") != now.get("data"):
            raise InvalidRequestError(
                f"state_dict is from job {state.get('job')!r} whose data settings (sources, transforms, seed, epochs or shuffle) "
                f"differ from job {self.job.job_id!r}: its positions name other samples, so it cannot resume here"
            )
        changed = tuple(name for name in now if then.get(name) != now[name])
        if "topology" not in changed and state["rank"] != self.rank:
            raise InvalidRequestError(f"state_dict is of rank {state['rank']}, this client is rank {self.rank}")
        if changed:
            log.info("rank %d resumes at step %d across changes of %s; the planner re-plans from its ledger", self.rank, step, ", ".join(changed))
        self.resumed_across = changed
        self._resume = then
        self._next_step = step

    # ---- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve_rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    text = os.environ.get("RANK", "0")
    if not text.lstrip("-").isdigit():
        raise InvalidRequestError(f"RANK={text!r} is not an integer")
    return int(text)


def _resolve_address(address: str | None, rank: int) -> str:
    if address:
        return address
    if os.environ.get(ENV_ADDRESS):
        return os.environ[ENV_ADDRESS]
    endpoints = os.environ.get(ENV_ENDPOINTS)
    if endpoints:
        try:
            table = json.loads(pathlib.Path(endpoints).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidRequestError(f"{ENV_ENDPOINTS}={endpoints!r} is not a readable endpoints file: {exc}") from exc
        found = table.get("constructors", {}).get(str(rank))
        if not found:
            raise InvalidRequestError(f"the endpoints file {endpoints!r} has no constructor for rank {rank}")
        return found
    raise InvalidRequestError(f"no constructor address: pass address=, or set {ENV_ADDRESS} or {ENV_ENDPOINTS}")
