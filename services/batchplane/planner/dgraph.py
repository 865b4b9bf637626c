"""DGraph: a job's planning strategy declared in a few lines. Pure; no I/O.

A strategy is a user Python file named by the job's `strategy` setting. It defines
`strategy(mesh)`, which receives the job's ClientPlaceTree and returns `DGraph.plan()`:

    def strategy(mesh):                                   # LLM long/short balancing
        text = DGraph("text", metadata="length")
        text.mix()                                        # the job's mixture weights
        text.distribute(axis="DP")
        text.cost(models.LLAMA_12B.cost)
        text.balance("karmarkar_karp", microbatches=4)
        return text.plan()

A DGraph records what happens to one step's samples; it does nothing when declared. The planner
runs the compiled `Strategy` for every step on the samples the mixture allocated: each graph
looks at one per-sample quantity (`metadata`: the length in tokens, or a feature the loaders
report such as "image_tokens"), computes costs with its cost model, and balances its samples
over the buckets of its axis. Several graphs over the same samples express multi-module models:
a vision-language strategy balances images over WORLD by encoder cost and sequences over DP by
backbone cost (see examples/strategies/).

The graph `plan()` is called on is the primary one: it must hold every sample (I1) and decides
the microbatches every rank trains on. The others are secondary: they hold the samples whose
metadata is positive and say which rank processes them (e.g. which GPU encodes which images).

Low-level hooks cover what the primitives cannot say:
- `plan_raw(fn)`: replaces distribute/balance: `fn(samples, costs, mesh)` returns
  [bucket][microbatch] index arrays itself (checked to be a partition, aligned);
- `summary_buffer(fn)`: derives extra per-sample metadata from the step's buffer summary,
  `fn(samples) -> {name: array}`, before costs are computed;
- `loader_do_plan(fn)`: runs in the loaders on the samples of every fetch a plan makes,
  `fn(samples: pyarrow.Table, plan) -> pyarrow.Table` (see `batchplane.loader.hooks`);
- `constructor_do_plan(fn)`: runs in the constructors on every microbatch they build,
  `fn(tensors: {name: ndarray}, context) -> {name: ndarray}` (see `batchplane.constructor.hooks`).
The last two run in other processes: they must be functions at the top level of the strategy
file, which those processes import by name (the fingerprint holds the file's digest).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from batchplane.core.mesh import DISTRIBUTION_AXES, ClientPlaceTree
from batchplane.core.methods import BALANCE_METHODS
from batchplane.planner.cost import CostFn, make_cost_fn
from batchplane.planner.padded import Rows, rows_of
from batchplane.planner.plan import Balancing, LengthLimit, SampleTable, StepPlan, SubPlan, assign, good_samples, sample_costs
from batchplane.planner.token_budget import token_budget_steps

BUILTIN_METHODS = BALANCE_METHODS
BROADCAST_DIMS = ("TP",)


class StrategyError(ValueError):
    """A strategy that cannot be planned; the message names the graph and the primitive."""


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """One graph as declared (immutable once `plan()` compiled it)."""

    name: str
    metadata: str
    weights: Mapping[str, float] | None
    mixes: bool
    axis: str
    group_size: int | None
    cost_fn: CostFn | None
    balancing: Balancing
    raw: Callable[..., object] | None
    summary: Callable[[SampleTable], Mapping[str, np.ndarray]] | None
    #: Payload columns (batch.payload) delivered with this secondary graph's assignment.
    columns: tuple[str, ...] = ()


class DGraph:
    """Declares what happens to one step's samples under one metadata.

    Args:
        name: The graph's name ("text", "images"); secondary graphs' assignments are delivered
            under it.
        metadata: "length" (tokens of the sample) or the name of a per-sample feature the
            loaders report (e.g. "image_tokens"); the cost model receives it as its lengths.
    """

    def __init__(self, name: str = "text", *, metadata: str = "length") -> None:
        if not name or not name.replace("_", "").isalnum():
            raise StrategyError(f"DGraph name must be letters, digits and _, got {name!r}")
        self.name = name
        self.metadata = metadata
        self._weights: Mapping[str, float] | None = None
        self._mixes = False
        self._axis = "DP"
        self._group_size: int | None = None
        self._cost: CostFn | None = None
        self._balancing = Balancing()
        self._raw: Callable[..., object] | None = None
        self._summary: Callable[[SampleTable], Mapping[str, np.ndarray]] | None = None
        self._broadcast: set[str] = set()
        self._hooks: dict[str, Callable] = {}
        self._columns: tuple[str, ...] = ()

    # ---- primitives ----------------------------------------------------------------------

    def mix(self, schedule: Mapping[str, float] | None = None) -> DGraph:
        """Samples the sources by `schedule`: per-source weights (only ratios matter); None
        uses the job's `mixture.weights`. Only the primary graph mixes."""
        if schedule is not None:
            if not isinstance(schedule, Mapping):
                raise StrategyError(f"{self.name}.mix: schedule must be a mapping of source name to weight, got {type(schedule).__name__}")
            for source, weight in schedule.items():
                if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight < 0:
                    raise StrategyError(f"{self.name}.mix: weight of {source!r} must be a finite number >= 0, got {weight!r}")
            schedule = {str(k): float(v) for k, v in schedule.items()}
        self._weights = schedule
        self._mixes = True
        return self

    def distribute(self, axis: str = "DP", group_size: int | None = None) -> DGraph:
        """Distributes samples over the buckets of `axis` of the ClientPlaceTree: "DP" (one per
        replica; CP peers get slices), "CP" (DP x CP consumers of whole sequences) or "WORLD"
        (every rank). With `group_size`, balancing runs within groups of that many buckets."""
        if axis not in DISTRIBUTION_AXES:
            raise StrategyError(f"{self.name}.distribute: axis must be one of {DISTRIBUTION_AXES}, got {axis!r}")
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
            raise StrategyError(f"{self.name}.distribute: group_size must be an integer >= 1, got {group_size!r}")
        self._axis, self._group_size = axis, group_size
        return self

    def cost(self, fn: CostFn | str) -> DGraph:
        """Registers the cost model: a callable `fn(lengths, features=None)` of the graph's
        metadata, or a built-in name ("quadratic", "linear", a model such as "llama-12b")."""
        if isinstance(fn, str):
            fn = make_cost_fn(fn)
        if not callable(fn):
            raise StrategyError(f"{self.name}.cost: expected a callable or a built-in name, got {type(fn).__name__}")
        self._cost = fn
        return self

    def balance(
        self,
        method: str | Callable[[np.ndarray, int], object] = "karmarkar_karp",
        *,
        microbatches: int = 1,
        intra: bool = True,
        max_tokens: int | None = None,
        max_cost: float | None = None,
        padded: bool = True,
    ) -> DGraph:
        """Balances samples by cost over the buckets, then over `microbatches` microbatches per
        bucket (`intra=False` keeps each bucket's sample order within its microbatches).

        Methods: "karmarkar_karp", "greedy", "round_robin", "token_budget" (variable-size
        microbatches under `max_tokens` padded tokens - real tokens when `padded` is False - or
        `max_cost`, the same number on every bucket, at least `microbatches`), or a callable
        `method(costs, parts) -> list of index arrays` (e.g. a zig-zag order).
        """
        if isinstance(method, str) and method not in BUILTIN_METHODS:
            raise StrategyError(f"{self.name}.balance: method must be one of {BUILTIN_METHODS} or a callable, got {method!r}")
        if not isinstance(method, str) and not callable(method):
            raise StrategyError(f"{self.name}.balance: method must be a name or a callable, got {type(method).__name__}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise StrategyError(f"{self.name}.balance: microbatches must be an integer >= 1, got {microbatches!r}")
        if method == "token_budget" and (max_tokens is None) == (max_cost is None):
            raise StrategyError(f"{self.name}.balance: 'token_budget' needs exactly one of max_tokens and max_cost")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise StrategyError(f"{self.name}.balance: max_tokens must be an integer >= 1, got {max_tokens!r}")
        if max_cost is not None and not (isinstance(max_cost, (int, float)) and np.isfinite(max_cost) and max_cost > 0):
            raise StrategyError(f"{self.name}.balance: max_cost must be a finite number > 0, got {max_cost!r}")
        self._balancing = Balancing(
            method=method, microbatches=microbatches, intra=bool(intra), max_tokens=max_tokens, max_cost=max_cost, padded=bool(padded)
        )
        return self

    def deliver(self, *columns: str) -> DGraph:
        """Delivers these payload columns (`batch.payload`, kinds "sample" or "blob") of this
        secondary graph's samples to the bucket that processes them, under the graph's name in
        the rank's subbatches (e.g. `images.deliver("pixel_values", "image_grid_thw")`: each rank
        receives the pixels of exactly the images it encodes, whichever replica trains their
        samples). Those columns are then left out of the primary graph's microbatches."""
        for column in columns:
            if not isinstance(column, str) or not column:
                raise StrategyError(f"{self.name}.deliver: columns are payload column names, got {column!r}")
        if len(set(columns)) != len(columns):
            raise StrategyError(f"{self.name}.deliver: a column is named twice in {list(columns)}")
        self._columns = tuple(columns)
        return self

    def broadcast_at(self, dim: str) -> DGraph:
        """Declares that the trainer broadcasts along `dim` ("TP"): rank tp=0 of each group
        receives the data, its peers get only the step's metadata."""
        if dim not in BROADCAST_DIMS:
            raise StrategyError(f"{self.name}.broadcast_at: dim must be one of {BROADCAST_DIMS}, got {dim!r}")
        self._broadcast.add(dim)
        return self

    # ---- low-level hooks -----------------------------------------------------------------

    def plan_raw(self, fn: Callable[[SampleTable, np.ndarray, ClientPlaceTree], object]) -> DGraph:
        """Plans this graph directly: `fn(samples, costs, mesh)` returns [bucket][microbatch]
        index arrays into `samples` (a partition; the same microbatch count per bucket)."""
        self._raw = _callable(fn, self.name, "plan_raw")
        return self

    def summary_buffer(self, fn: Callable[[SampleTable], Mapping[str, np.ndarray]]) -> DGraph:
        """Derives per-sample metadata from the step's buffer summary before costs:
        `fn(samples) -> {name: float64 array}`, merged into the samples' features."""
        self._summary = _callable(fn, self.name, "summary_buffer")
        return self

    def loader_do_plan(self, fn: Callable) -> DGraph:
        """Transforms the samples loaders send for each plan: `fn(samples, plan)` gets the
        fetched rows (columns source, seq, input_ids) and a `LoaderPlan` (step, constructor,
        source names) and returns a table of the same rows in the same order whose input_ids
        keep their lengths (the plan's token counts and loss weights depend on them). For
        deterministic per-step work: masking, noising, token replacement."""
        self._hooks["loader_do_plan"] = _callable(fn, self.name, "loader_do_plan")
        return self

    def constructor_do_plan(self, fn: Callable) -> DGraph:
        """Transforms every microbatch a constructor builds, before CP slicing and the pipeline
        stage filter: `fn(tensors, context)` returns the microbatch's tensors, with new ones
        added or built ones replaced in shape and dtype (2-D tensors are per-token, shaped
        like input_ids, and CP-sliced like it); `context` is a `MicrobatchContext`."""
        self._hooks["constructor_do_plan"] = _callable(fn, self.name, "constructor_do_plan")
        return self

    # ---- compile -------------------------------------------------------------------------

    def _spec(self, *, primary: bool) -> GraphSpec:
        if self._mixes and not primary:
            raise StrategyError(f"{self.name}.mix: only the primary graph (the one plan() is called on) mixes sources")
        if self._hooks and not primary:
            raise StrategyError(f"{self.name}.{next(iter(self._hooks))}: hooks belong to the primary graph (the one plan() is called on)")
        if self._columns and primary:
            raise StrategyError(
                f"{self.name}.deliver: the primary graph's microbatches carry every payload column no secondary graph delivers"
            )
        return GraphSpec(
            name=self.name,
            metadata=self.metadata,
            weights=self._weights,
            mixes=self._mixes,
            axis=self._axis,
            group_size=self._group_size,
            cost_fn=self._cost,
            balancing=self._balancing,
            raw=self._raw,
            summary=self._summary,
            columns=self._columns,
        )

    def plan(self, *secondary: DGraph) -> Strategy:
        """Compiles this graph (the primary) and `secondary` graphs into a Strategy."""
        if self._axis == "WORLD":
            raise StrategyError(f"{self.name}.distribute: the primary graph distributes over 'DP' or 'CP'; 'WORLD' is for secondary graphs")
        names = [self.name, *(g.name for g in secondary)]
        if len(set(names)) != len(names):
            raise StrategyError(f"DGraph names must differ, got {names}")
        graphs = (self, *secondary)
        return Strategy(
            primary=self._spec(primary=True),
            secondary=tuple(g._spec(primary=False) for g in secondary),
            broadcast=frozenset().union(*(g._broadcast for g in graphs)),
            hooks=dict(self._hooks),
        )


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A compiled strategy: run once per step by the planner.

    Attributes:
        primary: The graph every sample goes through; decides the microbatches.
        secondary: Graphs over the samples with positive metadata (e.g. images).
        broadcast: Dimensions the trainer broadcasts along ("TP").
        hooks: The loader and constructor hooks by kind ("loader_do_plan", ...).
    """

    primary: GraphSpec
    secondary: tuple[GraphSpec, ...] = ()
    broadcast: frozenset[str] = frozenset()
    hooks: Mapping[str, Callable] = dataclasses.field(default_factory=dict)

    def hook_names(self) -> dict[str, str]:
        """The hooks' function names, as loaders and constructors look them up."""
        return {kind: fn.__name__ for kind, fn in self.hooks.items()}

    def weights(self, source_names: tuple[str, ...], default: tuple[float, ...]) -> tuple[float, ...]:
        """Per-source weights, in source order: the primary graph's mix, else `default`.

        Raises:
            StrategyError: the mix names an unknown source or gives every source weight 0.
        """
        if self.primary.weights is None:
            return default
        unknown = sorted(set(self.primary.weights) - set(source_names))
        if unknown:
            raise StrategyError(f"{self.primary.name}.mix: {unknown} name no source; sources are {list(source_names)}")
        weights = tuple(self.primary.weights.get(name, 1.0) for name in source_names)
        if sum(weights) <= 0:
            raise StrategyError(f"{self.primary.name}.mix: at least one source needs a weight > 0")
        return weights

    @property
    def delivered_columns(self) -> dict[str, str]:
        """Payload columns the secondary graphs deliver, to the graph that delivers each."""
        return {column: g.name for g in self.secondary for column in g.columns}

    def check_columns(self, payload: Mapping[str, str]) -> None:
        """Checks the columns graphs deliver against the job's payload (name -> kind).

        Raises:
            StrategyError: a column the job does not declare, one of kind "token" (it belongs
                to the sequences), or one two graphs deliver.
        """
        owner: dict[str, str] = {}
        for g in self.secondary:
            for column in g.columns:
                if column not in payload:
                    declared = ", ".join(payload) or "none"
                    raise StrategyError(f"{g.name}.deliver: {column!r} is not a column of the job's batch.payload (declared: {declared})")
                if payload[column] == "token":
                    raise StrategyError(f"{g.name}.deliver: {column!r} is a per-token column; it travels with its sequences")
                if column in owner:
                    raise StrategyError(f"{g.name}.deliver: {column!r} is already delivered by {owner[column]}")
                owner[column] = g.name

    def check(self, mesh: ClientPlaceTree) -> None:
        """Checks the strategy against a mesh (bucket counts, group sizes).

        Raises:
            StrategyError: names the graph and what does not fit.
        """
        for g in (self.primary, *self.secondary):
            buckets = mesh.buckets(g.axis)
            if g.group_size and g.group_size < buckets and buckets % g.group_size:
                raise StrategyError(
                    f"{g.name}.distribute: group_size {g.group_size} must divide the {buckets} {g.axis} buckets of {mesh!r}"
                )
            if g.group_size and g.balancing.method == "token_budget":
                raise StrategyError(f"{g.name}.distribute: group_size does not apply to 'token_budget', which plans every bucket at once")

    def run(
        self,
        step: int,
        allocated: SampleTable,
        mesh: ClientPlaceTree,
        *,
        default_cost: CostFn,
        max_length: int | None = None,
        length_policy: str = "split",
        packed: bool = False,
    ) -> StepPlan:
        """Plans one step.

        Args:
            step: The step.
            allocated: The samples the mixture allocated to it, bad ones included.
            mesh: The job's ClientPlaceTree.
            default_cost: Cost model of a graph that registered none.
            max_length: The job's `batch.max_length` (`JobSettings.max_length`); None: no limit.
            length_policy: The job's `batch.length_policy`. Under "split", a graph over
                "length" costs a sample longer than max_length as its chunks (`sample_costs`)
                and its token budget counts their rows; the plan's loss tokens count them too.
            packed: The job packs microbatches (`batch.packing`). Unless it does, a primary
                graph over "length" balanced by "karmarkar_karp" or "greedy" balances the cost
                of its microbatches padded as the constructor builds them, and groups similar
                lengths into a microbatch (`plan.assign`); the plan's `built_rank_costs` are
                padded costs.
        Returns:
            The step's plan; a function of the arguments (I4).
        Raises:
            StrategyError: a hook or cost model returned something unusable.
        """
        limit: LengthLimit = {"max_length": max_length, "length_policy": length_policy}
        if self.windowed:
            return self.run_window(
                step, allocated, np.zeros(len(allocated), np.int64), mesh, steps=1, default_cost=default_cost, packed=packed, **limit
            )[0]
        samples, bad = good_samples(allocated)
        samples, metadata, costs, rows = self._prepare(samples, default_cost, packed=packed, **limit)
        primary = self.primary
        buckets = mesh.buckets(primary.axis)
        if primary.raw is not None:
            microbatches = _checked_raw(primary.raw(samples, costs, mesh), len(samples), buckets, primary.name)
        else:
            microbatches = assign(
                costs, metadata, buckets=buckets, balancing=_with_group(primary), rows=rows, **_limit_of(primary, **limit)
            )
        return StepPlan(
            step=step,
            samples=samples,
            microbatches=microbatches,
            bad_samples=bad,
            costs=costs,
            axis=primary.axis,
            subplans=self._subplans(samples, mesh, default_cost, **limit),
            rows=rows,
            **limit,
        )

    @property
    def windowed(self) -> bool:
        """Whether the primary graph plans token budgets, which `run_window` plans over several
        steps at once."""
        return self.primary.raw is None and self.primary.balancing.method == "token_budget"

    def run_window(
        self,
        first: int,
        allocated: SampleTable,
        home: np.ndarray,
        mesh: ClientPlaceTree,
        *,
        steps: int,
        default_cost: CostFn,
        max_length: int | None = None,
        length_policy: str = "split",
        packed: bool = False,
    ) -> list[StepPlan]:
        """Plans the `steps` steps of a token-budget window from step `first` at once
        (`batchplane.planner.window`): the window's good samples are grouped together by
        `token_budget_steps` and each step trains the groups dealt to it; secondary graphs
        balance each step's own samples.

        Args:
            first: The window's first step.
            allocated: The samples of the whole window, bad ones included.
            home: int64 per allocated sample: the step of the window (0 .. steps - 1) a bad one
                counts against (the step the mixture allocated it to).
            mesh, default_cost, max_length, length_policy, packed: As for `run`.
            steps: Steps in the window, >= 1.
        Returns:
            The plans of steps first .. first + steps - 1; a function of the arguments (I4).
        Raises:
            StrategyError: the primary graph does not plan token budgets, or a hook or cost
                model returned something unusable.
        """
        if not self.windowed:
            raise StrategyError(f"graph {self.primary.name!r}: only 'token_budget' plans over windows of several steps")
        limit: LengthLimit = {"max_length": max_length, "length_policy": length_policy}
        samples, _ = good_samples(allocated)
        home = np.asarray(home, np.int64)
        bad = np.bincount(home[np.asarray(allocated.length) <= 0], minlength=steps)
        targets = np.zeros((steps, int(allocated.source.max(initial=0)) + 1))
        np.add.at(targets, (home, allocated.source.astype(np.int64)), 1)
        samples, metadata, costs, rows = self._prepare(samples, default_cost, packed=packed, **limit)
        primary, b = self.primary, self.primary.balancing
        per_step = token_budget_steps(
            metadata,
            costs,
            ranks=mesh.buckets(primary.axis),
            steps=steps,
            max_tokens=b.max_tokens,
            max_cost=b.max_cost,
            padded=b.padded,
            min_microbatches=b.microbatches,
            sources=samples.source,
            targets=targets,
            **_limit_of(primary, **limit),
        )
        plans = []
        for s, ranks in enumerate(per_step):
            mine = np.sort(np.concatenate([mb for rank in ranks for mb in rank]))
            own = samples.take(mine)
            own_rows = None
            if rows is not None:
                own_rows = rows_of(primary.cost_fn or default_cost, metadata[mine], own.features, costs[mine], padded=not packed, **limit)
            plans.append(
                StepPlan(
                    step=first + s,
                    samples=own,
                    bad_samples=int(bad[s]),
                    costs=costs[mine],
                    axis=primary.axis,
                    microbatches=tuple(tuple(np.searchsorted(mine, mb).astype(np.int64) for mb in rank) for rank in ranks),
                    subplans=self._subplans(own, mesh, default_cost, **limit),
                    rows=own_rows,
                    **limit,
                )
            )
        return plans

    def _prepare(
        self, samples: SampleTable, default_cost: CostFn, *, max_length: int | None, length_policy: str, packed: bool
    ) -> tuple[SampleTable, np.ndarray, np.ndarray, Rows | None]:
        """The good samples with the summary hooks' features, and the primary graph's metadata,
        costs and padded rows (None unless it balances lengths) of each."""
        limit: LengthLimit = {"max_length": max_length, "length_policy": length_policy}
        for g in (self.primary, *self.secondary):
            if g.summary is not None:
                samples = _with_features(samples, g.summary(samples), g.name)
        primary = self.primary
        metadata = _metadata(samples, primary)
        costs = _costs(primary, metadata, samples, default_cost, **limit)
        rows = None
        if primary.metadata == "length":
            try:
                rows = rows_of(primary.cost_fn or default_cost, metadata, samples.features, costs, padded=not packed, **limit)
            except ValueError as exc:
                raise StrategyError(f"graph {primary.name!r}: {exc}") from exc
        return samples, metadata, costs, rows

    def _subplans(
        self, samples: SampleTable, mesh: ClientPlaceTree, default_cost: CostFn, *, max_length: int | None, length_policy: str
    ) -> tuple[SubPlan, ...]:
        """The secondary graphs' assignments of one step's samples."""
        limit: LengthLimit = {"max_length": max_length, "length_policy": length_policy}
        subplans = []
        for g in self.secondary:
            values = _metadata(samples, g, required=False)
            members = np.flatnonzero(values > 0)
            graph_costs = np.zeros(len(samples))
            graph_costs[members] = _costs(g, values[members], samples.take(members), default_cost, **limit)
            n = mesh.buckets(g.axis)
            if g.raw is not None:
                parts = _checked_raw(g.raw(samples.take(members), graph_costs[members], mesh), len(members), n, g.name)
                groups = tuple(np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts)
            else:
                balancing = dataclasses.replace(_with_group(g), microbatches=1)
                parts = assign(graph_costs[members], values[members], buckets=n, balancing=balancing, **_limit_of(g, **limit))
                groups = tuple(np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts)
            subplans.append(SubPlan(g.name, g.axis, g.metadata, tuple(np.sort(members[p]) for p in groups), graph_costs, values, g.columns))
        return tuple(subplans)


def default_strategy(
    *, method: str, microbatches: int, cost_fn: CostFn, max_tokens: int | None = None, max_cost: float | None = None, padded: bool = True
) -> Strategy:
    """The strategy of a job without a strategy file: mix by the job's weights, distribute over
    DP, the job's cost model, balance with the job's method."""
    g = DGraph("text")
    g.mix()
    g.distribute(axis="DP")
    g.cost(cost_fn)
    g.balance(method, microbatches=microbatches, max_tokens=max_tokens, max_cost=max_cost, padded=padded)
    return g.plan()


# ---- helpers ----------------------------------------------------------------------------


def _callable(fn: object, graph: str, primitive: str) -> Callable:
    if not callable(fn):
        raise StrategyError(f"{graph}.{primitive}: expected a callable, got {type(fn).__name__}")
    return fn


def _with_group(g: GraphSpec) -> Balancing:
    return dataclasses.replace(g.balancing, group_size=g.group_size)


def _metadata(samples: SampleTable, g: GraphSpec, *, required: bool = True) -> np.ndarray:
    """The graph's per-sample quantity as int64. A feature no sample of the step reports is 0
    for all of them when not `required` (a secondary graph's step drawn only from sources
    without it, e.g. text-only sources of a VLM job), else an error."""
    if g.metadata == "length":
        return samples.length.astype(np.int64)
    values = samples.features.get(g.metadata)
    if values is None:
        if not len(samples) or not required:
            return np.zeros(len(samples), np.int64)
        raise StrategyError(
            f"graph {g.name!r}: metadata {g.metadata!r} is not a feature of the samples; features reported: {sorted(samples.features) or 'none'}"
        )
    return np.rint(np.asarray(values, dtype=np.float64)).astype(np.int64)


def _limit_of(g: GraphSpec, *, max_length: int | None, length_policy: str) -> LengthLimit:
    """The length limit as it applies to graph `g`: only sequences ("length") are split."""
    return {"max_length": max_length if g.metadata == "length" else None, "length_policy": length_policy}


def _costs(
    g: GraphSpec, lengths: np.ndarray, samples: SampleTable, default_cost: CostFn, *, max_length: int | None, length_policy: str
) -> np.ndarray:
    fn = g.cost_fn or default_cost
    limit = _limit_of(g, max_length=max_length, length_policy=length_policy)
    costs = np.asarray(sample_costs(fn, lengths, samples.features, **limit), dtype=np.float64)
    if costs.shape != lengths.shape or not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise StrategyError(f"graph {g.name!r}: its cost model must return finite costs >= 0, one per sample")
    return costs


def _with_features(samples: SampleTable, extra: Mapping[str, np.ndarray], graph: str) -> SampleTable:
    features = dict(samples.features)
    for name, values in dict(extra).items():
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (len(samples),):
            raise StrategyError(f"{graph}.summary_buffer: feature {name!r} has shape {values.shape}, expected ({len(samples)},)")
        features[name] = values
    return dataclasses.replace(samples, features=features)


def _checked_raw(result: object, n: int, buckets: int, graph: str) -> tuple[tuple[np.ndarray, ...], ...]:
    """A plan_raw result as [bucket][microbatch] int64 arrays, checked to be an aligned partition."""
    if not isinstance(result, Iterable):
        raise StrategyError(f"{graph}.plan_raw: must return [bucket][microbatch] index arrays, got {type(result).__name__}")
    try:
        plan = tuple(tuple(np.sort(np.asarray(mb, dtype=np.int64)) for mb in bucket) for bucket in result)
    except (TypeError, ValueError) as exc:
        raise StrategyError(f"{graph}.plan_raw: must return [bucket][microbatch] index arrays: {exc}") from exc
    if len(plan) != buckets:
        raise StrategyError(f"{graph}.plan_raw: returned {len(plan)} buckets, the axis has {buckets}")
    if len({len(b) for b in plan}) > 1:
        raise StrategyError(f"{graph}.plan_raw: every bucket needs the same number of microbatches, got {[len(b) for b in plan]}")
    flat = np.concatenate([mb for b in plan for mb in b]) if plan and plan[0] else np.zeros(0, np.int64)
    if len(flat) != n or not np.array_equal(np.sort(flat), np.arange(n)):
        raise StrategyError(f"{graph}.plan_raw: every one of the {n} samples must be in exactly one microbatch")
    return plan
