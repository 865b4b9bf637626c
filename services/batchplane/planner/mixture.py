"""Which samples each step takes from each source: the mixture allocator. Pure; no I/O.

Every source is a stream of samples numbered by `seq` (epoch * num_rows + position in the
epoch's shuffled order). A step takes a contiguous range of seqs from each source, so what the
job has consumed is one cursor per source, and a sample is taken at most once per pass (I1).

Targets. A `Schedule` gives every source a weight at every step position; the target shares
are the weights renormalized over the active sources (weight > 0 and samples left). With
granularity "step" the schedule is read once per step, at position s. With "microbatch" the
step's `global_batch_size` samples are cut into `microbatches` consecutive sub-steps of sizes
as equal as possible (the first ones one larger), sub-step m is read at s + m / microbatches
and apportioned like a step, and the step takes the sum: still one contiguous range per
source. `Allocation.shares` is the step's target, which the ledger compares the counts with.

Phases. A phase is a run of (sub-)steps with the same active sources and the same shares; a
new one begins exactly at the (sub-)step where either changes. Within a phase the counts follow
the chairman assignment rule (Tijdeman, 1980) on the targets o_k + p_k * T: m active sources of
shares p_k, T samples taken in the phase, o_k samples owed to source k when the phase began.
Each sub-step first gives every source the samples it must have by the sub-step's end to stay
at most B = 1 - 1/(2m - 2) below its target, then hands the remaining places (fewer than m)
out by earliest deadline (the time a source's next sample becomes due) among sources at most
B above it: O(m log m) per sub-step. Should the first part ask for more places than the
sub-step has (possible only when o != 0), the sources furthest ahead give theirs back.

Carry-over. When only the shares change (a stage boundary; every step of a curriculum), the
new phase inherits what each source is owed, o_k = target - count, so the counts track the
cumulative target (the sum of shares * samples over the sub-steps) instead of restarting the
rounding at every change: with fresh counts a curriculum would round every step the same way
and drift by up to a sample per step, and one-sample sub-steps would always go to the largest
share. When the active sources change (a source runs out, or its weight turns 0 or stops being
0), the phase starts afresh with o = 0: a source that leaves cannot settle what it is owed.

Bounds. Let d_k = cumulative target - cumulative count of source k since the active sources
last changed, after any sub-step, and B = drift_bound(m):
- In a phase that began with o = 0 (all of a static job until a source runs out, and every
  phase after the active sources change), |d_k| <= B as long as its shares hold: Tijdeman's
  bound, so the realized mixture never drifts by a whole sample, far inside the O(sqrt(T))
  drift of i.i.d. sampling. A `Static` schedule allocates exactly as the allocator did before
  schedules.
- For every schedule, d_k >= -B: a source never runs more than B ahead. (It only gets a sample
  while below floor(target + B), and these caps of all sources add up to at least the count
  due, so they never bind.)
- For every schedule, d_k <= (m - 1) * B, because the d_k sum to 0. That is all that is proven
  on the deficit side: when a phase inherits o != 0, giving back (above) can leave a source
  more than B behind. Measured: random curricula stayed within B; random stages, some one step
  long, reached 0.84 (m = 3) to 1.01 (m = 6); a search for bad schedules changing every step
  reached 0.875 (m = 3), 1.27 (m = 4) and 1.36 (m = 5). With one-sample (sub-)steps, no
  allocator that does not read the schedule ahead can promise less than 1/2 + 1/3 + ... + 1/m
  (the cup-game adversary spreads the weight over the sources not yet served), which exceeds B
  from m = 3 on.
When a source runs out inside a sub-step, the others fill its places beyond their bounds and
the next sub-step starts a fresh phase without it.

Running out. A source runs out when its cursor reaches its stream end (epochs x repeat x
rows, see `batchplane.core.config.SourceSettings.repeat`); `Allocation.exhausted` names the
sources that run out in a step, so the planner can log and count the moment. The targets then
renormalize over the others, which hides the change from the drift against them, so every
allocation also carries `configured`: the shares the schedule's weights give over all the
sources it weighs, run out or not. The drift against those shows what running out cost.

End of data. A sub-step whose schedule weighs only sources that have run out takes nothing; a
step that takes nothing ends the job's data (`Allocation.end_of_data`), even if a later stage
would weigh sources that still have samples.

Determinism. The allocation needs no data: it is a function of the schedule, the batch size
and the stream ends, and the state carries the whole phase (sources, shares, counts, what was
owed), so a resume from a saved `MixtureState`, or a fast-forward from step 0, continues
exactly as the uninterrupted job (I4).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterator, Sequence

from batchplane.core.schedule import GRANULARITIES, Schedule


@dataclasses.dataclass(frozen=True)
class MixtureState:
    """Where the mixture stands before a step; it alone determines the rest of the job.

    Attributes:
        step: The next step to allocate.
        cursors: Per source, the next seq to take.
        phase: Sources active in the current phase.
        phase_total: Samples taken in the current phase.
        phase_counts: Per source, samples taken in the current phase.
        phase_shares: Per source, its share in the current phase (0 when inactive).
        phase_offsets: Per source, the samples it was owed when the phase began (its target
            minus its count, carried over from the previous phase; 0 after a change of the
            active sources).
    """

    step: int
    cursors: tuple[int, ...]
    phase: tuple[int, ...] = ()
    phase_total: int = 0
    phase_counts: tuple[int, ...] = ()
    phase_shares: tuple[float, ...] = ()
    phase_offsets: tuple[float, ...] = ()

    @classmethod
    def initial(cls, num_sources: int) -> MixtureState:
        return cls(step=0, cursors=(0,) * num_sources, phase_counts=(0,) * num_sources)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The samples one step takes: seqs [starts[k], starts[k] + counts[k]) of each source k.

    Attributes:
        step: The step.
        starts: Per source, the first seq taken.
        counts: Per source, how many samples are taken.
        shares: Per source, its target share of the step (summing to 1 over the sources; with
            microbatch granularity the sub-steps' shares weighted by their sizes); all 0 when
            the data has ended.
        configured: Per source, its configured share of the step: the schedule's weights
            normalized over every source they weigh, including sources that have run out
            (weighted over the sub-steps as `shares`); equal to `shares` until a source runs
            out. () when unknown, e.g. for an allocation built by hand.
        exhausted: The sources whose stream ends within this step (their last sample is in it).
    """

    step: int
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    shares: tuple[float, ...] = ()
    configured: tuple[float, ...] = ()
    exhausted: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def end_of_data(self) -> bool:
        """True when the step takes nothing (no source the schedule weighs has samples left):
        the job's data ends before this step."""
        return self.total == 0


def drift_bound(num_sources: int) -> float:
    """The largest |taken - share * total| of any source after any step of a phase that began
    with no carried offset, e.g. every step of a static schedule (Tijdeman's bound)."""
    return 1 - 1 / (2 * num_sources - 2) if num_sources > 1 else 0.0


class Mixture:
    """Allocates each step's samples over the sources, following a weight schedule.

    Args:
        schedule: Per-source weights as a function of the step position.
        global_batch_size: Samples per step.
        stream_ends: Per source, the seq where its stream ends (epochs * num_rows), or None for
            an endless stream.
        granularity: "step" reads the schedule once per step; "microbatch" once per sub-step.
        microbatches: Sub-steps per step with microbatch granularity (ignored otherwise).
    Raises:
        ValueError: a schedule for another number of sources, an unknown granularity, batch
            size or microbatches < 1.
    """

    def __init__(
        self,
        schedule: Schedule,
        *,
        global_batch_size: int,
        stream_ends: Sequence[int | None],
        granularity: str = "step",
        microbatches: int = 1,
    ) -> None:
        if schedule.num_sources != len(stream_ends):
            raise ValueError(f"a schedule of {schedule.num_sources} sources for {len(stream_ends)} sources")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.schedule = schedule
        self.global_batch_size = global_batch_size
        self.stream_ends = tuple(stream_ends)
        self.granularity = granularity
        self.microbatches = microbatches if granularity == "microbatch" else 1

    @property
    def num_sources(self) -> int:
        return len(self.stream_ends)

    def describe(self) -> str:
        """A short human description for logs."""
        per = f"per microbatch ({self.microbatches} a step)" if self.granularity == "microbatch" else "per step"
        return f"{self.schedule.describe()}; read {per}"

    def allocate(self, state: MixtureState) -> tuple[Allocation, MixtureState]:
        """The allocation of `state.step` and the state after it.

        An allocation with total 0 means the data has ended; the state is then returned as is.

        Raises:
            ScheduleError: the schedule failed (a callable returned bad weights).
        """
        run, parts = state, []
        for t, size in self._substeps(state.step):
            part = self._substep(run, t, size)
            if part is not None:  # None: the schedule weighs only sources that have run out
                counts, shares, configured, run = part
                parts.append((counts, shares, configured))
        if not parts:
            zeros = (0.0,) * self.num_sources
            return Allocation(state.step, state.cursors, (0,) * self.num_sources, zeros, zeros), state
        counts, shares = _combined([(c, s) for c, s, _ in parts])
        _, configured = _combined([(c, g) for c, _, g in parts])
        after = MixtureState(
            step=state.step + 1,
            cursors=run.cursors,
            phase=run.phase,
            phase_total=run.phase_total,
            phase_counts=run.phase_counts,
            phase_shares=run.phase_shares,
            phase_offsets=run.phase_offsets,
        )
        exhausted = tuple(k for k, end in enumerate(self.stream_ends) if end is not None and state.cursors[k] < end <= after.cursors[k])
        return Allocation(state.step, state.cursors, counts, shares, configured, exhausted), after

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

    def end_step(self, state: MixtureState, *, always_active: Sequence[int] | None = None) -> int | None:
        """The step before which the data ends, counting on from `state` (from the initial state:
        the job's number of steps); None when the streams never end. No data needed.

        Args:
            always_active: The sources the schedule weighs at every step, when it weighs no
                other source at any step (a static schedule's sources of weight > 0, or an
                adaptive rule's with a minimum share > 0): every step then takes
                min(global_batch_size, samples left), so the count has a closed form. None
                replays the allocations (a schedule that changes which sources it weighs).
        """
        ends = [end for end in self.stream_ends if end is not None]
        if len(ends) < len(self.stream_ends):
            return None
        if always_active is not None:
            left = sum(max(ends[k] - state.cursors[k], 0) for k in always_active)
            return state.step + -(-left // self.global_batch_size)
        while True:
            allocation, after = self.allocate(state)
            if allocation.end_of_data:
                return state.step
            state = after

    # ---- one sub-step ----------------------------------------------------------------------

    def _substeps(self, step: int) -> Iterator[tuple[float, int]]:
        """(position, size) of the step's non-empty sub-steps, sizes as equal as possible."""
        size, extra = divmod(self.global_batch_size, self.microbatches)
        for m in range(self.microbatches):
            if size + (m < extra):
                yield step + m / self.microbatches, size + (m < extra)

    def _substep(
        self, run: MixtureState, t: float, size: int
    ) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...], MixtureState] | None:
        """Counts, target shares and configured shares of a sub-step at position `t`, and the
        state after it; None when no source with weight > 0 at `t` has samples left."""
        remaining = [math.inf if end is None else max(end - cursor, 0) for end, cursor in zip(self.stream_ends, run.cursors)]
        weights = self.schedule.weights_at(t)
        active = tuple(k for k in range(self.num_sources) if weights[k] > 0 and remaining[k] > 0)
        if not active:
            return None
        run = self._enter_phase(run, active, _shares(weights, active))
        n = int(min(size, sum(remaining[k] for k in active)))
        taken = _apportion(run, n, remaining)
        counts = tuple(taken[k] - run.phase_counts[k] for k in range(self.num_sources))
        after = MixtureState(
            step=run.step,
            cursors=tuple(c + m for c, m in zip(run.cursors, counts)),
            phase=run.phase,
            phase_total=run.phase_total + n,
            phase_counts=tuple(taken),
            phase_shares=run.phase_shares,
            phase_offsets=run.phase_offsets,
        )
        configured = _shares(weights, tuple(k for k in range(self.num_sources) if weights[k] > 0))
        return counts, run.phase_shares, configured, after

    def _enter_phase(self, run: MixtureState, active: tuple[int, ...], shares: tuple[float, ...]) -> MixtureState:
        """`run`, in a new phase when the active sources or their shares changed."""
        if active == run.phase and shares == run.phase_shares:
            return run
        zeros = (0,) * self.num_sources
        if active != run.phase or not run.phase_shares:  # fresh counts, nothing carried over
            offsets = (0.0,) * self.num_sources
        else:
            offsets = _owed(run)
        return dataclasses.replace(run, phase=active, phase_total=0, phase_counts=zeros, phase_shares=shares, phase_offsets=offsets)


def _combined(parts: list[tuple[tuple[int, ...], tuple[float, ...]]]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A step's counts and shares from its sub-steps' (counts, shares): the counts add up, the
    shares are weighted by the sub-steps' sizes."""
    if len(parts) == 1:
        return parts[0]
    counts = tuple(sum(column) for column in zip(*(c for c, _ in parts)))
    if all(shares == parts[0][1] for _, shares in parts):
        return counts, parts[0][1]
    total = sum(counts)
    weighted = [[share * sum(c) for share in shares] for c, shares in parts]
    return counts, tuple(sum(column) / total for column in zip(*weighted))


def _shares(weights: Sequence[float], active: tuple[int, ...]) -> tuple[float, ...]:
    """The weights renormalized over the active sources; 0 for the others."""
    total_weight = sum(weights[k] for k in active)
    shares = [0.0] * len(weights)
    for k in active:
        shares[k] = weights[k] / total_weight
    return tuple(shares)


def _offsets(run: MixtureState) -> tuple[float, ...]:
    return run.phase_offsets or (0.0,) * len(run.cursors)


def _owed(run: MixtureState) -> tuple[float, ...]:
    """Per active source, target minus count at the end of the phase (summing to 0)."""
    offsets = _offsets(run)
    owed = {k: offsets[k] + run.phase_shares[k] * run.phase_total - run.phase_counts[k] for k in run.phase}
    mean = sum(owed.values()) / len(owed)  # 0 but for rounding; keeps it from creeping
    return tuple(owed[k] - mean if k in owed else 0.0 for k in range(len(run.cursors)))


def _apportion(run: MixtureState, n: int, remaining: list[float]) -> list[int]:
    """Phase counts after a sub-step of `n` samples (see the module docstring)."""
    active, share, offset = run.phase, run.phase_shares, _offsets(run)
    delta = 1 / (2 * len(active) - 2) if len(active) > 1 else 0.5
    end = run.phase_total + n
    taken = list(run.phase_counts)
    target = {k: offset[k] + share[k] * end for k in active}
    cap = {k: taken[k] + remaining[k] for k in active}
    upper = {k: min(math.floor(target[k] + 1 - delta + 1e-9), cap[k]) for k in active}
    for k in active:  # what each source must have by the sub-step's end (cap[k] is inf for an endless source)
        taken[k] = int(min(max(taken[k], math.ceil(target[k] - 1 + delta - 1e-9)), cap[k]))
    free = n - sum(taken[k] - run.phase_counts[k] for k in active)
    # The rest by earliest deadline: source k's next sample is due at (taken + 1 - delta - offset) / share.
    due = [((taken[k] + 1 - delta - offset[k]) / share[k], k) for k in active if taken[k] < upper[k]]
    heapq.heapify(due)
    while free > 0:
        if not due:  # only when a capped source runs out: let the others exceed their bound
            due = [((taken[k] + 1 - delta - offset[k]) / share[k], k) for k in active if taken[k] < cap[k]]
            heapq.heapify(due)
            upper = cap
        _, k = heapq.heappop(due)
        taken[k] += 1
        free -= 1
        if taken[k] < upper[k]:
            heapq.heappush(due, ((taken[k] + 1 - delta - offset[k]) / share[k], k))
    if free < 0:  # the lower bounds ask for too much (only after a change of shares)
        _give_back(taken, run.phase_counts, target, -free)
    return taken


def _give_back(taken: list[int], before: tuple[int, ...], target: dict[int, float], excess: int) -> None:
    """Takes `excess` samples back, each from the source furthest ahead of its target."""
    ahead = [(target[k] - taken[k], k) for k in target if taken[k] > before[k]]
    heapq.heapify(ahead)
    for _ in range(excess):
        _, k = heapq.heappop(ahead)
        taken[k] -= 1
        if taken[k] > before[k]:
            heapq.heappush(ahead, (target[k] - taken[k], k))
