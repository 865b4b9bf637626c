"""Running a strategy's `loader_do_plan` hook on the samples of a fetch. Pure; no I/O.

The hook sees every fetch a constructor makes for a step's plan and may rewrite the samples'
tokens (masking, noising, replacement), deterministically from the step and the samples'
identity. It must keep the rows, their order and every sample's length: the planner already
counted those tokens into the plan, its balance and the step's loss weights. Anything else is
refused with an error that names the hook, and the fetch fails (a constructor's step cannot
be built, and its trainers get the error) rather than deliver data the plan does not describe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchplane.core.errors import FailedPrecondition


@dataclasses.dataclass(frozen=True)
class LoaderPlan:
    """What the hook knows of the fetch: the step, the constructor fetching and the job's
    source names (a sample's `source` column indexes them)."""

    step: int
    constructor: int
    sources: tuple[str, ...]


class HookError(FailedPrecondition):
    """A hook that raised or returned what the plan does not allow; names the hook."""


def apply_loader_hook(hook: Callable, batch: pa.RecordBatch, plan: LoaderPlan) -> pa.RecordBatch:
    """`hook(samples, plan)` on a fetch's samples, checked.

    Args:
        hook: The strategy's loader_do_plan.
        batch: The fetched samples (source, seq, input_ids).
        plan: The fetch's context.
    Returns:
        The hook's samples in `batch`'s schema.
    Raises:
        HookError: the hook raised, or changed the rows, their order, a length or the columns.
    """
    name = f"loader_do_plan {getattr(hook, '__name__', hook)!r} (step {plan.step})"
    try:
        out = hook(pa.Table.from_batches([batch]), plan)
    except Exception as exc:  # noqa: BLE001 - user code: any failure is the hook's
        raise HookError(f"{name} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(out, pa.RecordBatch):
        out = pa.Table.from_batches([out])
    if not isinstance(out, pa.Table):
        raise HookError(f"{name} must return a pyarrow.Table, got {type(out).__name__}")
    if sorted(out.schema.names) != sorted(batch.schema.names):
        raise HookError(f"{name} must return the columns {batch.schema.names}, got {out.schema.names}")
    if out.num_rows != batch.num_rows:
        raise HookError(f"{name} returned {out.num_rows} rows for {batch.num_rows} fetched; it must keep every sample")
    for column in ("source", "seq"):
        if not out.column(column).equals(pa.chunked_array([batch.column(column)])):
            raise HookError(f"{name} changed the {column!r} column: it must keep the samples and their order")
    ids = out.column("input_ids")
    if not (pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type)) or not pa.types.is_integer(ids.type.value_type):
        raise HookError(f"{name}: input_ids must be lists of integers, got {ids.type}")
    before = pc.list_value_length(batch.column("input_ids")).to_numpy(zero_copy_only=False)
    after = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
    changed = np.flatnonzero(before != after)
    if len(changed):
        i = int(changed[0])
        raise HookError(
            f"{name} changed the length of sample seq {batch.column('seq')[i].as_py()} of source {plan.sources[batch.column('source')[i].as_py()]!r} "
            f"from {before[i]} to {after[i]} tokens; the plan counted its tokens, so lengths must stay"
        )
    try:
        ids = ids.cast(batch.schema.field("input_ids").type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise HookError(f"{name}: input_ids do not fit the token type {batch.schema.field('input_ids').type}: {exc}") from exc
    return pa.RecordBatch.from_arrays([batch.column("source"), batch.column("seq"), ids.combine_chunks()], schema=batch.schema)
