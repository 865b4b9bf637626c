"""The strategy's low-level hooks that run outside the planner: loader_do_plan on every fetch,
constructor_do_plan on every built microbatch, and how a strategy file registers them."""

from __future__ import annotations

import pathlib
import textwrap

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.constructor.assemble import RankSamples, assemble, derive, tensors_of
from batchplane.constructor.hooks import HookError as ConstructorHookError
from batchplane.constructor.hooks import apply_constructor_hook
from batchplane.constructor.parallel import cp_columns, cp_width, stage_filter
from batchplane.core.config import job_from_mapping
from batchplane.core.errors import ConfigError, FailedPrecondition
from batchplane.core.userfile import import_file, job_hook
from batchplane.loader.fetch import PAYLOAD_SCHEMA
from batchplane.loader.hooks import HookError as LoaderHookError
from batchplane.loader.hooks import LoaderPlan, apply_loader_hook
from batchplane.planner import DGraph, StrategyError
from batchplane.planner.strategy import load_strategy

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "strategies" / "llm_hooks.py"
PLAN = LoaderPlan(step=7, constructor=1, sources=("web", "code"))


def _fetched(lengths=(3, 0, 5, 2), seed: int = 0) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 50_000, n).astype(np.int32) for n in lengths]
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.arange(len(rows)) % 2, pa.int32()),
            pa.array(np.arange(len(rows)) + 100, pa.int64()),
            pa.array(rows, PAYLOAD_SCHEMA.field("input_ids").type),
        ],
        schema=PAYLOAD_SCHEMA,
    )


def _example():
    return import_file(EXAMPLE, setting=str(EXAMPLE))


# ---- loader_do_plan ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=0, max_size=12), seed=st.integers(0, 2**16))
def test_example_loader_hook_clips_tokens_and_keeps_rows_and_lengths(lengths, seed) -> None:
    batch = _fetched(lengths, seed)
    example = _example()
    out = apply_loader_hook(example.clip_vocabulary, batch, PLAN)
    assert out.schema == batch.schema
    assert out.column("source").equals(batch.column("source")) and out.column("seq").equals(batch.column("seq"))
    for before, after in zip(batch.column("input_ids").to_pylist(), out.column("input_ids").to_pylist()):
        assert after == [t if t < example.VOCAB_SIZE else example.UNK_ID for t in before]


def test_the_loader_hook_sees_the_fetch_and_its_plan() -> None:
    seen = []

    def hook(samples, plan):
        seen.append((samples.num_rows, samples.schema.names, plan))
        return samples

    batch = _fetched()
    assert apply_loader_hook(hook, batch, PLAN).equals(batch)
    assert seen == [(4, ["source", "seq", "input_ids"], PLAN)]


def _set_ids(samples, rows):
    return samples.set_column(2, "input_ids", pa.array(rows, pa.list_(pa.int64())))


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (lambda s, p: 1 / 0, r"raised ZeroDivisionError"),
        (lambda s, p: s.to_pylist(), "must return a pyarrow.Table, got list"),
        (lambda s, p: s.slice(1), "returned 3 rows for 4 fetched"),
        (lambda s, p: s.take([1, 0, 2, 3]), "changed the 'source' column"),
        (lambda s, p: s.append_column("x", pa.array([1, 2, 3, 4])), r"must return the columns \['source', 'seq', 'input_ids'\]"),
        (
            lambda s, p: _set_ids(s, [[1, 2, 3], [], [1, 2, 3, 4], [1, 2]]),
            "changed the length of sample seq 102 of source 'web' from 5 to 4 tokens",
        ),
        (lambda s, p: s.set_column(2, "input_ids", pa.array([["a"]] * 4)), "input_ids must be lists of integers"),
        (lambda s, p: _set_ids(s, [[1, 2, 2**40], [], [1] * 5, [1, 2]]), "do not fit the token type"),
    ],
)
def test_a_loader_hook_that_breaks_the_plan_is_refused_by_name(hook, message: str) -> None:
    with pytest.raises(LoaderHookError, match=message) as info:
        apply_loader_hook(hook, _fetched(), PLAN)
    assert "loader_do_plan" in str(info.value) and "(step 7)" in str(info.value)
    assert isinstance(info.value, FailedPrecondition)  # the fetch fails; retrying cannot help


def test_a_loader_hook_may_return_a_record_batch_and_wider_token_types() -> None:
    batch = _fetched()
    out = apply_loader_hook(lambda s, p: _set_ids(s, [[9] * n for n in (3, 0, 5, 2)]).to_batches()[0], batch, PLAN)
    assert out.schema == batch.schema
    assert out.column("input_ids").to_pylist() == [[9] * 3, [], [9] * 5, [9] * 2]


# ---- constructor_do_plan ----------------------------------------------------------------


def _built(lengths=(5, 3, 7, 1, 4), offsets=(0, 2, 5)):
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, 1000, n).astype(np.int32) for n in lengths]
    samples = RankSamples(
        tokens=tokens,
        source=np.zeros(len(tokens), np.int32),
        row=np.arange(len(tokens)),
        epoch=np.zeros(len(tokens), np.int32),
        offsets=np.asarray(offsets),
    )
    return assemble(samples, step=3, rank=1, pad_id=0, ignore_id=-100, token_dtype="int32", global_loss_tokens=15)


def test_example_constructor_hook_adds_per_sample_loss_weights() -> None:
    batch = _built()
    out = apply_constructor_hook(_example().sample_loss_weights, batch, sources=("web",))
    assert [mb.loss_weight for mb in out.microbatches] == [mb.loss_weight for mb in batch.microbatches]
    for before, after in zip(tensors_of(batch), tensors_of(out)):
        for name, value in before.items():
            np.testing.assert_array_equal(after[name], value)
        weights = after["loss_weights"]
        assert weights.dtype == np.float32 and weights.shape == before["input_ids"].shape
        np.testing.assert_allclose(weights.sum(axis=1), (before["sample_length"] > 1).astype(np.float32), rtol=1e-6)
        assert np.all(weights[before["labels"] == -100] == 0)


def test_the_constructor_hook_sees_each_microbatch_with_its_context() -> None:
    seen = []

    def hook(tensors, context):
        seen.append((sorted(tensors), context))
        tensors["input_ids"][:] = 7  # writable copies
        return tensors

    batch = _built()
    out = apply_constructor_hook(hook, batch, sources=("web", "code"))
    assert [(c.step, c.bucket, c.microbatch, c.microbatches, c.sources) for _, c in seen] == [
        (3, 1, 0, 2, ("web", "code")),
        (3, 1, 1, 2, ("web", "code")),
    ]
    assert [c.loss_weight for _, c in seen] == [mb.loss_weight for mb in batch.microbatches]
    assert all(np.all(t["input_ids"] == 7) for t in tensors_of(out))
    assert not all(np.all(t["input_ids"] == 7) for t in tensors_of(batch))  # the built batch is untouched


def _drop(tensors, name):
    tensors.pop(name)
    return tensors


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (lambda t, c: {}.keys(), "must return a dict"),
        (lambda t, c: _drop(t, "labels"), r"dropped \['labels'\]"),
        (lambda t, c: {**t, "labels": t["labels"].astype(np.int64)}, r"changed 'labels' from int32\[2, 5\] to int64\[2, 5\]"),
        (lambda t, c: {**t, "sample_row": t["sample_row"] + 1}, r"changed 'sample_row'"),
        (lambda t, c: {**t, "sample_extra": np.zeros(2)}, r"added 'sample_extra'"),
        (lambda t, c: {**t, "bias": np.zeros((2, 3))}, r"2-D tensor 'bias' is \[2, 3\]"),
        (lambda t, c: {**t, "bias": [1, 2]}, r"'bias' must be a numpy array"),
        (lambda t, c: {**t, "bias": np.array(["a"])}, r"'bias' must be a numpy array of bools, integers or floats"),
        (lambda t, c: t["nope"], r"raised KeyError"),
    ],
)
def test_a_constructor_hook_that_breaks_delivery_is_refused_by_name(hook, message: str) -> None:
    with pytest.raises(ConstructorHookError, match=message) as info:
        apply_constructor_hook(hook, _built(), sources=("web",))
    assert "constructor_do_plan" in str(info.value) and "step 3, bucket 1, microbatch 0" in str(info.value)


@pytest.mark.parametrize("mode", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_hook_tensors_are_cp_sliced_per_token_and_reach_every_pipeline_stage(cp: int, mode: str) -> None:
    def hook(tensors, context):
        tensors["token_index"] = np.broadcast_to(
            np.arange(tensors["input_ids"].shape[1], dtype=np.int32), tensors["input_ids"].shape
        ).copy()
        tensors["per_sample"] = tensors["sample_length"].astype(np.float32) * 2
        return tensors

    hooked = apply_constructor_hook(hook, _built(), sources=("web",))
    whole = tensors_of(hooked)
    for cp_rank in range(cp):
        for stage, stages in ((0, 1), (0, 3), (1, 3), (2, 3)):
            part = derive(
                hooked, cp=cp, cp_rank=cp_rank if cp > 1 else None, cp_mode=mode, stage=stage, stages=stages, pad_id=0, ignore_id=-100
            )
            for full, got in zip(whole, tensors_of(part)):
                width = full["input_ids"].shape[1]
                columns = cp_columns(width, cp=cp, rank=cp_rank, mode=mode) if cp > 1 else np.arange(width)
                padded = np.zeros((full["input_ids"].shape[0], cp_width(width, cp=cp, mode=mode) if cp > 1 else width), np.int32)
                padded[:, :width] = full["token_index"]
                np.testing.assert_array_equal(got["token_index"], padded[:, columns])
                np.testing.assert_array_equal(got["per_sample"], full["per_sample"])


def test_the_stage_filter_keeps_unknown_tensors_on_every_stage() -> None:
    tensors = {"input_ids": np.zeros((1, 2)), "labels": np.zeros((1, 2)), "doc_mask": np.ones((1, 2)), "sample_row": np.zeros(1)}
    for stage in range(3):
        kept = stage_filter(tensors, stage=stage, stages=3, ignore_id=-100)
        assert {"doc_mask", "sample_row"} <= set(kept)
        assert ("input_ids" in kept) == (stage == 0) and ("labels" in kept) == (stage == 2)


# ---- registering hooks ------------------------------------------------------------------


def _job(tmp_path: pathlib.Path, body: str | None):
    data = {
        "job": "hooks",
        "sources": [{"name": "web", "path": "data/web"}],
        "mesh": {"dp": 2},
        "batch": {"global_batch_size": 8, "microbatches": 2},
    }
    if body is not None:
        (tmp_path / "s.py").write_text(textwrap.dedent(body))
        data["strategy"] = "s.py"
    return job_from_mapping(data, base_dir=tmp_path)


def test_the_example_registers_both_hooks_by_name_and_parts_find_them() -> None:
    job = job_from_mapping(
        {
            "job": "x",
            "sources": [{"name": "web", "path": "d"}],
            "mesh": {"dp": 2},
            "batch": {"global_batch_size": 8},
            "strategy": str(EXAMPLE),
        }
    )
    strategy = load_strategy(job)
    assert strategy.hook_names() == {"loader_do_plan": "clip_vocabulary", "constructor_do_plan": "sample_loss_weights"}
    for kind, name in strategy.hook_names().items():
        fn = job_hook(job, kind, name)
        assert fn.__name__ == name and fn.__code__.co_filename == str(EXAMPLE)
    assert job_hook(job, "loader_do_plan", "") is None


def test_hooks_must_be_top_level_functions_of_the_strategy_file(tmp_path: pathlib.Path) -> None:
    body = """
        from batchplane.planner import DGraph
        def strategy(mesh):
            def inner(samples, plan):
                return samples
            return DGraph().loader_do_plan(inner).plan()
    """
    with pytest.raises(ConfigError, match=r"loader_do_plan: 'strategy.<locals>.inner' must be a function defined at the top level") as info:
        load_strategy(_job(tmp_path, body))
    assert info.value.field == "strategy"


def test_hooks_belong_to_the_primary_graph_and_must_be_callable() -> None:
    with pytest.raises(StrategyError, match=r"images.constructor_do_plan: hooks belong to the primary graph"):
        DGraph("text").plan(DGraph("images", metadata="image_tokens").constructor_do_plan(len))
    with pytest.raises(StrategyError, match=r"text.loader_do_plan: expected a callable, got str"):
        DGraph("text").loader_do_plan("clip_vocabulary")
    assert DGraph("text").plan().hook_names() == {}


def test_a_part_whose_file_lacks_the_named_hook_refuses_to_start(tmp_path: pathlib.Path) -> None:
    job = _job(tmp_path, "from batchplane.planner import DGraph\ndef strategy(mesh):\n    return DGraph().plan()\n")
    with pytest.raises(ConfigError, match="constructor_do_plan hook 'mine' is not a function of 's.py'"):
        job_hook(job, "constructor_do_plan", "mine")
    with pytest.raises(ConfigError, match="this part's job has no strategy file"):
        job_hook(_job(tmp_path, None), "loader_do_plan", "mine")
