"""Running a strategy's `constructor_do_plan` hook on the microbatches a constructor builds.
Pure numpy; no I/O.

The hook gets each built microbatch (writable copies of its tensors) and a MicrobatchContext,
and returns the microbatch's tensors: it may add tensors (per-token loss weights, document
masks, attention biases) and rewrite built ones in place of their shape and dtype. It may not
drop a tensor or touch the samples' identity (`sample_*`), which I1 is checked on. It sees the
job's declared payload columns (`batch.payload`) as built: token columns [rows, width, *shape],
sample columns [samples, *shape], blobs [Σ rows, *shape] with `<name>_offsets`. A tensor the
hook adds is per token when it is 2-D, and must then be shaped like input_ids: it is recorded
by name in the batch's `token_columns` (padded with 0), so CP ranks get their slice of it; any
other tensor it adds passes CP whole. Tensors the constructor does not build itself (declared
columns, a hook's) go to every pipeline stage. It runs before CP slicing and the stage filter,
once per bucket, so every TP peer still gets the same bytes (I3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from batchplane.constructor.assemble import BuiltBatch, lay_out, tensors_of
from batchplane.constructor.parallel import SAMPLE_PREFIX
from batchplane.core.errors import FailedPrecondition

#: dtype kinds a hook's tensors may have: bool, signed and unsigned integers, floats.
TENSOR_KINDS = "biuf"


@dataclasses.dataclass(frozen=True)
class MicrobatchContext:
    """What the hook knows of a microbatch.

    Attributes:
        step: The step.
        bucket: The bucket (DP rank, or DP x CP consumer) the microbatch belongs to.
        microbatch: Its index in the bucket's step, and `microbatches` their number.
        loss_weight: Its loss tokens over the step's (t / T).
        sources: The job's source names (`sample_source` indexes them).
    """

    step: int
    bucket: int
    microbatch: int
    microbatches: int
    loss_weight: float
    sources: tuple[str, ...]


class HookError(FailedPrecondition):
    """A hook that raised or returned tensors the delivery cannot honour; names the hook."""


def apply_constructor_hook(hook: Callable, batch: BuiltBatch, *, sources: tuple[str, ...]) -> BuiltBatch:
    """`hook(tensors, context)` on every microbatch of a bucket's built batch, checked.

    Raises:
        HookError: the hook raised, dropped a tensor, changed a built tensor's shape or dtype,
            touched a sample_* tensor, or returned a tensor of another type or a 2-D tensor
            not shaped like input_ids.
    """
    out = []
    token_columns = dict(batch.token_columns)
    count = len(batch.microbatches)
    for m, (tensors, meta) in enumerate(zip(tensors_of(batch), batch.microbatches)):
        context = MicrobatchContext(batch.step, batch.rank, m, count, meta.loss_weight, sources)
        name = f"constructor_do_plan {getattr(hook, '__name__', hook)!r} (step {batch.step}, bucket {batch.rank}, microbatch {m})"
        given = {k: v.copy() for k, v in tensors.items()}
        try:
            result = hook(given, context)
        except Exception as exc:  # noqa: BLE001 - user code: any failure is the hook's
            raise HookError(f"{name} raised {type(exc).__name__}: {exc}") from exc
        checked = _checked(result, tensors, name)
        token_columns.update((k, 0) for k, v in checked.items() if k not in tensors and v.ndim == 2)
        out.append((checked, meta))
    return lay_out(out, step=batch.step, rank=batch.rank, global_loss_tokens=batch.global_loss_tokens, token_columns=token_columns)


def _checked(result: object, built: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    if not isinstance(result, dict):
        raise HookError(f"{name} must return a dict of tensor name to numpy array, got {type(result).__name__}")
    dropped = sorted(set(built) - set(result))
    if dropped:
        raise HookError(f"{name} dropped {dropped}; it may add and rewrite tensors, not remove them")
    per_token = built["input_ids"].shape
    tensors = {}
    for key in [*built, *(k for k in result if k not in built)]:  # built ones first, in order
        value = result[key]
        if not isinstance(key, str) or not key:
            raise HookError(f"{name} returned a tensor named {key!r}; names are non-empty strings")
        if not isinstance(value, np.ndarray) or value.dtype.kind not in TENSOR_KINDS:
            raise HookError(
                f"{name}: {key!r} must be a numpy array of bools, integers or floats, got {getattr(value, 'dtype', type(value).__name__)}"
            )
        if key in built:
            if key.startswith(SAMPLE_PREFIX) and not np.array_equal(value, built[key]):
                raise HookError(f"{name} changed {key!r}: the samples' identity is not the hook's to change")
            if value.shape != built[key].shape or value.dtype != built[key].dtype:
                raise HookError(
                    f"{name} changed {key!r} from {built[key].dtype}{list(built[key].shape)} to {value.dtype}{list(value.shape)}"
                )
        elif key.startswith(SAMPLE_PREFIX):
            raise HookError(f"{name} added {key!r}: names starting with {SAMPLE_PREFIX!r} are the samples' identity")
        elif value.ndim == 2 and value.shape != per_token:
            raise HookError(
                f"{name}: 2-D tensor {key!r} is {list(value.shape)}; 2-D tensors are per-token, shaped like input_ids {list(per_token)}"
            )
        tensors[key] = np.ascontiguousarray(value)
    return tensors
