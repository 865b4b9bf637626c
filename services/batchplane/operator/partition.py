"""Source auto-partitioning (MegaScale-Data §5.1, OVERLORD §5.1): from per-source profiles and
pod limits to loader groups, actors (loader replicas) per group and workers per actor.

Pure: no I/O, no grpc, no pyarrow. `partition` is a deterministic function of its arguments:
sources are sorted by name first, so the order of the input does not matter, and every sum and
tie is taken in that order.

The model (units in brackets):

    c_s      loader work per sample of source s [worker-seconds]: its decode plus transform
             time per sample from `batchplane profile`; a worker is one CPU core
    M_s      memory of s's file-access state [bytes]: open Parquet files, footers, metadata
    w_s      s's mixture weight, normalized over the sources (its share of the samples)
    d_s      w_s · c_s: its demand [worker-seconds per mixed sample]
    group    sources served together by one loader Deployment; each of its actors (pods) holds
             the file-access state of all of them and its workers serve a data-parallel shard
             of each, so every source of a group gets exactly the group's actors
    unit     the demand one worker covers [worker-seconds per mixed sample]; 1 / unit is the
             rate of mixed samples per second the partition is sized for
    need     of group g: T_g = max(1, ⌈Σ_{s∈g} d_s / unit⌉) workers (its workers are pooled)
    memory   of one actor of group g with k workers [bytes]:
             actor_base + buffer + k · (worker_base + Σ_{s∈g} M_s)      (state_per="worker")
             actor_base + buffer + Σ_{s∈g} M_s + k · worker_base        (state_per="actor")
             which must fit the pod's usable memory, pod memory · (1 - memory_headroom)
    W        workers per actor at most: min(--max-workers-per-actor, ⌊pod CPUs⌋)
    A        actors per source at most (--max-actors-per-source), so a group's actors <= A
    w_src    workers per source at most: A · W

The paper's three steps, as done here:

1. Source clustering. Sources are sorted by demand d_s and cut into at most `cost_levels`
   clusters ("cost levels") by optimal one-dimensional k-means on log d_s (exact dynamic
   programming, so deterministic). The paper clusters on transformation cost; the mixture
   weight is folded in (the required throughput share), since a rare expensive source needs
   few workers. Deviation: adjacent clusters whose geometric-mean demands differ by less than
   `LEVEL_RATIO` are merged again, so near-equal costs are not split into groups that would
   need pods of their own. Sources of weight 0 (d_s = 0) join the cheapest level.
2. Resource levels. With `samples_per_s` (a target rate of mixed samples per second), unit =
   1 / samples_per_s, so a group's need is the cores its sources take at that rate. Without
   it, following the paper, unit is the mean demand of the cheapest level, so its sources get
   about one worker each and costlier levels get workers in proportion to their cost ratio.
   Deviation: unit is raised where needed so that no single source needs more workers than
   A actors of as many workers as fit a pod (at most w_src); all sources then keep workers in
   proportion to their demand (the mixture stays balanced) instead of the costliest being
   clamped, and `Partition.samples_per_s` says what rate that is. Deviation: workers are pooled
   per group (T_g rounds the group's sum up, not each source's share), since a worker of a
   group serves all of its sources. Within each level, sources are packed into groups
   greedily in (demand, name) order, as OVERLORD's source grouping does, bounded by memory: a
   source joins the open group only when the group stays feasible (one actor with one worker
   fits a pod, and its need fits in A actors of as many workers as fit a pod, at most W) and
   the merged group needs no more pods than the two apart (so sharing never costs capacity).
   `one_source_per_group` keeps MegaScale-Data's default of one source per group.
3. Configuration. Each group's T_g workers are spread over actors: workers per actor at most
   min(W, what fits the pod's memory); actors = ⌈T_g / that⌉, so where memory is short the
   actor count rises as workers per actor fall, up to A; then ⌈T_g / actors⌉ workers per actor
   (even spread). A single-source group whose need does not fit in A actors is capped there,
   with a warning; `Partition.samples_per_s` is then below the target.

Constraints guaranteed (and tested as properties): every actor's memory fits the pod's usable
memory; every source is in exactly one group; every group has 1 to A actors (a source's minimum
is one actor holding its state: its state is never split across actors, and a source whose
state alone does not fit a pod is an error naming it and the numbers); 1 to W workers per actor;
the same profiles in any order give the same partition.

Output (`to_dataplane`, `to_values`): one `sourceGroups` entry per group, named
"level<L>-<k>", with its sources, minReplicas = the actors sized here, maxReplicas = A (room
for the operator's mixture-driven scaling), workersPerActor, and per-pod resources: requests of
one CPU per worker and the actor's memory estimate, limits of those CPUs and the pod's memory.
Each source carries costSecondsPerSample, the c_s the operator's scaling policy uses. The job's
source order becomes the groups' order, then each group's sources' order (by name).

Further deviations: OVERLORD's step 1 shards an outlier source's files into several sources
when its state exceeds a pod; here that is an error (split it in the job's configuration). The
resources of the planner and constructors are not subtracted: the pod limits given are the
loaders'. The orchestration overhead T of the paper's (P, T, M) is not modelled.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchplane.core.errors import BatchplaneError, ConfigError

MiB = 1 << 20
GiB = 1 << 30
#: Adjacent cost levels closer than this factor (in geometric-mean demand) are merged.
LEVEL_RATIO = 2.0
#: The values of `PartitionSettings.state_per`.
STATE_PER = ("worker", "actor")
#: apiVersion and kind of the DataPlane custom resource.
API_VERSION = "batchplane.dev/v1alpha1"
KIND = "DataPlane"
#: Float slack of the ceilings: a need of 3.0000000001 workers is 3.
_EPS = 1e-9
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?([A-Za-z]*)")
_MEMORY_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
}


class PartitionError(BatchplaneError):
    """The sources cannot be partitioned under the limits given (e.g. a source whose state
    alone does not fit a pod); the message names the source and the numbers."""


@dataclasses.dataclass(frozen=True)
class SourceProfile:
    """What the partitioner needs of one source's profile."""

    #: The source's name in the job.
    name: str
    #: Its path as the job configures it (written into the DataPlane spec).
    path: str
    #: Memory of its file-access state, in bytes.
    state_bytes: int
    #: Loader work per sample (decode and transform), in worker-seconds.
    cost_s: float
    #: Its mixture weight (relative; normalized over the sources).
    weight: float = 1.0
    #: How the job reads it, carried into the output: its token column, transform import
    #: path (None: the default), the transform's keyword arguments and the columns read.
    token_column: str = "input_ids"
    transform: str | None = None
    transform_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    columns: tuple[str, ...] | None = None
    #: Passes over the source per job epoch (the job's `repeat`, an integer >= 1), carried into
    #: the output. It does not change the source's demand: its weight sets its share of samples.
    repeat: int = 1


@dataclasses.dataclass(frozen=True)
class ProfileSet:
    """A `batchplane profile` document: the job's name, its sources' profiles and the job
    settings a DataPlane carries besides its groups."""

    job: str
    sources: tuple[SourceProfile, ...]
    #: The job's mixture as in its configuration file ({"weights": ..., "schedule": ...}).
    mixture: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: The job's mesh, {"dp", "cp", "tp", "pp"}; None: unknown.
    mesh: Mapping[str, int] | None = None
    #: The job's batch shape, {"global_batch_size", "microbatches"}; None: unknown.
    batch: Mapping[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class PartitionSettings:
    """Pod limits and bounds of a partition."""

    #: Memory of one loader pod, in bytes.
    pod_memory_bytes: int
    #: CPU cores of one loader pod; one worker takes one core.
    pod_cpus: float
    #: W: workers per actor at most; None: ⌊pod_cpus⌋ (never more).
    max_workers_per_actor: int | None = None
    #: A: actors (loader replicas) per source at most.
    max_actors_per_source: int = 8
    #: Cost levels (clusters of step 1) at most.
    cost_levels: int = 4
    #: Target rate of mixed samples per second the loaders must sustain; None: workers
    #: relative to the cheapest level (the paper's resource levels).
    samples_per_s: float | None = None
    #: Memory of a loader process before any source is opened, in bytes.
    actor_base_bytes: int = 256 * MiB
    #: Memory of a loader's read-ahead buffer (the job's loaders.buffer_bytes), in bytes.
    buffer_bytes: int = 512 * MiB
    #: Memory of one worker besides file-access state (decode scratch), in bytes.
    worker_base_bytes: int = 64 * MiB
    #: Fraction of the pod's memory kept free for error in these estimates (0.1: plan to 90 %).
    memory_headroom: float = 0.1
    #: Who holds a copy of the group's file-access state: every "worker" (worker processes, as
    #: in the paper) or the "actor" once (workers sharing it).
    state_per: str = "worker"
    #: One source per group (MegaScale-Data's default) instead of packing a level's sources.
    one_source_per_group: bool = False

    def __post_init__(self) -> None:
        _at_least("pod_memory_bytes", self.pod_memory_bytes, 1, integer=True)
        if not (isinstance(self.pod_cpus, (int, float)) and math.isfinite(self.pod_cpus) and self.pod_cpus >= 1):
            raise ConfigError("pod_cpus", "must be a finite number >= 1 (one worker takes one core)", self.pod_cpus)
        if self.max_workers_per_actor is not None:
            _at_least("max_workers_per_actor", self.max_workers_per_actor, 1, integer=True)
        _at_least("max_actors_per_source", self.max_actors_per_source, 1, integer=True)
        _at_least("cost_levels", self.cost_levels, 1, integer=True)
        if self.samples_per_s is not None and not (math.isfinite(self.samples_per_s) and self.samples_per_s > 0):
            raise ConfigError("samples_per_s", "must be a finite number > 0", self.samples_per_s)
        for name in ("actor_base_bytes", "buffer_bytes", "worker_base_bytes"):
            _at_least(name, getattr(self, name), 0, integer=True)
        if not (isinstance(self.memory_headroom, (int, float)) and 0 <= self.memory_headroom < 1):
            raise ConfigError("memory_headroom", "must be a number in [0, 1)", self.memory_headroom)
        if self.state_per not in STATE_PER:
            raise ConfigError("state_per", f"must be one of {STATE_PER}", self.state_per)

    @property
    def usable_memory_bytes(self) -> int:
        """The pod memory an actor may plan to use: pod memory · (1 - memory_headroom)."""
        return int(self.pod_memory_bytes * (1 - self.memory_headroom))

    @property
    def workers_per_actor_limit(self) -> int:
        """W: min(max_workers_per_actor, ⌊pod_cpus⌋)."""
        cores = int(math.floor(self.pod_cpus + _EPS))
        return min(self.max_workers_per_actor or cores, cores)

    @property
    def workers_per_source_limit(self) -> int:
        """w_src: A · W."""
        return self.max_actors_per_source * self.workers_per_actor_limit


@dataclasses.dataclass(frozen=True)
class LoaderGroup:
    """One loader group: a Deployment of `actors` identical loader pods."""

    #: "level<L>-<k>": the k-th group of cost level L (0 is the cheapest).
    name: str
    #: Its cost level.
    level: int
    #: Its sources, sorted by name.
    sources: tuple[SourceProfile, ...]
    #: T_g: workers its sources need (it gets fewer only when `capped`).
    workers_needed: int
    #: Actors (loader pods).
    actors: int
    #: Workers in each actor.
    workers_per_actor: int
    #: Memory one actor needs, in bytes (<= the pod's usable memory).
    memory_bytes: int
    #: Its need did not fit in A actors: it has actors · workers_per_actor < workers_needed.
    capped: bool = False

    @property
    def state_bytes(self) -> int:
        """Σ M_s of its sources."""
        return sum(s.state_bytes for s in self.sources)

    @property
    def workers(self) -> int:
        """Workers it gets: actors · workers per actor."""
        return self.actors * self.workers_per_actor


@dataclasses.dataclass(frozen=True)
class Level:
    """One cost level of step 1."""

    index: int
    #: Its sources' names, by demand then name.
    sources: tuple[str, ...]
    #: Smallest and largest demand d_s of its sources, in worker-seconds per mixed sample.
    demand_range: tuple[float, float]
    #: Smallest and largest worker need of one of its sources alone, ⌈d_s / unit⌉ (at least 1).
    workers_range: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Partition:
    """What `partition` returns."""

    groups: tuple[LoaderGroup, ...]
    levels: tuple[Level, ...]
    #: The demand one worker covers, in worker-seconds per mixed sample (see step 2).
    unit: float
    #: Normalized mixture weight per source name.
    shares: Mapping[str, float]
    #: Demand d_s per source name, in worker-seconds per mixed sample.
    demand: Mapping[str, float]
    #: Human-readable notes on groups that got less than they need.
    warnings: tuple[str, ...]
    settings: PartitionSettings

    @property
    def actors(self) -> int:
        return sum(g.actors for g in self.groups)

    @property
    def workers(self) -> int:
        return sum(g.workers for g in self.groups)

    @property
    def samples_per_s(self) -> float:
        """Mixed samples per second the groups sustain: the least, over groups with demand,
        of workers / Σ d_s (inf when no source has demand)."""
        rates = [g.workers / total for g in self.groups if (total := sum(self.demand[s.name] for s in g.sources)) > 0]
        return min(rates) if rates else math.inf


# ---- the algorithm ----------------------------------------------------------------------------


def partition(
    profiles: Sequence[SourceProfile],
    settings: PartitionSettings,
    *,
    weights: Mapping[str, float] | None = None,
) -> Partition:
    """Partitions sources into loader groups (see the module docstring).

    Args:
        profiles: One profile per source; names must be unique.
        settings: Pod limits and bounds.
        weights: Mixture weight per source name, replacing the profiles' weights; a source it
            does not name gets weight 1 (as in a job's mixture.weights).

    Returns:
        The groups, sorted by level then name, with their sources sorted by name.
    Raises:
        ConfigError: no sources, a repeated name, bad numbers, weights naming an unknown source.
        PartitionError: a source whose file-access state alone does not fit a pod.
    """
    sources = _checked(profiles, weights)
    total = sum(s.weight for s in sources)
    shares = {s.name: (s.weight / total if total > 0 else 1.0 / len(sources)) for s in sources}
    demand = {s.name: shares[s.name] * s.cost_s for s in sources}
    _check_memory(sources, settings)

    # Step 1: cost levels.
    ordered = sorted(sources, key=lambda s: (demand[s.name], s.name))
    level_members = _levels(ordered, demand, settings.cost_levels)

    # Step 2: the unit of demand one worker covers, and groups within each level.
    if settings.samples_per_s is not None:
        unit = 1.0 / settings.samples_per_s
    else:
        cheapest = [demand[s.name] for s in level_members[0] if demand[s.name] > 0]
        most = [demand[s.name] / (settings.max_actors_per_source * _workers_fitting([s], settings)) for s in sources]
        unit = max(sum(cheapest) / len(cheapest) if cheapest else 1.0, *most)
    levels, groups, warnings = [], [], []
    for index, members in enumerate(level_members):
        alone = [max(_ceil(demand[s.name] / unit), 1) for s in members]
        levels.append(
            Level(
                index=index,
                sources=tuple(s.name for s in members),
                demand_range=(demand[members[0].name], demand[members[-1].name]),
                workers_range=(min(alone), max(alone)),
            )
        )
        for k, members_of_group in enumerate(_pack(members, demand, unit, settings)):
            # Step 3: actors and workers per actor.
            group = _configure(f"level{index}-{k}", index, members_of_group, demand, unit, settings)
            if group.capped:
                warnings.append(
                    f"group {group.name!r} ({', '.join(s.name for s in group.sources)}) needs "
                    f"{group.workers_needed} workers but gets {group.workers}: {group.actors} actors "
                    f"(--max-actors-per-source) of {group.workers_per_actor} workers (what fits "
                    f"{_human(settings.usable_memory_bytes)} with {_human(group.state_bytes)} of state)"
                )
            groups.append(group)
    return Partition(
        groups=tuple(groups),
        levels=tuple(levels),
        unit=unit,
        shares=shares,
        demand=demand,
        warnings=tuple(warnings),
        settings=settings,
    )


def _checked(profiles: Sequence[SourceProfile], weights: Mapping[str, float] | None) -> list[SourceProfile]:
    """The profiles sorted by name, with `weights` applied; ConfigError on bad input."""
    if not profiles:
        raise ConfigError("sources", "must list at least one source profile", [])
    by_name: dict[str, SourceProfile] = {}
    for p in profiles:
        if p.name in by_name:
            raise ConfigError(f"sources.{p.name}", "is profiled twice", p.name)
        _at_least(f"sources.{p.name}.state_bytes", p.state_bytes, 0, integer=True)
        if not (math.isfinite(p.cost_s) and p.cost_s >= 0):
            raise ConfigError(f"sources.{p.name}.cost_s", "must be a finite number >= 0", p.cost_s)
        by_name[p.name] = p
    if weights is not None:
        for name, w in weights.items():
            if name not in by_name:
                raise ConfigError(f"weights.{name}", f"names no profiled source; sources are {', '.join(sorted(by_name))}", w)
        by_name = {n: dataclasses.replace(p, weight=float(weights.get(n, 1.0))) for n, p in by_name.items()}
    for p in by_name.values():
        if not (math.isfinite(p.weight) and p.weight >= 0):
            raise ConfigError(f"weights.{p.name}", "must be a finite number >= 0", p.weight)
    return [by_name[n] for n in sorted(by_name)]


def _check_memory(sources: list[SourceProfile], settings: PartitionSettings) -> None:
    """PartitionError when one actor with one worker cannot hold a source (or none) in a pod."""
    usable = settings.usable_memory_bytes
    pod = (
        f"the pod's usable memory {_human(usable)} ({usable} bytes: {settings.pod_memory_bytes} bytes "
        f"less {settings.memory_headroom:.0%} headroom)"
    )
    overheads = (
        f"{_human(settings.actor_base_bytes)} process + {_human(settings.buffer_bytes)} buffer + "
        f"{_human(settings.worker_base_bytes)} per worker"
    )
    empty = _actor_memory(0, 1, settings)
    if empty > usable:
        raise PartitionError(f"one loader with one worker and no source needs {_human(empty)} ({overheads}), more than {pod}")
    for source in sources:
        need = _actor_memory(source.state_bytes, 1, settings)
        if need > usable:
            raise PartitionError(
                f"source {source.name!r}: its file-access state ({_human(source.state_bytes)}, {source.state_bytes} "
                f"bytes) with one actor's overheads ({overheads}) needs {_human(need)} ({need} bytes) for one "
                f"actor with one worker, more than {pod}; raise --pod-memory, or split the source's files "
                f"into several sources"
            )


def _levels(ordered: list[SourceProfile], demand: Mapping[str, float], k: int) -> list[list[SourceProfile]]:
    """Step 1: `ordered` (by demand, then name) cut into cost levels, cheapest first."""
    positive = [s for s in ordered if demand[s.name] > 0]
    zero = [s for s in ordered if demand[s.name] <= 0]
    if not positive:
        return [zero]
    logs = np.log([demand[s.name] for s in positive])
    starts = _kmeans_1d(logs, min(k, len(np.unique(logs))))
    clusters = [positive[a:b] for a, b in zip(starts, [*starts[1:], len(positive)])]
    merged = [clusters[0]]
    for cluster in clusters[1:]:
        if _geomean(cluster, demand) < LEVEL_RATIO * _geomean(merged[-1], demand):
            merged[-1] = merged[-1] + cluster
        else:
            merged.append(cluster)
    merged[0] = zero + merged[0]
    return merged


def _kmeans_1d(x: np.ndarray, k: int) -> list[int]:
    """Start indices of the k contiguous clusters of sorted `x` with the least sum of squared
    deviations from their means (exact dynamic programming; ties go to the earliest cut)."""
    n = len(x)
    s1 = np.concatenate([[0.0], np.cumsum(x)])
    s2 = np.concatenate([[0.0], np.cumsum(x * x)])
    # cost[c][j]: best cost of x[:j] in c clusters; cut[c][j]: start of the last of them.
    cost = np.full((k + 1, n + 1), np.inf)
    cut = np.zeros((k + 1, n + 1), dtype=np.int64)
    cost[0][0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, n + 1):
            i = np.arange(c - 1, j)
            m = j - i
            total = s1[j] - s1[i]
            sse = np.maximum((s2[j] - s2[i]) - total * total / m, 0.0)
            candidates = cost[c - 1][i] + sse
            best = int(np.argmin(candidates))
            cost[c][j] = candidates[best]
            cut[c][j] = i[best]
    starts, j = [], n
    for c in range(k, 0, -1):
        starts.append(int(cut[c][j]))
        j = starts[-1]
    return starts[::-1]


def _geomean(cluster: list[SourceProfile], demand: Mapping[str, float]) -> float:
    return math.exp(sum(math.log(demand[s.name]) for s in cluster) / len(cluster))


def _pack(members: list[SourceProfile], demand: Mapping[str, float], unit: float, settings: PartitionSettings) -> list[list[SourceProfile]]:
    """Step 2's grouping of one level's sources (in their order), greedy under memory."""
    if settings.one_source_per_group:
        return [[s] for s in members]
    groups: list[list[SourceProfile]] = []
    for s in members:
        if groups:
            merged = [*groups[-1], s]
            apart = _pods(groups[-1], demand, unit, settings) + _pods([s], demand, unit, settings)
            if _feasible(merged, demand, unit, settings) and _pods(merged, demand, unit, settings) <= apart:
                groups[-1] = merged
                continue
        groups.append([s])
    return groups


def _need(group: Sequence[SourceProfile], demand: Mapping[str, float], unit: float) -> int:
    """T_g: workers the group's pooled demand takes, at least 1."""
    return max(_ceil(sum(demand[s.name] for s in group) / unit), 1)


def _feasible(group: list[SourceProfile], demand: Mapping[str, float], unit: float, settings: PartitionSettings) -> bool:
    """One actor with one worker fits a pod and the group's need fits in A actors."""
    per_actor = _workers_fitting(group, settings)
    return per_actor >= 1 and math.ceil(_need(group, demand, unit) / per_actor) <= settings.max_actors_per_source


def _pods(group: list[SourceProfile], demand: Mapping[str, float], unit: float, settings: PartitionSettings) -> int:
    per_actor = max(_workers_fitting(group, settings), 1)
    return min(math.ceil(_need(group, demand, unit) / per_actor), settings.max_actors_per_source)


def _workers_fitting(group: Sequence[SourceProfile], settings: PartitionSettings) -> int:
    """Most workers one actor of `group` may have: <= W, and its memory fits the pod."""
    state = sum(s.state_bytes for s in group)
    fixed = _actor_memory(state, 0, settings)
    per_worker = _actor_memory(state, 1, settings) - fixed
    room = settings.usable_memory_bytes - fixed
    if room < per_worker:
        return 0
    by_memory = room // per_worker if per_worker > 0 else settings.workers_per_actor_limit
    return int(min(by_memory, settings.workers_per_actor_limit))


def _actor_memory(state_bytes: int, workers: int, settings: PartitionSettings) -> int:
    """Bytes one actor with `workers` workers holding `state_bytes` of state needs."""
    fixed = settings.actor_base_bytes + settings.buffer_bytes
    if settings.state_per == "worker":
        return fixed + workers * (settings.worker_base_bytes + state_bytes)
    return fixed + state_bytes + workers * settings.worker_base_bytes


def _configure(
    name: str, level: int, members: list[SourceProfile], demand: Mapping[str, float], unit: float, settings: PartitionSettings
) -> LoaderGroup:
    """Step 3: actors and workers per actor of one group."""
    workers = _need(members, demand, unit)
    per_actor = _workers_fitting(members, settings)  # >= 1: each source fits alone, packing keeps it so
    actors = math.ceil(workers / per_actor)
    capped = actors > settings.max_actors_per_source
    if capped:
        actors = settings.max_actors_per_source
    else:
        per_actor = math.ceil(workers / actors)
    sources = tuple(sorted(members, key=lambda s: s.name))
    return LoaderGroup(
        name=name,
        level=level,
        sources=sources,
        workers_needed=workers,
        actors=actors,
        workers_per_actor=per_actor,
        memory_bytes=_actor_memory(sum(s.state_bytes for s in sources), per_actor, settings),
        capped=capped,
    )


# ---- input and output -------------------------------------------------------------------------


def profiles_from_mapping(data: Any) -> ProfileSet:
    """The profiles in a parsed `batchplane profile` document.

    A source's cost is its `transform_s_per_sample` plus its `read_s_per_sample` (0 when
    absent); its weight is `weight` (1 when absent); its `repeat` is 1 when absent.

    Raises:
        ConfigError: a missing or bad field, named by its path (e.g. "sources[2].state_bytes").
    """
    if not isinstance(data, Mapping):
        raise ConfigError("(top level)", "must be a mapping with 'job' and 'sources'", type(data).__name__)
    items = data.get("sources")
    if not isinstance(items, list) or not items:
        raise ConfigError("sources", "must be a non-empty list of source profiles", items)
    out = []
    for i, item in enumerate(items):
        field = f"sources[{i}]"
        if not isinstance(item, Mapping):
            raise ConfigError(field, "must be a mapping", item)
        text: dict[str, str] = {}
        for key, default in (("name", None), ("path", ""), ("token_column", "input_ids")):
            value = item.get(key, default)
            if not isinstance(value, str) or (key == "name" and not value):
                raise ConfigError(f"{field}.{key}", "must be a non-empty string" if key == "name" else "must be a string", value)
            text[key] = value
        state = item.get("state_bytes")
        if isinstance(state, bool) or not isinstance(state, int) or state < 0:
            raise ConfigError(f"{field}.state_bytes", "must be an integer >= 0", state)
        numbers: dict[str, float] = {}
        for key, default_number in (("transform_s_per_sample", None), ("read_s_per_sample", 0.0), ("weight", 1.0)):
            number = item.get(key, default_number)
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number < 0:
                raise ConfigError(f"{field}.{key}", "must be a finite number >= 0", number)
            numbers[key] = float(number)
        transform, args, columns = item.get("transform"), item.get("transform_args") or {}, item.get("columns")
        if transform is not None and not isinstance(transform, str):
            raise ConfigError(f"{field}.transform", "must be an import path 'module:callable' or null", transform)
        if not isinstance(args, Mapping):
            raise ConfigError(f"{field}.transform_args", "must be a mapping", args)
        if columns is not None and not (isinstance(columns, list) and all(isinstance(c, str) for c in columns)):
            raise ConfigError(f"{field}.columns", "must be a list of column names or null", columns)
        repeat = item.get("repeat", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise ConfigError(f"{field}.repeat", "must be an integer >= 1", repeat)
        out.append(
            SourceProfile(
                name=text["name"],
                path=text["path"],
                state_bytes=state,
                cost_s=numbers["transform_s_per_sample"] + numbers["read_s_per_sample"],
                weight=numbers["weight"],
                token_column=text["token_column"],
                transform=transform,
                transform_args=dict(args),
                columns=None if columns is None else tuple(columns),
                repeat=repeat,
            )
        )
    job = data.get("job")
    mixture, mesh, batch = data.get("mixture") or {}, data.get("mesh"), data.get("batch")
    if not isinstance(mixture, Mapping):
        raise ConfigError("mixture", "must be a mapping (the job's mixture)", mixture)
    for key, value, names in (("mesh", mesh, ("dp", "cp", "tp", "pp")), ("batch", batch, ("global_batch_size", "microbatches"))):
        if value is not None and not (isinstance(value, Mapping) and all(isinstance(value.get(n), int) and value[n] >= 1 for n in names)):
            raise ConfigError(key, f"must be a mapping of {', '.join(names)} (integers >= 1) or absent", value)
    return ProfileSet(
        job=job if isinstance(job, str) and job else "batchplane",
        sources=tuple(out),
        mixture=dict(mixture),
        mesh=None if mesh is None else {n: mesh[n] for n in ("dp", "cp", "tp", "pp")},
        batch=None if batch is None else {n: batch[n] for n in ("global_batch_size", "microbatches")},
    )


def source_groups(result: Partition, *, job_fields: bool = False) -> list[dict[str, Any]]:
    """The groups as `sourceGroups` entries: name; sources (name, path, tokenColumn, transform
    and repeat where not the defaults, profiled cost per sample in worker-seconds, and with
    `job_fields` transformArgs and columns, which the chart's values carry into job.yaml but a
    DataPlane does not); minReplicas, the actors sized here; maxReplicas, A, for the operator
    to scale up to; workers per actor; per-pod resources (requests: what an actor needs;
    limits: the pod)."""
    settings = result.settings
    out = []
    for g in result.groups:
        cpu = str(g.workers_per_actor)
        sources = []
        for s in g.sources:
            entry: dict[str, Any] = {"name": s.name, "path": s.path}
            if s.token_column != "input_ids":
                entry["tokenColumn"] = s.token_column
            if s.transform is not None:
                entry["transform"] = s.transform
            if s.repeat != 1:
                entry["repeat"] = s.repeat
            if job_fields and s.transform_args:
                entry["transformArgs"] = dict(s.transform_args)
            if job_fields and s.columns is not None:
                entry["columns"] = list(s.columns)
            entry["costSecondsPerSample"] = float(f"{s.cost_s:.6g}")
            sources.append(entry)
        out.append(
            {
                "name": g.name,
                "sources": sources,
                "minReplicas": g.actors,
                "maxReplicas": settings.max_actors_per_source,
                "workersPerActor": g.workers_per_actor,
                "resources": {
                    "requests": {"cpu": cpu, "memory": format_memory(g.memory_bytes, at_most=settings.pod_memory_bytes)},
                    "limits": {"cpu": cpu, "memory": format_memory(settings.pod_memory_bytes, at_most=settings.pod_memory_bytes)},
                },
            }
        )
    return out


def to_dataplane(result: Partition, *, name: str, profiles: ProfileSet | None = None) -> dict[str, Any]:
    """A DataPlane custom resource: its spec holds the source groups, the mixture (the weights
    partitioned for, and the job's schedule if any) and, when `profiles` knows them, the job's
    mesh and batch shape (without them the resource is a fragment to complete)."""
    mixture: dict[str, Any] = {"weights": {s.name: s.weight for g in result.groups for s in g.sources}}
    spec: dict[str, Any] = {"sourceGroups": source_groups(result), "mixture": mixture}
    if profiles is not None:
        if profiles.mixture.get("schedule") is not None:
            mixture["schedule"] = profiles.mixture["schedule"]
        if profiles.mesh is not None:
            spec["mesh"] = dict(profiles.mesh)
        if profiles.batch is not None:
            spec["batch"] = {"globalBatchSize": profiles.batch["global_batch_size"], "microbatches": profiles.batch["microbatches"]}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": dns_label(name)}, "spec": spec}


def to_values(result: Partition) -> dict[str, Any]:
    """Values of the Helm chart (deploy/helm/batchplane): its top-level `sourceGroups`, whose
    sources the chart also writes into the job's job.yaml, in group order."""
    return {"sourceGroups": source_groups(result, job_fields=True)}


def describe(result: Partition) -> str:
    """A table of the groups, levels, totals and warnings, for people."""
    s = result.settings
    basis = (
        f"sized for {s.samples_per_s:g} mixed samples/s"
        if s.samples_per_s is not None
        else "sized relative to the cheapest level (--samples-per-s sizes for a rate)"
    )
    sustained = result.samples_per_s
    lines = [
        f"{len(result.groups)} loader groups, {result.actors} actors, {result.workers} workers; pod "
        f"{_human(s.pod_memory_bytes)} ({_human(s.usable_memory_bytes)} usable) / {s.pod_cpus:g} CPUs, "
        f"W={s.workers_per_actor_limit}, A={s.max_actors_per_source}, state per {s.state_per}; {basis}; "
        + ("sustains any rate (no demand)" if math.isinf(sustained) else f"sustains {sustained:,.0f} mixed samples/s"),
        f"  {'group':<12}{'level':>6}{'sources':>8}{'actors':>7}{'w/actor':>8}{'need':>6}{'state':>11}{'memory/pod':>12}  sources",
    ]
    for g in result.groups:
        lines.append(
            f"  {g.name:<12}{g.level:>6}{len(g.sources):>8}{g.actors:>7}{g.workers_per_actor:>8}{g.workers_needed:>6}"
            f"{_human(g.state_bytes):>11}{_human(g.memory_bytes):>12}  {', '.join(src.name for src in g.sources)}"
            + ("  (capped)" if g.capped else "")
        )
    for level in result.levels:
        lines.append(
            f"  level {level.index}: {len(level.sources)} sources, demand {level.demand_range[0]:.3g}..{level.demand_range[1]:.3g} "
            f"worker-s per mixed sample, {level.workers_range[0]}..{level.workers_range[1]} workers each alone"
        )
    lines += [f"  warning: {w}" for w in result.warnings]
    return "\n".join(lines)


# ---- quantities -------------------------------------------------------------------------------


def parse_memory(text: str | int, *, field: str = "memory", allow_zero: bool = False) -> int:
    """Bytes of a Kubernetes memory quantity: "32Gi", "512Mi", "1G", "1.5Gi", "1e9", 1000
    (a fraction of a byte rounds up).

    Raises:
        ConfigError: not a quantity, or not > 0 (or < 0 with `allow_zero`).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _QUANTITY.fullmatch(str(text).strip())
        if not match or match.group(3) not in _MEMORY_SUFFIXES or (match.group(2) and match.group(3)):
            raise ConfigError(field, "must be a memory quantity such as 32Gi, 512Mi, 8G or a number of bytes", text)
        number = float(match.group(1)) * (10 ** int(match.group(2)) if match.group(2) else 1)
        value = math.ceil(number * _MEMORY_SUFFIXES[match.group(3)] - _EPS)
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(field, "must be >= 0" if allow_zero else "must be > 0", text)
    return value


def parse_cpu(text: str | float, *, field: str = "cpus") -> float:
    """Cores of a Kubernetes CPU quantity: "8", "7.5", "7500m".

    Raises:
        ConfigError: not a quantity, or not > 0.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _QUANTITY.fullmatch(str(text).strip())
        if not match or match.group(3) not in ("", "m") or match.group(2):
            raise ConfigError(field, "must be a CPU quantity such as 8, 7.5 or 7500m", text)
        value = float(match.group(1)) / (1000 if match.group(3) == "m" else 1)
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(field, "must be > 0", text)
    return value


def format_memory(nbytes: int, *, at_most: int | None = None) -> str:
    """`nbytes` as a quantity: whole Gi or Mi when exact, else rounded up to Mi unless that
    exceeds `at_most`, else plain bytes."""
    if nbytes == 0:
        return "0"
    for suffix, size in (("Gi", GiB), ("Mi", MiB)):
        if nbytes % size == 0:
            return f"{nbytes // size}{suffix}"
    mebibytes = math.ceil(nbytes / MiB)
    if at_most is None or mebibytes * MiB <= at_most:
        return f"{mebibytes}Mi"
    return str(nbytes)


def dns_label(name: str) -> str:
    """`name` as a Kubernetes object name: lower case letters, digits and '-', at most 63."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:63].strip("-")
    return label or "batchplane"


def _human(nbytes: float) -> str:
    for suffix, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {suffix}"
    return f"{int(nbytes)} B"


def _ceil(x: float) -> int:
    return max(math.ceil(x - _EPS), 0)


def _at_least(field: str, value: Any, minimum: int, *, integer: bool = False) -> None:
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(field, f"must be an integer >= {minimum}", value)
    if value < minimum:
        raise ConfigError(field, f"must be >= {minimum}", value)
