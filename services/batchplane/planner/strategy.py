"""Loading what the planner runs from a job's settings: its strategy (the user's strategy file, or
the default one built from the job's `balance` settings), its mixture schedule and the mixture
allocator that runs it. Reads (imports) the strategy file and a schedule callable; nothing else.

A strategy file is plain Python defining `strategy(mesh)`, which gets the job's
ClientPlaceTree and returns `DGraph.plan()`. `from batchplane.planner import DGraph, models`
gives it the primitives and the FLOPs cost models. Every part of the job (planner,
constructors, loaders) loads the same file: the fingerprint holds its digest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batchplane.core.config import JobSettings
from batchplane.core.errors import ConfigError
from batchplane.core.mesh import ClientPlaceTree, MeshError
from batchplane.core.schedule import Schedule, ScheduleError, Static, schedule_from_mapping
from batchplane.core.userfile import import_callable, import_file
from batchplane.planner.adaptive import AdaptiveRule, AdaptiveSchedule, adaptive_schedule
from batchplane.planner.cost import make_cost_fn
from batchplane.planner.dgraph import Strategy, StrategyError, default_strategy
from batchplane.planner.mixture import Mixture


def job_mesh(job: JobSettings) -> ClientPlaceTree:
    """The job's ClientPlaceTree.

    Raises:
        ConfigError: field "mesh.*" for sizes or an order that cannot be.
    """
    m = job.mesh
    try:
        return ClientPlaceTree(pp=m.pp, dp=m.dp, cp=m.cp, tp=m.tp, order=m.order)
    except MeshError as exc:
        raise ConfigError("mesh", str(exc), dict(pp=m.pp, dp=m.dp, cp=m.cp, tp=m.tp, order=m.order)) from exc


def load_strategy(job: JobSettings) -> Strategy:
    """The job's strategy, checked against its mesh.

    Raises:
        ConfigError: field "strategy" when the file cannot be imported, has no callable
            `strategy`, raises, returns something else than `DGraph.plan()`, or declares what
            the mesh cannot do (the message says which graph and primitive); field
            "balance.cost.kind" for an unknown cost model.
    """
    mesh = job_mesh(job)
    if job.strategy is None:
        b = job.balance
        strategy = default_strategy(
            method=b.method,
            microbatches=job.batch.microbatches,
            cost_fn=make_cost_fn(b.cost.kind, linear=b.cost.linear, quadratic=b.cost.quadratic),
            max_tokens=b.max_tokens,
            max_cost=b.max_cost,
            padded=not job.batch.packing,
        )
    else:
        strategy = _from_file(job, mesh)
    try:
        strategy.check(mesh)
        strategy.check_columns({c.name: c.kind for c in job.batch.payload})
        strategy.weights(job.source_names, job.weights)
    except StrategyError as exc:
        raise ConfigError("strategy", str(exc), job.strategy) from exc
    return strategy


def _from_file(job: JobSettings, mesh: ClientPlaceTree) -> Strategy:
    path = job.resolve(job.strategy)
    module = import_file(path, setting=job.strategy)
    fn = getattr(module, "strategy", None)
    if not callable(fn):
        raise ConfigError("strategy", f"{str(path)!r} must define a function strategy(mesh)", job.strategy)
    try:
        result = fn(mesh)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError("strategy", f"strategy(mesh) in {str(path)!r} failed: {type(exc).__name__}: {exc}", job.strategy) from exc
    if not isinstance(result, Strategy):
        raise ConfigError(
            "strategy", f"strategy(mesh) in {str(path)!r} must return DGraph.plan(), got {type(result).__name__}", job.strategy
        )
    for kind, hook in result.hooks.items():
        if getattr(module, getattr(hook, "__name__", ""), None) is not hook:
            raise ConfigError(
                "strategy",
                f"{kind}: {getattr(hook, '__qualname__', hook)!r} must be a function defined at the top level of {str(path)!r}, "
                "so that loaders and constructors can load it by name",
                job.strategy,
            )
    return result


@dataclasses.dataclass(frozen=True)
class JobSchedule:
    """The job's mixture schedule as the planner runs it.

    Attributes:
        schedule: Per-source weights as a function of the step position.
        granularity: "step" or "microbatch" (see `mixture.Mixture`).
    """

    schedule: Schedule
    granularity: str

    @property
    def adaptive(self) -> AdaptiveRule | None:
        """The rule of metric-driven mixing; None for a schedule fixed in advance."""
        return self.schedule.rule if isinstance(self.schedule, AdaptiveSchedule) else None

    @property
    def initial_shares(self) -> tuple[float, ...]:
        """The normalized weights of step 0."""
        if self.adaptive is not None:
            return self.adaptive.initial
        weights = self.schedule.weights_at(0.0)
        return tuple(w / sum(weights) for w in weights)


def load_schedule(job: JobSettings, strategy: Strategy) -> JobSchedule:
    """The job's mixture schedule: `mixture.schedule`, else static `mixture.weights`, or the
    strategy's `mix` weights (which may not be combined with a changing schedule).

    Raises:
        ConfigError: naming the field of a bad schedule (e.g.
            "mixture.schedule.stages[1].start"), a schedule callable that cannot be imported or
            returns bad weights at step 0, or field "strategy" when the strategy mixes with fixed
            weights and `mixture.schedule` changes them.
    """
    data: dict = {"weights": dict(job.mixture.weights)}
    if job.mixture.schedule is not None:
        data["schedule"] = dict(job.mixture.schedule)
    try:
        schedule, granularity = schedule_from_mapping(
            data, job.source_names, resolve_callable=import_callable, build_adaptive=adaptive_schedule
        )
    except ScheduleError as exc:
        raise ConfigError(exc.field, exc.problem, exc.value) from exc
    if strategy.primary.weights is not None:
        if not isinstance(schedule, Static):
            raise ConfigError(
                "strategy",
                f"{strategy.primary.name}.mix sets fixed weights, but mixture.schedule changes them; give the weights in one place",
                job.strategy,
            )
        try:
            schedule = Static(strategy.weights(job.source_names, job.weights), source_names=job.source_names)
        except StrategyError as exc:
            raise ConfigError("strategy", str(exc), job.strategy) from exc
    return JobSchedule(schedule, granularity)


def job_mixture(job: JobSettings, schedule: JobSchedule, *, num_rows: Sequence[int | None]) -> Mixture:
    """The job's mixture allocator: `schedule` over the job's batch, with each source's stream
    ending after its passes over its rows (`JobSettings.stream_end`).

    Args:
        num_rows: Per source, in source order, its rows as its loader registered them (None:
            not known yet, as for an endless stream).
    """
    return Mixture(
        schedule.schedule,
        global_batch_size=job.batch.global_batch_size,
        stream_ends=[job.stream_end(k, rows) for k, rows in enumerate(num_rows)],
        granularity=schedule.granularity,
        microbatches=job.batch.microbatches,
    )
