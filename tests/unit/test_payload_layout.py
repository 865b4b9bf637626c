"""The constructor's layout of a job's declared payload columns (`batchplane.core.payload`):
token columns like input_ids (padded, packed, split, CP-sliced on axis 1 with their fill),
sample columns [samples, *shape] and blobs [Σ rows, *shape] + `<name>_offsets`, whole on every
CP rank and pipeline stage; a loader's payload with bad columns refused naming the column; and
a StepPipeline building a declared payload it fetched."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from batchplane.constructor.assemble import RankSamples, assemble, derive, tensors_of
from batchplane.constructor.bounds import MalformedResponse
from batchplane.constructor.hooks import apply_constructor_hook
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.parallel import CP_MODES, cp_columns, cp_slice, cp_width
from batchplane.constructor.pipeline import StepPipeline
from batchplane.constructor.responses import Wanted, fetch_schema, receive_samples, sample_columns
from batchplane.core.config import job_from_mapping
from batchplane.core.errors import Unavailable
from batchplane.core.payload import BLOB, SAMPLE, TOKEN, PayloadColumn, arrow_type
from batchplane.v1 import common_pb2, loader_pb2, planner_pb2
from batchplane.wire import encode_array, iter_chunks

from rpc_fakes import Channel

PAD, IGNORE = 0, -100
DTYPES = ("bool", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")


# ---- generating samples with declared columns, as a loader sends them ------------------------


def _values(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Exact values of `dtype` (small integers, so float16 holds them; no NaN)."""
    if dtype == "bool":
        return rng.random(shape) < 0.5
    return rng.integers(0, 100, shape).astype(dtype)


def _arrow_column(column: PayloadColumn, per_sample: list[np.ndarray]) -> pa.Array:
    """The normalized Arrow column of the samples' values (what the loader sends)."""
    flat = np.concatenate([v.reshape(-1) for v in per_sample]) if per_sample else np.zeros(0, column.dtype)
    flat = pa.array(
        flat.astype(column.dtype), type=arrow_type(column).value_type if column.kind != SAMPLE or column.shape else arrow_type(column)
    )
    if column.kind == SAMPLE:
        return flat if not column.shape else pa.FixedSizeListArray.from_arrays(flat, column.inner)
    offsets = np.zeros(len(per_sample) + 1, np.int32)
    np.cumsum([v.size for v in per_sample], out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), flat)


def _table(tokens: list[np.ndarray], columns: list[PayloadColumn], values: dict[str, list[np.ndarray]]) -> pa.Table:
    n = len(tokens)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    arrays = [
        pa.array(np.zeros(n, np.int32)),
        pa.array(np.arange(n, dtype=np.int64)),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(tokens) if n else np.zeros(0, np.int32), pa.int32())),
        *(_arrow_column(c, values[c.name]) for c in columns),
    ]
    return pa.Table.from_arrays(arrays, schema=fetch_schema(columns))


@st.composite
def payload_columns(draw) -> list[PayloadColumn]:
    count = draw(st.integers(1, 4))
    out = []
    for i in range(count):
        kind = draw(st.sampled_from((TOKEN, SAMPLE, BLOB)))
        shape = draw(st.sampled_from(((), (1,), (2,), (3,))))
        out.append(
            PayloadColumn(f"c{i}", kind, draw(st.sampled_from(DTYPES)), shape, float(draw(st.integers(0, 1)) if kind == TOKEN else 0) * 7)
        )
    return out


@st.composite
def step_samples(draw, columns: list[PayloadColumn] | None = None):
    """(columns, tokens per sample, ground-truth values per column per sample, microbatch offsets);
    `columns` given: of those columns."""
    columns = draw(payload_columns()) if columns is None else columns
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    counts = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))  # samples per microbatch; 0: a filler
    n = sum(counts)
    lengths = [draw(st.integers(1, 17)) for _ in range(n)]
    tokens = [rng.integers(1, 1000, k).astype(np.int32) for k in lengths]
    values: dict[str, list[np.ndarray]] = {}
    for c in columns:
        if c.kind == TOKEN:
            values[c.name] = [_values(rng, c.dtype, (k, *c.shape)) for k in lengths]
        elif c.kind == SAMPLE:
            values[c.name] = [_values(rng, c.dtype, c.shape) for _ in lengths]
        else:
            values[c.name] = [_values(rng, c.dtype, (int(rng.integers(0, 5)), *c.shape)) for _ in lengths]
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return columns, tokens, values, offsets


def _rank_samples(tokens, columns, values, offsets) -> RankSamples:
    """The samples as the pipeline hands them to assembly: views of a fetched Arrow table."""
    table = _table(tokens, columns, values)
    n = len(tokens)
    return RankSamples(
        tokens=tokens,
        source=np.zeros(n, np.int32),
        row=np.arange(n, dtype=np.int64),
        epoch=np.zeros(n, np.int32),
        offsets=offsets,
        columns=sample_columns(table, columns),
    )


def _unslice(parts: list[np.ndarray], *, width: int, cp: int, mode: str) -> np.ndarray:
    """The whole [rows, padded, ...] tensor from the CP ranks' [rows, padded / cp, ...] parts."""
    padded = cp_width(width, cp=cp, mode=mode)
    whole = np.empty((parts[0].shape[0], padded, *parts[0].shape[2:]), parts[0].dtype)
    for rank, part in enumerate(parts):
        whole[:, cp_columns(width, cp=cp, rank=rank, mode=mode)] = part
    return whole


# ---- the property: what the ranks receive restores every sample's columns ------------------


@settings(max_examples=120, deadline=None)
@given(
    drawn=step_samples(),
    packed=st.booleans(),
    pack_length=st.integers(1, 40),
    max_length=st.sampled_from((None, 1, 3, 8)),
    cp=st.integers(1, 4),
    mode=st.sampled_from(CP_MODES),
    stages=st.integers(1, 3),
)
def test_what_the_ranks_receive_restores_every_samples_columns(drawn, packed, pack_length, max_length, cp, mode, stages) -> None:
    columns, tokens, values, offsets = drawn
    built = assemble(
        _rank_samples(tokens, columns, values, offsets),
        step=1,
        rank=0,
        pad_id=PAD,
        ignore_id=IGNORE,
        token_dtype="int64",
        global_loss_tokens=100,
        pack_length=pack_length if packed else None,
        max_length=max_length,
        length_policy="split",
        payload=columns,
    )
    whole = tensors_of(built)
    # every (cp rank, stage) of the mesh; TP peers of one (cp rank, stage) get the same bytes
    variants = {
        (r, s): derive(built, cp=cp, cp_rank=r if cp > 1 else None, cp_mode=mode, stage=s, stages=stages, pad_id=PAD, ignore_id=IGNORE)
        for r in range(cp)
        for s in range(stages)
    }
    peer = derive(
        built, cp=cp, cp_rank=cp - 1 if cp > 1 else None, cp_mode=mode, stage=stages - 1, stages=stages, pad_id=PAD, ignore_id=IGNORE
    )
    assert bytes(peer.payload) == bytes(variants[(cp - 1, stages - 1)].payload)
    parts = {key: tensors_of(v) for key, v in variants.items()}
    for m in range(len(offsets) - 1):
        lo, hi = int(offsets[m]), int(offsets[m + 1])
        full = whole[m]
        width = full["input_ids"].shape[1]
        mask = full["attention_mask"]
        # the real tokens, row-major, are the microbatch's samples in order (split or packed)
        assert np.array_equal(full["input_ids"][mask], np.concatenate(tokens[lo:hi]) if hi > lo else np.zeros(0))
        for s in range(stages):
            got = [parts[(r, s)][m] for r in range(cp)]
            if s == 0:  # the first stage's input_ids / mask unslice to the built ones
                for name in ("input_ids", "attention_mask"):
                    restored = _unslice([g[name] for g in got], width=width, cp=cp, mode=mode)
                    assert np.array_equal(restored[:, :width], full[name])
            for c in columns:
                truth = values[c.name][lo:hi]
                for g in got:
                    assert c.name in g, (c.name, s)  # declared columns reach every stage
                    assert g[c.name].dtype == np.dtype(c.dtype)
                if c.kind == TOKEN:
                    assert all(g[c.name].shape == (mask.shape[0], cp_width(width, cp=cp, mode=mode) // cp, *c.shape) for g in got)
                    restored = _unslice([g[c.name] for g in got], width=width, cp=cp, mode=mode)
                    assert (restored[:, width:] == np.asarray(c.fill, c.dtype)).all()  # CP padding is the fill
                    restored = restored[:, :width]
                    expected = np.concatenate(truth) if truth else np.zeros((0, *c.shape), c.dtype)
                    assert np.array_equal(restored[mask], expected)
                    assert (restored[~mask] == np.asarray(c.fill, c.dtype)).all()
                elif c.kind == SAMPLE:
                    for g in got:
                        assert g[c.name].shape == (hi - lo, *c.shape)
                        for b, v in enumerate(truth):
                            assert np.array_equal(g[c.name][b], v)
                else:
                    for g in got:
                        rows, at = g[c.name], g[c.offsets_name]
                        assert at.dtype == np.int32 and at.shape == (hi - lo + 1,) and at[0] == 0 and at[-1] == len(rows)
                        assert rows.shape == (int(sum(len(v) for v in truth)), *c.shape)
                        for b, v in enumerate(truth):
                            assert np.array_equal(rows[at[b] : at[b + 1]], v)


def test_a_filler_microbatch_gets_empty_and_fill_tensors_of_the_declared_shapes() -> None:
    columns = [
        PayloadColumn("weights", TOKEN, "float32", (2,), fill=-1.0),
        PayloadColumn("grid", SAMPLE, "int64", (3,)),
        PayloadColumn("pixels", BLOB, "uint8", (6,)),
    ]
    for pack_length in (None, 8):
        built = assemble(
            _rank_samples([], columns, {c.name: [] for c in columns}, np.array([0, 0])),
            step=0,
            rank=0,
            pad_id=PAD,
            ignore_id=IGNORE,
            token_dtype="int32",
            global_loss_tokens=0,
            pack_length=pack_length,
            payload=columns,
        )
        (mb,) = tensors_of(built)
        assert built.microbatches[0].filler
        assert mb["weights"].shape == (1, 1, 2) and (mb["weights"] == -1).all()
        assert mb["grid"].shape == (0, 3) and mb["grid"].dtype == np.int64
        assert mb["pixels"].shape == (0, 6) and mb["pixels"].dtype == np.uint8
        assert mb["pixels_offsets"].tolist() == [0]


def test_a_sample_column_shaped_like_input_ids_is_not_cp_sliced() -> None:
    """Two samples of 3 tokens: a [2, 3] sample column has input_ids' very shape, and still
    passes CP whole (the rule is by name, not by dimensions); a token column is sliced."""
    columns = [PayloadColumn("grid", SAMPLE, "int64", (3,)), PayloadColumn("weight", TOKEN, "float32", (), fill=0.5)]
    tokens = [np.array([1, 2, 3], np.int32), np.array([4, 5, 6], np.int32)]
    values = {"grid": [np.array([1, 2, 3]), np.array([4, 5, 6])], "weight": [np.ones(3, np.float32), np.full(3, 2, np.float32)]}
    built = assemble(
        _rank_samples(tokens, columns, values, np.array([0, 2])),
        step=0,
        rank=0,
        pad_id=PAD,
        ignore_id=IGNORE,
        token_dtype="int32",
        global_loss_tokens=4,
        payload=columns,
    )
    assert tensors_of(built)[0]["grid"].shape == tensors_of(built)[0]["input_ids"].shape == (2, 3)
    for rank in range(2):
        (part,) = tensors_of(derive(built, cp=2, cp_rank=rank, cp_mode="contiguous", pad_id=PAD, ignore_id=IGNORE))
        assert part["grid"].tolist() == [[1, 2, 3], [4, 5, 6]]
        assert part["input_ids"].shape == part["weight"].shape == (2, 2)
    (last,) = tensors_of(derive(built, cp=2, cp_rank=1, cp_mode="contiguous", pad_id=PAD, ignore_id=IGNORE))
    assert last["weight"].tolist() == [[1.0, 0.5], [2.0, 0.5]]  # column 2 then the CP padding (fill)


def test_cp_slice_cuts_a_token_column_of_shape_k_on_axis_1() -> None:
    ids = np.arange(10).reshape(2, 5)
    vec = np.arange(30).reshape(2, 5, 3)
    blob = np.arange(12).reshape(4, 3)
    got = cp_slice({"input_ids": ids, "vec": vec, "blob": blob}, cp=2, rank=0, mode="zigzag", pad_values={"input_ids": 0, "vec": -1})
    columns = cp_columns(5, cp=2, rank=0, mode="zigzag")  # [0, 1, 6, 7] of 8
    padded = np.full((2, 8, 3), -1)
    padded[:, :5] = vec
    assert np.array_equal(got["vec"], padded[:, columns]) and got["blob"] is blob
    with pytest.raises(ValueError, match="per-token tensors must be"):
        cp_slice({"input_ids": ids, "flat": np.zeros(3)}, cp=2, rank=0, mode="zigzag", pad_values={"input_ids": 0, "flat": 0})


def test_a_hook_sees_the_declared_columns_and_its_2d_tensors_are_sliced_beside_them() -> None:
    columns = [PayloadColumn("pixels", BLOB, "uint8", (4,)), PayloadColumn("tag", TOKEN, "int32", (), fill=-1)]
    tokens = [np.array([1, 2, 3, 4], np.int32)]
    values = {"pixels": [np.arange(8, dtype=np.uint8).reshape(2, 4)], "tag": [np.array([5, 6, 7, 8], np.int32)]}
    seen = {}

    def hook(tensors, context):
        seen.update({k: v.shape for k, v in tensors.items()})
        tensors["doc"] = np.ones_like(tensors["input_ids"])
        return tensors

    built = apply_constructor_hook(
        hook,
        assemble(
            _rank_samples(tokens, columns, values, np.array([0, 1])),
            step=0,
            rank=0,
            pad_id=PAD,
            ignore_id=IGNORE,
            token_dtype="int32",
            global_loss_tokens=3,
            payload=columns,
        ),
        sources=("a",),
    )
    assert seen["pixels"] == (2, 4) and seen["pixels_offsets"] == (2,) and seen["tag"] == (1, 4)
    (part,) = tensors_of(derive(built, cp=2, cp_rank=1, cp_mode="zigzag", pad_id=PAD, ignore_id=IGNORE))
    assert part["tag"].tolist() == [[6, 7]] and part["doc"].tolist() == [[1, 1]] and part["pixels"].shape == (2, 4)


# ---- a loader's payload with bad columns ----------------------------------------------------

COLUMNS = [
    PayloadColumn("weight", TOKEN, "float32", (2,)),
    PayloadColumn("grid", SAMPLE, "int64", (3,)),
    PayloadColumn("pixels", BLOB, "uint8", (4,)),
]
LENGTHS = np.array([3, 2], np.int32)
ADDRESS = "10.0.0.7:5000"


def _good_columns() -> dict[str, pa.Array]:
    return {
        "weight": pa.array([[0.5] * 6, [1.5] * 4], pa.list_(pa.float32())),
        "grid": pa.array([[1, 2, 2], [1, 1, 1]], pa.list_(pa.int64(), 3)),
        "pixels": pa.array([list(range(8)), []], pa.list_(pa.uint8())),
    }


def _ipc(arrays: dict[str, pa.Array]) -> bytes:
    base = {
        "source": pa.array([0, 0], pa.int32()),
        "seq": pa.array([0, 1], pa.int64()),
        "input_ids": pa.array([[1, 2, 3], [4, 5]], pa.list_(pa.int32())),
    }
    batch = pa.record_batch(list({**base, **arrays}.values()), names=list({**base, **arrays}))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _stream(data: bytes):
    yield loader_pb2.FetchSamplesResponse(header=loader_pb2.FetchHeader(num_samples=2, payload_bytes=len(data)))
    for piece in iter_chunks(data, 256):
        yield loader_pb2.FetchSamplesResponse(chunk=common_pb2.Chunk(data=piece))


WANTED = Wanted(np.zeros(2, np.int32), np.arange(2, dtype=np.int64), LENGTHS)


def _receive(arrays: dict[str, pa.Array]):
    tables, nbytes = receive_samples(_stream(_ipc(arrays)), address=ADDRESS, wanted=[WANTED], columns=COLUMNS)
    return tables[0], nbytes


def test_a_well_formed_payload_with_declared_columns_is_received_as_views() -> None:
    table, _ = _receive(_good_columns())
    views = sample_columns(table, COLUMNS)
    assert views["weight"][0].shape == (3, 2) and views["weight"][1].tolist() == [[1.5, 1.5]] * 2
    assert views["grid"][0].tolist() == [1, 2, 2]
    assert views["pixels"][0].shape == (2, 4) and views["pixels"][1].shape == (0, 4)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"weight": None}, "declared column 'weight' is missing"),
        ({"grid": pa.array([[1, 2, 2], [1, 1, 1]], pa.list_(pa.int32(), 3))}, "column 'grid' is fixed_size_list<item: int32>"),
        ({"grid": pa.array([1, 2], pa.int64())}, "column 'grid' is int64"),
        ({"weight": pa.array([[0.5] * 6, [1.5] * 3], pa.list_(pa.float32()))}, r"column 'weight' .*sample 1 has 3 values for 2 tokens"),
        ({"weight": pa.array([[0.5] * 6, None], pa.list_(pa.float32()))}, r"column 'weight' .*null samples"),
        ({"pixels": pa.array([list(range(7)), []], pa.list_(pa.uint8()))}, r"column 'pixels' .*sample 0 has 7 values, not a multiple"),
        ({"pixels": pa.array([[1, None, 3, 4], []], pa.list_(pa.uint8()))}, r"column 'pixels' .*null values"),
        ({"grid": pa.array([[1, 2, 2], None], pa.list_(pa.int64(), 3))}, r"column 'grid' .*null samples"),
        ({"extra": pa.array([1, 2], pa.int8())}, r"columns \['extra'\] that the job does not declare"),
    ],
)
def test_a_payload_with_a_bad_column_is_refused_naming_it_and_the_loader(change, names) -> None:
    arrays = {k: v for k, v in {**_good_columns(), **change}.items() if v is not None}
    with pytest.raises(MalformedResponse, match=names) as info:
        _receive(arrays)
    assert ADDRESS in str(info.value)


def test_a_payload_too_big_for_its_declared_columns_is_refused_before_allocation() -> None:
    messages = iter([loader_pb2.FetchSamplesResponse(header=loader_pb2.FetchHeader(num_samples=2, payload_bytes=2**40))])
    token_only = [COLUMNS[0], COLUMNS[1]]
    with pytest.raises(MalformedResponse, match=r"payload_bytes 1099511627776 outside .*'weight'"):
        receive_samples(messages, address=ADDRESS, wanted=[WANTED], columns=token_only)


# ---- a StepPipeline fetching and building a declared payload ---------------------------------

JOB = job_from_mapping(
    {
        "job": "j",
        "sources": [{"name": "a", "path": "unused"}],
        "mesh": {"dp": 1, "cp": 2},
        "batch": {
            "global_batch_size": 2,
            "microbatches": 1,
            "payload": [
                {"name": "weight", "kind": "token", "dtype": "float32", "shape": [2]},
                {"name": "grid", "kind": "sample", "dtype": "int64", "shape": [3]},
                {"name": "pixels", "kind": "blob", "dtype": "uint8", "shape": [4]},
            ],
        },
    }
)


class _Planner:
    def GetPlan(self, request, timeout):  # noqa: N802 - the stub's method name
        rank_plan = planner_pb2.RankPlan(
            dp_rank=0,
            samples=common_pb2.SampleSet(
                source=encode_array(np.zeros(2, np.int32)),
                seq=encode_array(np.arange(2, dtype=np.int64)),
                row=encode_array(np.arange(2, dtype=np.int64)),
                epoch=encode_array(np.zeros(2, np.int32)),
                length=encode_array(LENGTHS),
            ),
            microbatch_offsets=encode_array(np.array([0, 2], np.int64)),
            fetchers=1,
            loaders=encode_array(np.zeros(2, np.int32)),
        )
        return planner_pb2.GetPlanResponse(
            step=request.step, ranks=[rank_plan], loader_addresses=["loader-0:1"], global_loss_tokens=3, axis="DP"
        )


class _Loader:
    def __init__(self) -> None:
        self.bad = True

    def FetchSamples(self, request, timeout):  # noqa: N802 - the stub's method name
        if not len(request.samples.seq.data):
            return iter([loader_pb2.FetchSamplesResponse(header=loader_pb2.FetchHeader())])
        arrays = _good_columns()
        if self.bad:  # a blob that is not whole rows
            arrays["pixels"] = pa.array([list(range(7)), []], pa.list_(pa.uint8()))
        return _stream(_ipc(arrays))


def test_a_pipeline_builds_the_declared_columns_it_fetched_for_each_cp_rank() -> None:
    registry = CollectorRegistry()
    pipeline = StepPipeline(
        JOB, index=0, ranks=(0, 1), planner="planner:1", metrics=ConstructorMetrics(registry), connect=lambda a, p: Channel()
    )
    loader = _Loader()
    pipeline._planner = _Planner()
    pipeline._fetcher._loader = lambda address: loader
    try:
        with pytest.raises(Unavailable, match=r"loader at loader-0:1 sent a malformed response: column 'pixels'"):
            pipeline.batch(0, 0, timeout_s=1.5)
        assert registry.get_sample_value("batchplane_constructor_malformed_responses_total", {"peer": "loader"}) >= 1
        assert any(t.name == "build" and t.is_alive() for t in threading.enumerate())
        loader.bad = False
        weights = []
        for rank in (0, 1):
            delivery = pipeline.batch(rank, 0, timeout_s=10)
            (mb,) = tensors_of(delivery.batch)
            assert mb["grid"].tolist() == [[1, 2, 2], [1, 1, 1]]
            assert mb["pixels"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and mb["pixels_offsets"].tolist() == [0, 2, 2]
            assert mb["weight"].shape == (2, 2, 2)  # [rows, width 3 padded to 4 / cp 2, 2]
            weights.append(mb["weight"])
        restored = _unslice(weights, width=3, cp=2, mode=JOB.constructors.cp_slicing)
        assert restored[0, :3].tolist() == [[0.5, 0.5]] * 3 and restored[1, :2].tolist() == [[1.5, 1.5]] * 2
        assert (restored[1, 2:] == 0).all() and (restored[0, 3:] == 0).all()
    finally:
        pipeline.stop()
