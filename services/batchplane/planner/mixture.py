"""Which samples each step takes from each source: the mixture allocator. Pure; no I/O.

Every source is a stream of samples numbered by `seq` (epoch * num_rows + position in the
epoch's shuffled order). A step takes a contiguous range of seqs from each source, so what the
job has consumed is one cursor per source, and a sample is taken at most once per pass (I1).

How many samples a step takes from each source solves the chairman assignment problem
(Tijdeman, 1980) at step boundaries: with K sources of shares p_k and T samples taken since
the shares last changed, source k has taken c_k with |c_k - p_k * T| <= 1 - 1/(2K - 2) after
every step. Each step first gives every source the samples it must have by the step's end to
stay above its lower bound, then hands the remaining places out by earliest deadline (the time
a source's next sample becomes due) among sources below their upper bound. So the realized
mixture never drifts by a whole sample from the target, far inside the O(sqrt(T)) drift of
i.i.d. sampling; the allocation needs no data and is a function of the weights and the global
batch size alone, so a resume fast-forwards to its step without reading anything (I4).

Shares are the weights renormalized over the sources that still have samples; when a source
of a finite job runs out, a new phase starts with the remaining sources and fresh counts.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class MixtureState:
    """Where the mixture stands before a step.

    Attributes:
        step: The next step to allocate.
        cursors: Per source, the next seq to take.
        phase: Sources active in the current phase (same shares since it began).
        phase_total: Samples taken in the current phase.
        phase_counts: Per source, samples taken in the current phase.
    """

    step: int
    cursors: tuple[int, ...]
    phase: tuple[int, ...] = ()
    phase_total: int = 0
    phase_counts: tuple[int, ...] = ()

    @classmethod
    def initial(cls, num_sources: int) -> MixtureState:
        return cls(step=0, cursors=(0,) * num_sources, phase_counts=(0,) * num_sources)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The samples one step takes: seqs [starts[k], starts[k] + counts[k]) of each source k."""

    step: int
    starts: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def end_of_data(self) -> bool:
        """True when no source has anything left: the job's data ends before this step."""
        return self.total == 0


def drift_bound(num_sources: int) -> float:
    """The largest |taken - share * total| of any source after any step (Tijdeman's bound)."""
    return 1 - 1 / (2 * num_sources - 2) if num_sources > 1 else 0.0


class Mixture:
    """Allocates each step's samples over the sources.

    Args:
        weights: Non-negative weight per source; at least one positive.
        global_batch_size: Samples per step.
        stream_ends: Per source, the seq where its stream ends (epochs * num_rows), or None for
            an endless stream.
    Raises:
        ValueError: mismatched lengths, negative or all-zero weights, batch size < 1.
    """

    def __init__(
        self,
        weights: Sequence[float],
        *,
        global_batch_size: int,
        stream_ends: Sequence[int | None],
    ) -> None:
        if len(weights) != len(stream_ends):
            raise ValueError(f"{len(weights)} weights for {len(stream_ends)} sources")
        if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.weights = tuple(float(w) for w in weights)
        self.global_batch_size = global_batch_size
        self.stream_ends = tuple(stream_ends)

    @property
    def num_sources(self) -> int:
        return len(self.weights)

    def allocate(self, state: MixtureState) -> tuple[Allocation, MixtureState]:
        """The allocation of `state.step` and the state after it.

        An allocation with total 0 means the data has ended; the state is then returned as is.
        """
        remaining = [
            math.inf if end is None else max(end - cursor, 0)
            for end, cursor in zip(self.stream_ends, state.cursors)
        ]
        active = tuple(k for k in range(self.num_sources) if self.weights[k] > 0 and remaining[k] > 0)
        if not active:
            return Allocation(state.step, state.cursors, (0,) * self.num_sources), state
        if active != state.phase:  # shares changed: a new phase with fresh counts
            state = dataclasses.replace(state, phase=active, phase_total=0, phase_counts=(0,) * self.num_sources)
        n = int(min(self.global_batch_size, sum(remaining[k] for k in active)))
        taken = self._apportion(state, active, n, remaining)
        counts = tuple(taken[k] - state.phase_counts[k] for k in range(self.num_sources))
        allocation = Allocation(state.step, state.cursors, counts)
        after = MixtureState(
            step=state.step + 1,
            cursors=tuple(c + m for c, m in zip(state.cursors, counts)),
            phase=active,
            phase_total=state.phase_total + n,
            phase_counts=tuple(taken),
        )
        return allocation, after

    def _apportion(self, state: MixtureState, active: tuple[int, ...], n: int, remaining: list[float]) -> list[int]:
        """Phase counts after a step of `n` samples (see the module docstring)."""
        total_weight = sum(self.weights[k] for k in active)
        share = {k: self.weights[k] / total_weight for k in active}
        delta = 1 / (2 * len(active) - 2) if len(active) > 1 else 0.5
        end = state.phase_total + n
        taken = list(state.phase_counts)
        cap = {k: taken[k] + remaining[k] for k in active}
        upper = {k: min(math.floor(share[k] * end + 1 - delta + 1e-9), cap[k]) for k in active}
        for k in active:  # what each source must have by the step's end
            taken[k] = min(max(taken[k], math.ceil(share[k] * end - 1 + delta - 1e-9)), cap[k])
        free = n - sum(taken[k] - state.phase_counts[k] for k in active)
        # The rest by earliest deadline: source k's next sample is due at (taken + 1 - delta) / share.
        due = [((taken[k] + 1 - delta) / share[k], k) for k in active if taken[k] < upper[k]]
        heapq.heapify(due)
        while free > 0:
            if not due:  # only when a capped source runs out: let the others exceed their bound
                due = [((taken[k] + 1 - delta) / share[k], k) for k in active if taken[k] < cap[k]]
                heapq.heapify(due)
                upper = cap
            _, k = heapq.heappop(due)
            taken[k] += 1
            free -= 1
            if taken[k] < upper[k]:
                heapq.heappush(due, ((taken[k] + 1 - delta) / share[k], k))
        while free < 0:  # never seen; keeps the batch size exact should rounding ever disagree
            k = max((k for k in active if taken[k] > state.phase_counts[k]), key=lambda k: ((taken[k] - delta) / share[k], k))
            taken[k] -= 1
            free += 1
        return taken

    def fast_forward(self, state: MixtureState, step: int) -> MixtureState:
        """The state before `step`, replaying the allocations from `state` (no data needed).

        Raises:
            ValueError: when `step` is before `state.step`.
        """
        if step < state.step:
            raise ValueError(f"cannot rewind from step {state.step} to step {step}")
        while state.step < step:
            allocation, after = self.allocate(state)
            if allocation.end_of_data:
                return dataclasses.replace(state, step=step)
            state = after
        return state
