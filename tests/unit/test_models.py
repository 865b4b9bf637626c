"""Tests of batchplane.planner.models: FLOPs of transformer shapes (sizes, the attention term,
MoE top-k, overflow), encoder costs of a feature, validation, and the model kinds of
make_cost_fn."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.errors import ConfigError
from batchplane.planner.cost import BUILTIN_KINDS, known_kinds, make_cost_fn
from batchplane.planner.models import (
    LLAMA_12B,
    MIXTRAL_8X7B,
    MODELS,
    TMOE_25B,
    VIT_1B,
    VIT_2B,
    TransformerSpec,
    encoder_cost,
)

SPECS = [VIT_1B, VIT_2B, LLAMA_12B, TMOE_25B, MIXTRAL_8X7B]
MAX_LENGTH = 2**31 - 1


def reference_layer_flops(spec: TransformerSpec, length: int) -> float:
    """The documented per-layer formula, term by term, in Python floats."""
    l, h = float(length), float(spec.hidden)
    h_kv = h * (spec.kv_heads or spec.heads) / spec.heads
    qkv = 2 * l * h * (h + 2 * h_kv)
    out = 2 * l * h * h
    attention = 2 * 2 * l * l * h * (0.5 if spec.causal else 1.0)
    mlp = 2 * l * h * spec.ffn_hidden * (3 if spec.gated_mlp else 2) * spec.top_k
    router = 2 * l * h * spec.experts if spec.experts > 1 else 0.0
    return qkv + out + attention + mlp + router


def attention_term(spec: TransformerSpec, length: int) -> float:
    """The quadratic (attention score and weighted sum) part of one layer's forward FLOPs."""
    return 4.0 * length * length * spec.hidden * (0.5 if spec.causal else 1.0)


@pytest.mark.parametrize(
    ("spec", "nominal"),
    [(VIT_1B, 1e9), (VIT_2B, 2e9), (LLAMA_12B, 12e9), (TMOE_25B, 25e9), (MIXTRAL_8X7B, 47e9)],
    ids=lambda v: v.name if isinstance(v, TransformerSpec) else None,
)
def test_parameter_counts_match_the_nominal_sizes(spec: TransformerSpec, nominal: float) -> None:
    assert spec.params == pytest.approx(nominal, rel=0.10)


@pytest.mark.parametrize(
    ("spec", "params"),
    [
        # 4 h^2 + 2 h ffn per layer
        (VIT_1B, 39 * (4 * 1408**2 + 2 * 1408 * 6144)),
        # GQA: q and o are h x h, k and v are h x 1024; 8 experts of 3 matrices; router h x 8
        (MIXTRAL_8X7B, 32 * (4096 * (2 * 4096 + 2 * 1024) + 8 * 3 * 4096 * 14336 + 4096 * 8)),
        (TransformerSpec(name="tiny", layers=2, heads=2, hidden=4, ffn_hidden=8), 2 * (4 * 16 + 3 * 4 * 8)),
    ],
    ids=["vit-1b", "mixtral", "tiny"],
)
def test_parameter_counts_follow_the_formula(spec: TransformerSpec, params: int) -> None:
    assert spec.params == params


def test_models_are_keyed_by_lowercase_name() -> None:
    assert list(MODELS) == ["vit-1b", "vit-2b", "llama-12b", "tmoe-25b", "mixtral-8x7b"]
    assert all(MODELS[name].name == name for name in MODELS)
    assert (LLAMA_12B.ffn_hidden * 3, LLAMA_12B.kv_hidden) == (LLAMA_12B.hidden * 8, LLAMA_12B.hidden)
    assert (MIXTRAL_8X7B.kv_hidden, MIXTRAL_8X7B.top_k, TMOE_25B.top_k) == (1024, 2, 2)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("length", [0, 1, 7, 4096, 100_000, MAX_LENGTH])
def test_layer_flops_follow_the_documented_formula(spec: TransformerSpec, length: int) -> None:
    lengths = np.array([length], np.int64)
    expected = reference_layer_flops(spec, length)
    assert spec.layer_flops(lengths)[0] == pytest.approx(expected, rel=1e-12)
    assert spec.flops(lengths)[0] == pytest.approx(spec.layers * expected, rel=1e-12)
    assert spec.cost(lengths)[0] == pytest.approx(3 * spec.layers * expected, rel=1e-12)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("length", [1, 512, 8192, 2**20])
def test_the_attention_term_is_quadratic(spec: TransformerSpec, length: int) -> None:
    one, two = spec.layer_flops(np.array([length, 2 * length], np.int64))
    # Linear terms cancel: f(2l) - 2 f(l) = q(2l) - 2 q(l) = 2 q(l).
    assert two - 2 * one == pytest.approx(2 * attention_term(spec, length), rel=1e-9)
    quadruple = spec.layer_flops(np.array([4 * length], np.int64))[0]
    assert quadruple - 2 * two == pytest.approx(2 * attention_term(spec, 2 * length), rel=1e-9)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_doubling_a_long_length_roughly_quadruples_the_cost(spec: TransformerSpec) -> None:
    long = 2**24  # far past h and ffn: attention dominates
    one, two = spec.cost(np.array([long, 2 * long], np.int64))
    assert 3.9 < two / one <= 4.0


def test_causal_masking_halves_only_the_attention_term() -> None:
    bidirectional = dataclasses.replace(LLAMA_12B, causal=False)
    length = 4096
    diff = bidirectional.layer_flops(np.array([length]))[0] - LLAMA_12B.layer_flops(np.array([length]))[0]
    assert diff == pytest.approx(attention_term(LLAMA_12B, length), rel=1e-12)


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
def test_moe_top_k_scales_only_the_mlp_part(top_k: int) -> None:
    spec = dataclasses.replace(MIXTRAL_8X7B, top_k=top_k)
    top_1 = dataclasses.replace(MIXTRAL_8X7B, top_k=1)
    lengths = np.array([1, 4096], np.int64)
    mlp_per_expert = 2.0 * lengths * spec.hidden * spec.ffn_hidden * 3
    np.testing.assert_allclose(spec.layer_flops(lengths) - top_1.layer_flops(lengths), (top_k - 1) * mlp_per_expert, rtol=1e-12)
    assert spec.params == top_1.params  # all experts are counted whatever top_k is


def test_moe_adds_a_router_and_counts_all_experts() -> None:
    dense = TransformerSpec(name="dense", layers=1, heads=4, hidden=64, ffn_hidden=128)
    moe = dataclasses.replace(dense, experts=16, top_k=1)
    assert moe.layer_flops(np.array([10]))[0] - dense.layer_flops(np.array([10]))[0] == 2.0 * 10 * 64 * 16
    assert moe.params - dense.params == 15 * 3 * 64 * 128 + 64 * 16


def test_gqa_shrinks_only_the_key_value_projections() -> None:
    mha = dataclasses.replace(MIXTRAL_8X7B, kv_heads=None)
    assert mha.kv_hidden == mha.hidden
    diff = mha.layer_flops(np.array([1]))[0] - MIXTRAL_8X7B.layer_flops(np.array([1]))[0]
    assert diff == 2.0 * 4096 * 2 * (4096 - 1024)


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    lengths=st.lists(st.integers(min_value=0, max_value=MAX_LENGTH), min_size=1, max_size=20),
)
def test_cost_is_monotone_in_length_and_finite(spec: TransformerSpec, lengths: list[int]) -> None:
    x = np.sort(np.array(lengths, np.int64))
    costs = spec.cost(x)
    assert costs.dtype == np.float64 and costs.shape == x.shape
    assert np.isfinite(costs).all() and (costs >= 0).all()
    assert (np.diff(costs) >= 0).all()
    assert ((costs > 0) == (x > 0)).all()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_no_overflow_at_the_largest_length(spec: TransformerSpec) -> None:
    costs = spec.cost(np.array([MAX_LENGTH - 1, MAX_LENGTH], np.int64))
    assert np.isfinite(costs).all()
    assert 0 < costs[0] < costs[1]
    assert costs[1] > 3 * spec.layers * attention_term(spec, MAX_LENGTH)  # no wrap-around


def test_methods_keep_the_shape_and_accept_empty() -> None:
    lengths = np.array([[1, 2], [3, 4]], np.int64)
    assert LLAMA_12B.cost(lengths).shape == (2, 2)
    empty = LLAMA_12B.cost(np.zeros(0, np.int64))
    assert empty.dtype == np.float64 and empty.shape == (0,)
    assert LLAMA_12B.cost(lengths, {"image_tokens": np.ones((2, 2))}).tolist() == LLAMA_12B.cost(lengths).tolist()


def test_encoder_cost_uses_the_feature_not_the_length() -> None:
    cost = encoder_cost(VIT_2B)
    lengths = np.array([100, 5000, 7], np.int64)
    tokens = np.array([0.0, 256.0, 1024.0])
    costs = cost(lengths, {"image_tokens": tokens, "num_images": np.array([0.0, 1.0, 4.0])})
    assert costs.dtype == np.float64
    assert costs[0] == 0.0
    np.testing.assert_array_equal(costs, VIT_2B.cost(tokens.astype(np.int64)))


def test_encoder_cost_reads_the_named_feature() -> None:
    cost = encoder_cost(VIT_1B, feature="patches")
    costs = cost(np.array([1, 1], np.int64), {"patches": np.array([576.0, 0.0])})
    assert costs.tolist() == [VIT_1B.cost(np.array([576]))[0], 0.0]


@pytest.mark.parametrize("features", [None, {}, {"num_images": np.array([1.0])}])
def test_encoder_cost_without_the_feature_names_it_and_the_features(features: dict[str, np.ndarray] | None) -> None:
    with pytest.raises(ValueError, match=r"'image_tokens'.*available: \[") as info:
        encoder_cost(VIT_1B)(np.array([3], np.int64), features)
    if features:
        assert "num_images" in str(info.value)


@pytest.mark.parametrize(
    ("tokens", "problem"),
    [
        (np.array([1.0, -1.0]), "finite and >= 0, got -1.0 at index 1"),
        (np.array([np.nan, 1.0]), "finite and >= 0, got nan at index 0"),
        (np.array([1.0]), r"shape \(1,\), expected"),
    ],
)
def test_encoder_cost_rejects_bad_feature_values(tokens: np.ndarray, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        encoder_cost(VIT_1B)(np.array([3, 4], np.int64), {"image_tokens": tokens})


BASE = {"name": "m", "layers": 2, "heads": 4, "hidden": 64, "ffn_hidden": 128}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"name": ""}, "name"),
        ({"layers": 0}, "layers"),
        ({"heads": -4}, "heads"),
        ({"hidden": 64.0}, "hidden"),
        ({"ffn_hidden": True}, "ffn_hidden"),
        ({"experts": 0}, "experts"),
        ({"top_k": 0}, "top_k"),
        ({"experts": 4, "top_k": 5}, "top_k"),
        ({"kv_heads": 0}, "kv_heads"),
        ({"kv_heads": 3}, "kv_heads"),
        ({"kv_heads": 8}, "kv_heads"),
        ({"hidden": 66}, "hidden"),
        ({"gated_mlp": 1}, "gated_mlp"),
        ({"causal": "yes"}, "causal"),
    ],
)
def test_validation_errors_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^TransformerSpec\.{field}: .*got {changes[field]!r}$"):
        TransformerSpec(**{**BASE, **changes})  # type: ignore[arg-type]


def test_specs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA_12B.layers = 1  # type: ignore[misc]


@pytest.mark.parametrize("name", list(MODELS))
def test_make_cost_fn_accepts_model_names(name: str) -> None:
    lengths = np.array([0, 1, 4096], np.int64)
    np.testing.assert_array_equal(make_cost_fn(name)(lengths), MODELS[name].cost(lengths))
    features = {"image_tokens": np.array([0.0, 256.0, 1.0])}
    np.testing.assert_array_equal(make_cost_fn(f"encoder:{name}")(lengths, features), MODELS[name].cost(np.array([0, 256, 1])))


def test_known_kinds_lists_every_built_in_name() -> None:
    kinds = known_kinds()
    assert kinds[: len(BUILTIN_KINDS)] == BUILTIN_KINDS == ("quadratic", "linear")
    assert set(MODELS) < set(kinds)
    assert {f"encoder:{name}" for name in MODELS} < set(kinds)
    assert len(kinds) == len(set(kinds)) == 2 + 2 * len(MODELS)
    lengths = np.array([1, 2], np.int64)
    features = {"image_tokens": np.array([1.0, 2.0])}
    for kind in kinds:
        assert make_cost_fn(kind)(lengths, features).shape == (2,)


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("llama-13b", "llama-12b"),  # the message lists the known kinds
        ("LLAMA-12B", "encoder:vit-2b"),
        ("encoder:vit-3b", "names no known model 'vit-3b'"),
        ("encoder:", "names no known model ''"),
    ],
)
def test_make_cost_fn_still_rejects_unknown_names(kind: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_cost_fn(kind)
    assert info.value.field == "balance.cost.kind"
    assert info.value.value == kind
    assert problem in info.value.problem
