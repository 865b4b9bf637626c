"""Checkpoint marks of one pod's journal consumer: which step the pod's live checkpoints still
need, from the steps its ranks were handed and the checkpoints their trainers recorded
(`Client.checkpointed`, the Constructor's MarkCheckpoint). Pure: no grpc, no I/O, no threads,
no clocks; the consumer's servicer feeds it events and records the answers in the journal's
manifest.

Rules:
- A rank starts at the first step it is handed after this process starts, and starts again at
  a step it asks for with `restart` (a trainer restored from a checkpoint): its earlier
  checkpoint is then forgotten (the trainer went back before it).
- A checkpoint of rank r resumes at step s (its state_dict's "next_step"): r must have been
  handed a step here, s must not lie before the step r (re)started at, and not more than one
  step past the last step r was handed (a trainer checkpoints what it trained). A later
  checkpoint replaces an earlier one.
- The pod's mark is the minimum over its holding ranks (those that pull batches) of the rank's
  latest checkpoint, or of its start step while it has none: a rank that has not checkpointed
  holds the mark at its start. No mark while a holding rank has not started.
- Mark ids: `ckpt-pod-I` once every holding rank checkpointed (a checkpoint's mark), else
  `start-pod-I` (a start's hold). Both keep the reclaimer off (it takes the minimum over every
  mark); only a checkpoint's mark counts for `journal.max_lag_steps` (`counts_for_lag`), so a
  trainer that never checkpoints is held back by its progress marks (`pod-I`) only, and never
  waits for a checkpoint that will not come.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from batchplane.core.errors import FailedPrecondition, InvalidArgument

#: Mark ids of checkpoints start with this.
CHECKPOINT_PREFIX = "ckpt-"
#: Mark ids of start holds (no checkpoint yet) start with this.
START_PREFIX = "start-"


def checkpoint_mark(pod: str) -> str:
    """The checkpoint mark's id of the consumer group `pod` (its progress mark, "pod-I")."""
    return f"{CHECKPOINT_PREFIX}{pod}"


def start_mark(pod: str) -> str:
    """The start hold's id of the consumer group `pod` (its progress mark, "pod-I")."""
    return f"{START_PREFIX}{pod}"


def counts_for_lag(mark: str) -> bool:
    """Whether producers count mark `mark` for `journal.max_lag_steps`: every mark but a
    start's hold (see the module docstring)."""
    return not mark.startswith(START_PREFIX)


@dataclasses.dataclass(frozen=True)
class PodMark:
    """The pod's mark.

    Attributes:
        step: The lowest logical step its live checkpoints (or starts) need.
        checkpointed: Every holding rank checkpointed since it (re)started.
    """

    step: int
    checkpointed: bool


@dataclasses.dataclass
class _Rank:
    start: int
    handed: int
    checkpoint: int | None = None


class CheckpointMarks:
    """The pod's checkpoint mark (see the module docstring).

    Args:
        ranks: The global ranks served here.
        holding: The ranks whose checkpoints hold the mark (those that pull batches); default:
            every rank. Must be a non-empty subset of `ranks`.

    Raises:
        InvalidArgument: `holding` empty or not within `ranks`.
    """

    def __init__(self, ranks: Iterable[int], *, holding: Iterable[int] | None = None) -> None:
        self.ranks = tuple(sorted(set(ranks)))
        self.holding = tuple(sorted(set(self.ranks if holding is None else holding)))
        if not self.holding or not set(self.holding) <= set(self.ranks):
            raise InvalidArgument(f"holding ranks {list(self.holding)} must be a non-empty subset of the served ranks {list(self.ranks)}")
        self._state: dict[int, _Rank] = {}

    def handed(self, rank: int, step: int, *, restart: bool = False) -> None:
        """Rank `rank` was handed logical step `step` (`restart`: it asked as a trainer that
        (re)starts there). A rank not served here is ignored (the servicer refuses it)."""
        if rank not in self.ranks:
            return
        state = self._state.get(rank)
        if state is None or restart:
            self._state[rank] = _Rank(start=step, handed=step)
        else:
            state.handed = max(state.handed, step)

    def checkpointed(self, rank: int, step: int) -> None:
        """Rank `rank`'s trainer saved a checkpoint that resumes at logical step `step`.

        Raises:
            InvalidArgument: A rank not served here, or a negative step.
            FailedPrecondition: A rank that was handed no step here yet, or a step before the
                one it (re)started at or more than one past the last one it was handed.
        """
        if rank not in self.ranks:
            raise InvalidArgument(f"rank {rank} is not served here: this constructor serves ranks {list(self.ranks)}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgument(f"a checkpoint's step must be an integer >= 0, got {step!r}")
        state = self._state.get(rank)
        if state is None:
            raise FailedPrecondition(
                f"rank {rank} has not been handed a step by this constructor yet: a checkpoint resumes at a step it trained up to"
            )
        if step < state.start:
            raise FailedPrecondition(
                f"a checkpoint of rank {rank} at step {step} is before step {state.start}, where the rank (re)started reading here"
            )
        if step > state.handed + 1:
            raise FailedPrecondition(
                f"a checkpoint of rank {rank} at step {step} is past what the rank was handed (up to step {state.handed}): "
                f"a checkpoint resumes at most one step past the last step trained"
            )
        state.checkpoint = step

    def mark(self) -> PodMark | None:
        """The pod's mark; None while a holding rank has not started."""
        states = [self._state.get(r) for r in self.holding]
        if any(s is None for s in states):
            return None
        held = [s for s in states if s is not None]
        return PodMark(
            step=min(s.start if s.checkpoint is None else s.checkpoint for s in held),
            checkpointed=all(s.checkpoint is not None for s in held),
        )
