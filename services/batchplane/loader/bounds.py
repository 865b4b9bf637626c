"""Bounds on what a loader's callers may ask of it: every field of GetSummary and FetchSamples is
checked against what the job has and what the planner has asked this replica about, so that no
well-formed but hostile request makes the loader read, hold or send more than its job plans
(defence in depth behind authorization: a caller acts only for its own index). Pure: no grpc,
no I/O; the servicer and the streams call it.

Rules (each a test in tests/unit/test_loader_bounds.py):

- FetchSamples names a constructor the job has (`FetchLimits.constructors`), a step and a release
  point >= 0, at most one step's samples (`batch.global_batch_size`), each (source, position)
  once, positions >= 0 of sources this loader serves, and `copies` in [1, constructors].
  Following steps fetched in the same call: at most `constructors.fetch_steps` steps in all,
  rising (`check_fetch_steps`, before anything of theirs is decoded), each checked as the first,
  and no (source, position) twice in the call (`check_distinct`). Anything else is INVALID_ARGUMENT: the request names what the job does not have.
  A following step is served only while the payload stays within the buffer budget and only
  when the planner has told this replica of its positions; the loader stops before the first
  that is not (a prefix, `FetchHeader.following_served`), and the constructor fetches the rest
  again later: what a call makes the loader read, hold and send stays one budget's worth.
- A fetch reads only positions the planner may have planned from this replica's group
  (`FetchFrontier`): windows the planner asked this replica about (summary requests, the follows
  of a shadow, the restore of a restarted replica) and everything before them, plus the windows
  of other replicas up to this replica's next own window (the planner asks for a source's
  windows in order, so it cannot have passed that window without asking this replica; the
  windows of another replica before it may have been asked about and adopted here, served under
  this replica's address). A position at or past that frontier is refused with UNAVAILABLE
  (`NotPlanned`), before anything is read: the loader cannot tell a position nobody planned from
  one the planner planned a moment ago and has not yet told this replica about (a shadow that
  missed a follow), so a legitimate fetch retries (from a fresh plan) and a hostile one reads
  nothing. The step itself is not bounded by the planned steps: the loader learns them only with
  the planner's next summary request, which a finite job's last steps never send; instead what
  a fetch makes the loader hold is bounded (`MAX_HELD_STEPS` steps per constructor).
- Reads a fetch makes stay within `loaders.buffer_bytes` (`plan_fetch_reads`): a window the
  fetch needs is read into the buffer one at a time and only while the buffer is under its
  budget; at or over it, the fetch reads what it needs itself, one window at a time for the
  whole loader, takes its samples and keeps nothing. So a fetch never waits for room (no
  deadlock with steps that cannot be freed before it is served) and the buffer never grows past
  its budget for a fetch by more than the window being read. A response whose payload would
  exceed `loaders.buffer_bytes` is RESOURCE_EXHAUSTED (`check_payload`).
- GetSummary (the planner's call) names a source this loader serves, positions and progress
  counters >= 0 and a cursor (`planned_seq`) no further than the position asked from (the
  planner plans only what it knows); at most MAX_ROUTES routes of at most MAX_ROUTE_REPLICAS
  distinct replicas each, starting at window 0 and increasing. `wait_ms` is cut to
  `core.rpc.MAX_WAIT_MS` by the servicer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import numpy as np

from batchplane.core.config import MAX_FETCH_STEPS, JobSettings
from batchplane.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Route, Routing, window_of, window_span

#: Routes one summary request may carry for a source (a route is added per membership change).
MAX_ROUTES = 4096
#: Replicas one route may name.
MAX_ROUTE_REPLICAS = 1024
#: Steps of one constructor whose fetches a loader keeps track of (a constructor holds a few:
#: those from its slowest rank's step to the one it builds); past it, those of the furthest
#: steps are released as if the constructor had released them (their windows may be freed, and
#: are read again if fetched again).
MAX_HELD_STEPS = 64
#: Constructor indices and copies accepted when the job's constructor count is not known.
FALLBACK_CONSTRUCTORS = 65536
#: The largest stream position or progress counter accepted (far below int64 overflow in any
#: arithmetic on it).
MAX_POSITION = 2**62


class NotPlanned(Unavailable):
    """A fetch names positions the planner cannot have planned from this replica (yet)."""


@dataclasses.dataclass(frozen=True)
class FetchLimits:
    """What the job allows a fetch: its constructors, the samples of one step and the steps of
    one call.

    Attributes:
        constructors: Constructors in the job (None: not known; FALLBACK_CONSTRUCTORS).
        max_samples: Samples one step plans, `batch.global_batch_size` (None: not known).
        max_steps: Steps one call may fetch, `constructors.fetch_steps` (the request's and its
            following ones).
    """

    constructors: int | None = None
    max_samples: int | None = None
    max_steps: int = MAX_FETCH_STEPS

    @classmethod
    def of(cls, job: JobSettings) -> FetchLimits:
        """The limits of `job`."""
        return cls(constructors=job.constructor_count, max_samples=job.batch.global_batch_size, max_steps=job.constructors.fetch_steps)


@dataclasses.dataclass(frozen=True)
class StepFetch:
    """One step's samples of a FetchSamples request, decoded.

    Attributes:
        step: The step.
        sources: int32 [n], the samples' sources.
        seqs: int64 [n], their positions.
        copies: int32 [n] or None (1 each).
    """

    step: int
    sources: np.ndarray
    seqs: np.ndarray
    copies: np.ndarray | None


def check_fetch(
    *,
    constructor: int,
    step: int,
    release_below_step: int,
    sources: np.ndarray,
    seqs: np.ndarray,
    copies: np.ndarray | None,
    served: Collection[int],
    limits: FetchLimits,
) -> None:
    """Checks a FetchSamples request against the job.

    Args:
        constructor: The request's constructor_index.
        step: Its step.
        release_below_step: Its release point.
        sources: int32 [n], the samples' sources.
        seqs: int64 [n], their positions.
        copies: int32 [n] or None (1 each).
        served: The sources this loader serves.
        limits: What the job allows.
    Raises:
        InvalidArgument: a field outside what the job has (the message names it and the value).
    """
    if len(sources) != len(seqs):
        raise InvalidArgument(f"samples.source has {len(sources)} entries but samples.seq has {len(seqs)}")
    if limits.max_samples is not None and len(seqs) > limits.max_samples:
        raise InvalidArgument(
            f"samples: at most {limits.max_samples} samples (batch.global_batch_size: what one step plans), got {len(seqs)}"
        )
    if len(seqs) and seqs.min() < 0:
        raise InvalidArgument(f"samples.seq must be >= 0, got {int(seqs.min())}")
    if len(seqs) and seqs.max() > MAX_POSITION:
        raise InvalidArgument(f"samples.seq must be <= {MAX_POSITION}, got {int(seqs.max())}")
    unknown = sorted(set(np.unique(sources).tolist()) - set(served))
    if unknown:
        raise InvalidArgument(f"this loader serves sources {sorted(served)}, not {unknown[:5]}")
    repeated = _repeated(sources, seqs)
    if repeated:
        raise InvalidArgument(f"samples name {repeated} (source, seq) pairs more than once")
    count = limits.constructors or FALLBACK_CONSTRUCTORS
    if not 0 <= constructor < count:
        raise InvalidArgument(f"constructor_index must be in [0, {count}) (the job's constructors), got {constructor}")
    if not 0 <= step <= MAX_POSITION:
        raise InvalidArgument(f"step must be in [0, {MAX_POSITION}], got {step}")
    if not 0 <= release_below_step <= MAX_POSITION:
        raise InvalidArgument(f"release_below_step must be in [0, {MAX_POSITION}], got {release_below_step}")
    if copies is not None and len(copies):
        if len(copies) != len(seqs):
            raise InvalidArgument(f"copies must hold one value per sample ({len(seqs)}), got {len(copies)} values")
        if copies.min() < 1 or copies.max() > count:
            raise InvalidArgument(f"copies must lie in [1, {count}] (the job's constructors), got {int(copies.min())}..{int(copies.max())}")


def check_fetch_steps(step: int, following: Sequence[int], *, limits: FetchLimits) -> None:
    """Checks the steps of a FetchSamples request that fetches following steps too, before
    their samples are decoded (each step's own fields are `check_fetch`'s, the samples of all
    together `check_distinct`'s): at most `limits.max_steps` steps in all, rising.

    Raises:
        InvalidArgument: the field at fault named, with its value.
    """
    if len(following) > limits.max_steps - 1:
        raise InvalidArgument(
            f"following: at most {limits.max_steps - 1} steps (constructors.fetch_steps {limits.max_steps}: steps one call fetches), "
            f"got {len(following)}"
        )
    previous = step
    for i, later in enumerate(following):
        if not previous < later <= MAX_POSITION:
            raise InvalidArgument(f"following[{i}].step must be in ({previous}, {MAX_POSITION}] (steps rising past step), got {later}")
        previous = later


def check_distinct(sources: np.ndarray, seqs: np.ndarray) -> None:
    """Checks that the steps of one FetchSamples call (every step's samples together) name no
    sample twice.

    Raises:
        InvalidArgument: how many (source, seq) pairs repeat.
    """
    repeated = _repeated(sources, seqs)
    if repeated:
        raise InvalidArgument(f"the steps of one call name {repeated} (source, seq) pairs more than once")


def _repeated(sources: np.ndarray, seqs: np.ndarray) -> int:
    """How many (source, seq) pairs repeat an earlier one."""
    if len(seqs) < 2:
        return 0
    order = np.lexsort((seqs, sources))
    return int(np.count_nonzero((np.diff(sources[order]) == 0) & (np.diff(seqs[order]) == 0)))


def check_summary(
    *,
    source: int,
    served: Collection[int],
    from_seq: int,
    planned_seq: int,
    max_samples: int,
    planned_steps: int,
    delivered_below: int,
) -> None:
    """Checks a GetSummary request's numbers.

    Raises:
        InvalidArgument: an unknown source, a negative or overflowing number, or a cursor
            (`planned_seq`) past `from_seq` (the planner plans only positions it knows).
    """
    if source not in served:
        raise InvalidArgument(f"source: this loader serves sources {sorted(served)}, not {source}")
    for name, value in (
        ("from_seq", from_seq),
        ("planned_seq", planned_seq),
        ("max_samples", max_samples),
        ("planned_steps", planned_steps),
        ("delivered_below", delivered_below),
    ):
        if not 0 <= value <= MAX_POSITION:
            raise InvalidArgument(f"{name} must be in [0, {MAX_POSITION}], got {value}")
    if planned_seq > from_seq:
        raise InvalidArgument(f"planned_seq {planned_seq} lies past from_seq {from_seq}: the planner's cursor never passes what it knows")


def routing_from(routes: Sequence[tuple[int, Sequence[str]]]) -> Routing | None:
    """The routing a request carries as (from_window, replicas) pairs; None for none.

    Raises:
        InvalidArgument: more than MAX_ROUTES routes or MAX_ROUTE_REPLICAS replicas in one, or
            routes that do not start at window 0 and increase, or repeat a replica.
    """
    if not routes:
        return None
    if len(routes) > MAX_ROUTES:
        raise InvalidArgument(f"routes: at most {MAX_ROUTES}, got {len(routes)}")
    try:
        parsed = []
        for from_window, replicas in routes:
            if len(replicas) > MAX_ROUTE_REPLICAS:
                raise InvalidArgument(f"routes: at most {MAX_ROUTE_REPLICAS} replicas a route, got {len(replicas)}")
            parsed.append(Route(from_window, tuple(replicas)))
        return Routing(tuple(parsed))
    except ValueError as exc:
        raise InvalidArgument(f"routes: {exc}") from None


def next_owned(routing: Routing | None, replica: str, first: int) -> int:
    """The first window from `first` on that `replica` reads under `routing` (every window when
    None); where the routes from some window on leave the replica out, that window."""
    if routing is None:
        return first
    routes = routing.routes
    for i, route in enumerate(routes):
        end = routes[i + 1].from_window if i + 1 < len(routes) else None
        if end is not None and end <= first:
            continue
        lo = max(first, route.from_window)
        if replica not in route.replicas:
            return lo
        k, j = len(route.replicas), route.replicas.index(replica)
        window = lo + (j - lo) % k
        if end is None or window < end:
            return window
    raise AssertionError("the last route covers every later window")  # pragma: no cover


@dataclasses.dataclass
class FetchFrontier:
    """How far a source's positions may be fetched from this replica: what the planner may have
    planned from its group, as far as this replica knows (see the module docstring).

    Args:
        order: The source's order (its windows).
        replica: The replica id whose windows this process reads.
        end_seq: Where the stream ends (None: never).
    """

    order: SampleOrder
    replica: str
    end_seq: int | None = None
    #: The first window the planner is not known to have asked anyone about.
    asked_through: int = 0

    def asked(self, seq: int) -> None:
        """The planner asked this replica (or, for a shadow, its replica) about the window of
        position `seq`: it has asked about every earlier window of the source."""
        if self.end_seq is not None and seq >= self.end_seq:
            seq = max(self.end_seq - 1, 0)
        self.asked_through = max(self.asked_through, window_of(self.order, seq).number + 1)

    def restored(self, through_seq: int) -> None:
        """The planner's restore: it has asked about every window before position `through_seq`."""
        if self.end_seq is not None and through_seq >= self.end_seq:
            self.asked(through_seq)
        elif through_seq > 0:
            self.asked_through = max(self.asked_through, window_of(self.order, through_seq - 1).number + 1)

    def frontier(self, routing: Routing | None) -> int:
        """The first position this replica does not serve under `routing`."""
        position = window_span(self.order, next_owned(routing, self.replica, self.asked_through)).start
        return position if self.end_seq is None else min(position, self.end_seq)

    def check(self, seqs: np.ndarray, *, routing: Routing | None, source: str) -> None:
        """Raises NotPlanned when a position of `seqs` lies at or past the frontier."""
        if not len(seqs):
            return
        frontier = self.frontier(routing)
        beyond = seqs[seqs >= frontier]
        if len(beyond):
            raise NotPlanned(
                f"source {source!r}: positions {beyond[:5].tolist()} lie at or past {frontier}, where nothing the planner "
                "asked this replica about reaches: not planned here (yet); nothing was read"
            )


@dataclasses.dataclass(frozen=True)
class FetchReads:
    """What a fetch that misses windows does now.

    Attributes:
        want: A window to have the reader read into the buffer (None: none).
        direct: Windows to read in the fetch itself, in order, keeping nothing (over budget).
    """

    want: int | None = None
    direct: tuple[int, ...] = ()

    @property
    def waits(self) -> bool:
        """Whether the fetch waits for the reader."""
        return not self.direct


def plan_fetch_reads(missing: Sequence[int], *, queued: Collection[int], used: int, limit: int) -> FetchReads:
    """How a fetch gets the windows it misses, within the loader's byte budget.

    Args:
        missing: The windows (numbers) holding positions the fetch needs and the buffer does not.
        queued: Windows the reader has been asked for already (it reads them whatever the budget:
            a restarted replica's restore, a window the planner waits for, another fetch's).
        used: Bytes buffered now.
        limit: `loaders.buffer_bytes`.
    Returns:
        Wait for the queued windows first; then, under the budget, have the first missing window
        read into the buffer (one at a time, so the buffer passes its budget by one window at
        most); at or over the budget, read the rest in the fetch itself (`direct`).
    """
    fresh = sorted(w for w in set(missing) if w not in queued)
    if not fresh or len(fresh) < len(set(missing)):
        return FetchReads()
    if used < limit:
        return FetchReads(want=fresh[0])
    return FetchReads(direct=tuple(fresh))


def check_payload(nbytes: int, *, samples: int, limit: int) -> None:
    """Raises ResourceExhausted when a fetch's `samples` samples take `nbytes` payload bytes,
    more than the loader's buffer budget `limit` (`loaders.buffer_bytes`)."""
    if nbytes > limit:
        raise ResourceExhausted(
            f"the {samples} samples asked for take {nbytes} bytes, more than loaders.buffer_bytes ({limit}); ask for fewer"
        )
