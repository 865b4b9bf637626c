"""Per-sample compute cost models: the cost the planner balances, as a function of a sample's
length in tokens.

`make_cost_fn` turns the job's `balance.cost` settings into a function from an int64 array of
lengths to a float64 array of costs: the built-in "quadratic" (attention-dominated) and
"linear" models, the training FLOPs of a named transformer (`batchplane.planner.models.MODELS`,
e.g. "llama-12b", or "encoder:vit-2b" for an image encoder costed by its image tokens), or a
user callable named by an import path "package.module:callable". `sample_costs` costs a
step's samples under such a model, a sample the constructor splits as the sum of its chunks.
Pure: no I/O beyond importing that module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import numpy as np

from batchplane.core import lengths as sample_lengths
from batchplane.core.errors import ConfigError
from batchplane.core.userfile import import_callable
from batchplane.planner.models import MODELS, encoder_cost

#: (int64 lengths [n], optional per-sample features {name: float64 [n]}) -> float64 costs [n].
CostFn = Callable[..., np.ndarray]

#: The simple built-in kinds, which take the `linear` / `quadratic` coefficients.
BUILTIN_KINDS = ("quadratic", "linear")
#: Prefix of the encoder kinds, "encoder:<model name>"; reserved, never an import path.
ENCODER_PREFIX = "encoder:"
_FIELD = "balance.cost.kind"


def known_kinds() -> tuple[str, ...]:
    """Lists every built-in cost kind `make_cost_fn` accepts besides import paths.

    Returns:
        The simple kinds, then the model names of `MODELS`, then "encoder:<model name>" for each.
    """
    return (*BUILTIN_KINDS, *MODELS, *(ENCODER_PREFIX + name for name in MODELS))


def make_cost_fn(kind: str, *, linear: float = 0.0, quadratic: float = 1.0) -> CostFn:
    """Builds the per-sample cost function of a cost model.

    Args:
        kind: "quadratic" (cost = linear * l + quadratic * l**2), "linear" (cost = l), a model
            name in `MODELS` ("vit-1b", "vit-2b", "llama-12b", "tmoe-25b", "mixtral-8x7b":
            cost = that model's training FLOPs of a sequence of length l), "encoder:<model
            name>" (the model's training FLOPs of the sample's "image_tokens" feature instead
            of its length; see `models.encoder_cost`), or an import path
            "package.module:callable" (the part after ':' may be dotted, e.g.
            "pkg.mod:Model.cost") of a callable taking the int64 lengths array and, if it has a
            parameter named `features`, the per-sample features the loaders report (a dict of
            float64 arrays, e.g. {"num_images": ...}). `known_kinds()` lists the built-in ones.
        linear: Coefficient of l for "quadratic", finite and >= 0.
        quadratic: Coefficient of l**2 for "quadratic", finite and >= 0.
    Returns:
        A function `cost(lengths, features=None)` from int64 lengths [n] (and features) to
        float64 costs [n]. The built-in models compute in float64, so lengths up to 2**31 do
        not overflow; all but the encoder kinds ignore features. A user callable is wrapped so
        that its result is checked on every call: it must convert to a float64 array of the
        lengths' shape, finite and >= 0, or the wrapper raises ValueError naming the import path.
    Raises:
        ConfigError: field "balance.cost.linear" / "balance.cost.quadratic" for a coefficient
            that is not a finite number >= 0; field "balance.cost.kind" for a kind that is neither
            built-in nor an importable callable (no ':', module not importable, attribute
            missing, not callable), or "encoder:<name>" with a name not in `MODELS`.
    """
    if kind == "quadratic":
        return _quadratic(_coefficient("linear", linear), _coefficient("quadratic", quadratic))
    if kind == "linear":
        return _linear
    if isinstance(kind, str) and kind in MODELS:
        return MODELS[kind].cost
    if isinstance(kind, str) and kind.startswith(ENCODER_PREFIX):
        name = kind[len(ENCODER_PREFIX) :]
        if name not in MODELS:
            raise ConfigError(_FIELD, f"names no known model {name!r}; models: {tuple(MODELS)}", kind)
        return encoder_cost(MODELS[name])
    module_name, sep, attr_path = kind.partition(":")
    if not sep or not module_name or not attr_path:
        raise ConfigError(_FIELD, f"must be one of {known_kinds()} or an import path 'package.module:callable'", kind)
    try:
        return _wrap_user(kind, import_callable(kind))
    except ImportError as exc:
        raise ConfigError(_FIELD, str(exc), kind) from exc


def _coefficient(name: str, value: float) -> float:
    """Checks one coefficient of the quadratic model.

    Args:
        name: "linear" or "quadratic".
        value: The coefficient.
    Returns:
        It as a float.
    Raises:
        ConfigError: field "balance.cost.<name>" when it is not a finite number >= 0.
    """
    v = float("nan")
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        try:
            v = float(value)
        except OverflowError:
            v = float("inf")
    if not np.isfinite(v) or v < 0:
        raise ConfigError(f"balance.cost.{name}", "must be a finite number >= 0", value)
    return v


def _quadratic(linear: float, quadratic: float) -> CostFn:
    """The quadratic model with fixed coefficients.

    Args:
        linear: Coefficient of l.
        quadratic: Coefficient of l**2.
    Returns:
        The cost function.
    """

    def quadratic_cost(lengths: np.ndarray, features: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """cost = linear * l + quadratic * l**2, in float64."""
        x = np.asarray(lengths, dtype=np.float64)
        return linear * x + quadratic * (x * x)

    return quadratic_cost


def _linear(lengths: np.ndarray, features: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
    """cost = l, in float64.

    Args:
        lengths: int64 lengths.
        features: Ignored.
    Returns:
        The lengths as float64.
    """
    return np.asarray(lengths, dtype=np.float64).copy()


def _wrap_user(path: str, fn: Callable[..., object]) -> CostFn:
    """Wraps a user cost callable with checks of its result.

    Args:
        path: The callable's import path, for error messages.
        fn: The callable: of the lengths, and of `features=` too when it takes them.
    Returns:
        The checked cost function.
    """

    parameters: Mapping[str, inspect.Parameter]
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature: lengths only
        parameters = {}
    wants_features = "features" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())

    def user_cost(lengths: np.ndarray, features: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """Calls the user's cost function and checks its result.

        Args:
            lengths: int64 lengths [n].
            features: Per-sample features, passed on when the callable takes `features`.
        Returns:
            float64 costs [n].
        Raises:
            ValueError: The result is not a float64-convertible array of the lengths' shape,
                or holds non-finite or negative values.
        """
        lengths = np.asarray(lengths, dtype=np.int64)
        result = fn(lengths, features=dict(features or {})) if wants_features else fn(lengths)
        try:
            costs = np.asarray(result, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cost function {path!r} returned {type(result).__name__}, not convertible to float64: {exc}") from exc
        if costs.shape != lengths.shape:
            raise ValueError(f"cost function {path!r} returned shape {costs.shape}, expected {lengths.shape}")
        bad = ~np.isfinite(costs)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"cost function {path!r} returned a non-finite cost {float(costs[i])!r} at index {i} (length {int(lengths[i])})"
            )
        neg = costs < 0
        if neg.any():
            i = int(np.flatnonzero(neg)[0])
            raise ValueError(f"cost function {path!r} returned a negative cost {float(costs[i])!r} at index {i} (length {int(lengths[i])})")
        return costs

    user_cost.__qualname__ = user_cost.__name__ = f"user_cost[{path}]"
    return user_cost


def sample_costs(
    cost_fn: CostFn,
    lengths: np.ndarray,
    features: Mapping[str, np.ndarray],
    *,
    max_length: int | None = None,
    length_policy: str = "split",
) -> np.ndarray:
    """Each sample's cost: `cost_fn` of its length, or, for a sample the constructor splits
    (`length_policy` "split", longer than `max_length`), the sum of `cost_fn` over its chunks,
    each a sequence of its own (attention is quadratic per chunk). A split sample's features go
    with its first chunk; its other chunks are costed with features 0, so that what a feature
    adds (e.g. images) is counted once.

    Args:
        cost_fn: Per-sample cost from int64 lengths and features.
        lengths: int64 lengths [n].
        features: Per-sample features {name: float64 [n]}.
        max_length, length_policy: The job's `batch.max_length` and `batch.length_policy`.
    Returns:
        What `cost_fn` returns when no sample is split (called once on `lengths`); else float64
        costs [n].
    Raises:
        ValueError: with split samples, `cost_fn` returned other than one cost per chunk.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    over = sample_lengths.over_limit(lengths, max_length=max_length)
    if not sample_lengths.splits(max_length=max_length, policy=length_policy) or not over.any():
        return cost_fn(lengths, features)
    seqs = sample_lengths.chunks(lengths, max_length=max_length, policy=length_policy)
    first = np.zeros(len(seqs), bool)
    first[seqs.first] = True
    chunk_features = {name: np.where(first, np.asarray(values, np.float64)[seqs.sample], 0.0) for name, values in features.items()}
    chunk_costs = np.asarray(cost_fn(seqs.lengths, chunk_features), dtype=np.float64)
    if chunk_costs.shape != seqs.lengths.shape:
        raise ValueError(
            f"the cost model returned shape {chunk_costs.shape} for the {len(seqs)} chunks of split samples, expected {seqs.lengths.shape}"
        )
    return np.bincount(seqs.sample, weights=chunk_costs, minlength=len(lengths))
