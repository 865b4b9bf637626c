"""Tests of batchplane.planner.cost.make_cost_fn: built-in models, user callables by import
path, and their errors."""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from batchplane.core.errors import ConfigError
from batchplane.planner.cost import make_cost_fn

USER_MODULE = "bp_test_user_costs"
BROKEN_MODULE = "bp_test_broken_costs"

_USER_SOURCE = """
import numpy as np

NOT_CALLABLE = 42


def double(lengths):
    return 2.0 * lengths


def as_list(lengths):
    return [float(x) + 0.5 for x in lengths]


def int64_flag(lengths):
    return np.full(lengths.shape, 1.0 if lengths.dtype == np.int64 else 0.0)


def wrong_shape(lengths):
    return np.zeros(len(lengths) + 1)


def scalar(lengths):
    return 1.0


def negative(lengths):
    return np.arange(len(lengths), dtype=np.float64) - 1.0


def with_nan(lengths):
    out = np.ones(len(lengths))
    out[-1] = np.nan
    return out


def with_inf(lengths):
    out = np.ones(len(lengths))
    out[0] = np.inf
    return out


def not_numeric(lengths):
    return ["x"] * len(lengths)


class Model:
    @staticmethod
    def cost(lengths):
        return lengths.astype(np.float64) + 1.0


def with_images(lengths, features):
    return lengths.astype(np.float64) + 1000.0 * features.get("num_images", 0.0)
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Writes the user cost module (and one that fails on import) under tmp_path and puts it
    on sys.path; yields the module name."""
    (tmp_path / f"{USER_MODULE}.py").write_text(textwrap.dedent(_USER_SOURCE))
    (tmp_path / f"{BROKEN_MODULE}.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield USER_MODULE
    for name in (USER_MODULE, BROKEN_MODULE):
        sys.modules.pop(name, None)


LENGTHS = np.array([0, 1, 2, 10, 4096], dtype=np.int64)


@pytest.mark.parametrize(
    ("kind", "coefficients", "expected"),
    [
        ("quadratic", {}, [0.0, 1.0, 4.0, 100.0, 4096.0**2]),
        ("quadratic", {"linear": 3.0, "quadratic": 0.5}, [0.0, 3.5, 8.0, 80.0, 3 * 4096 + 0.5 * 4096**2]),
        ("quadratic", {"linear": 2.0, "quadratic": 0.0}, [0.0, 2.0, 4.0, 20.0, 8192.0]),
        ("quadratic", {"linear": 1, "quadratic": 2}, [0.0, 3.0, 10.0, 210.0, 4096 + 2 * 4096**2]),
        ("linear", {}, [0.0, 1.0, 2.0, 10.0, 4096.0]),
        ("linear", {"linear": 5.0, "quadratic": 7.0}, [0.0, 1.0, 2.0, 10.0, 4096.0]),
    ],
)
def test_builtin_models(kind: str, coefficients: dict[str, float], expected: list[float]) -> None:
    costs = make_cost_fn(kind, **coefficients)(LENGTHS)
    assert costs.dtype == np.float64
    assert costs.shape == LENGTHS.shape
    assert costs.tolist() == expected


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("quadratic", [float(2**62), float((2**31 - 1) ** 2)]),
        ("linear", [float(2**31), float(2**31 - 1)]),
    ],
)
def test_large_lengths_do_not_overflow(kind: str, expected: list[float]) -> None:
    costs = make_cost_fn(kind)(np.array([2**31, 2**31 - 1], dtype=np.int64))
    assert costs.tolist() == pytest.approx(expected, rel=1e-15)
    assert (costs > 0).all()


@pytest.mark.parametrize("kind", ["quadratic", "linear"])
def test_builtin_models_keep_the_input_and_accept_empty(kind: str) -> None:
    lengths = LENGTHS.copy()
    fn = make_cost_fn(kind)
    costs = fn(lengths)
    costs[:] = -1.0
    assert np.array_equal(lengths, LENGTHS)
    empty = fn(np.zeros(0, dtype=np.int64))
    assert empty.dtype == np.float64 and empty.shape == (0,)


@pytest.mark.parametrize(
    ("coefficients", "field"),
    [
        ({"linear": -1.0}, "balance.cost.linear"),
        ({"quadratic": float("nan")}, "balance.cost.quadratic"),
        ({"quadratic": float("inf")}, "balance.cost.quadratic"),
        ({"linear": "1"}, "balance.cost.linear"),
        ({"linear": None}, "balance.cost.linear"),
        ({"quadratic": True}, "balance.cost.quadratic"),
        ({"linear": 10**400}, "balance.cost.linear"),
    ],
)
def test_bad_coefficients_raise_config_error(coefficients: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_cost_fn("quadratic", **coefficients)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(
    ("attribute", "expected"),
    [
        ("double", [0.0, 2.0, 4.0, 20.0, 8192.0]),
        ("as_list", [0.5, 1.5, 2.5, 10.5, 4096.5]),
        ("Model.cost", [1.0, 2.0, 3.0, 11.0, 4097.0]),
    ],
)
def test_user_callable_by_import_path(user_module: str, attribute: str, expected: list[float]) -> None:
    costs = make_cost_fn(f"{user_module}:{attribute}")(LENGTHS)
    assert costs.dtype == np.float64
    assert costs.tolist() == expected


def test_user_callable_receives_int64(user_module: str) -> None:
    fn = make_cost_fn(f"{user_module}:int64_flag")
    assert fn(np.array([3, 4], dtype=np.int32)).tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("cubic", "package.module:callable"),
        ("", "package.module:callable"),
        (":double", "package.module:callable"),
        (f"{USER_MODULE}:", "package.module:callable"),
        ("bp_no_such_module_anywhere:double", "cannot import module 'bp_no_such_module_anywhere'"),
        (f"{BROKEN_MODULE}:double", "RuntimeError: boom at import"),
        (f"{USER_MODULE}:missing", "has no attribute 'missing'"),
        (f"{USER_MODULE}:Model.missing", "has no attribute 'Model.missing'"),
        (f"{USER_MODULE}:NOT_CALLABLE", "not callable"),
    ],
)
def test_bad_import_paths_raise_config_error(user_module: str, kind: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_cost_fn(kind)
    assert info.value.field == "balance.cost.kind"
    assert info.value.value == kind
    assert problem in info.value.problem


@pytest.mark.parametrize(
    ("attribute", "what"),
    [
        ("wrong_shape", r"shape \(6,\), expected \(5,\)"),
        ("scalar", r"shape \(\), expected \(5,\)"),
        ("negative", r"negative cost -1\.0 at index 0"),
        ("with_nan", r"non-finite cost nan at index 4"),
        ("with_inf", r"non-finite cost inf at index 0"),
        ("not_numeric", "not convertible to float64"),
    ],
)
def test_bad_user_results_raise_value_error_naming_the_path(user_module: str, attribute: str, what: str) -> None:
    path = f"{user_module}:{attribute}"
    fn = make_cost_fn(path)  # importing works; the result is checked on each call
    with pytest.raises(ValueError, match=re.escape(repr(path)) + ".*" + what):
        fn(LENGTHS)


def test_a_user_callable_taking_features_receives_the_loaders_features(user_module: str) -> None:
    cost = make_cost_fn(f"{user_module}:with_images")
    lengths = np.array([3, 4, 5], np.int64)
    assert cost(lengths, {"num_images": np.array([0.0, 2.0, 1.0])}).tolist() == [3.0, 2004.0, 1005.0]
    assert cost(lengths).tolist() == [3.0, 4.0, 5.0]  # no features reported: an empty dict


def test_builtin_models_ignore_features() -> None:
    lengths = np.array([2, 3], np.int64)
    assert make_cost_fn("quadratic")(lengths, {"num_images": np.array([5.0, 5.0])}).tolist() == [4.0, 9.0]
