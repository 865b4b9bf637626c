"""Tests of batchplane.core.config: loading, validation errors that name the field and the
value, defaults, path resolution, the loader/constructor assignment and the fingerprint."""

from __future__ import annotations

import copy
import math
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from batchplane.core.config import (
    MiB,
    JobSettings,
    job_from_mapping,
    load_job,
)
from batchplane.core.errors import ConfigError


def _base() -> dict[str, Any]:
    """A valid configuration with two sources, as parsed YAML."""
    return {
        "job": "test-job",
        "sources": [
            {"name": "web", "path": "data/web"},
            {"name": "code", "path": "data/code"},
        ],
    }


def _with(**changes: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation setting dotted paths, e.g. _with(**{"batch.microbatches": 0})."""

    def apply(data: dict[str, Any]) -> None:
        for dotted, value in changes.items():
            node = data
            *parents, last = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value

    return apply


def _source(i: int, **changes: Any) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        data["sources"][i].update(changes)

    return apply


def _drop(*keys: str, source: int | None = None) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        node = data if source is None else data["sources"][source]
        for k in keys:
            del node[k]

    return apply


NAN = float("nan")
INF = float("inf")

# (id, mutation, field, value)
BAD_CONFIGS: list[tuple[str, Callable[[dict[str, Any]], None], str, Any]] = [
    # unknown fields
    ("unknown-top-level", _with(sed=3), "sed", 3),
    ("unknown-nested", _with(**{"batch.microbatch": 2}), "batch.microbatch", 2),
    ("unknown-deep", _with(**{"balance.cost.quad": 1.0}), "balance.cost.quad", 1.0),
    ("unknown-in-source", _source(0, colums=["a"]), "sources[0].colums", ["a"]),
    ("unknown-in-second-source", _source(1, weight=2), "sources[1].weight", 2),
    # wrong types
    ("string-for-int", _with(**{"batch.global_batch_size": "32"}), "batch.global_batch_size", "32"),
    ("bool-for-int", _with(**{"mesh.dp": True}), "mesh.dp", True),
    ("float-for-int", _with(seed=1.5), "seed", 1.5),
    ("int-for-bool", _with(**{"loaders.shuffle.enabled": 1}), "loaders.shuffle.enabled", 1),
    ("string-for-bool", _with(**{"loaders.shuffle.enabled": "yes"}), "loaders.shuffle.enabled", "yes"),
    ("string-for-float", _with(**{"network.rpc_timeout_s": "30"}), "network.rpc_timeout_s", "30"),
    ("bool-for-float", _with(**{"balance.cost.linear": False}), "balance.cost.linear", False),
    ("int-for-string", _source(0, path=5), "sources[0].path", 5),
    ("int-for-job", _with(job=5), "job", 5),
    ("scalar-for-section", _with(batch=5), "batch", 5),
    ("null-for-section", _with(loaders=None), "loaders", None),
    ("mapping-for-list", _with(sources={"name": "web", "path": "x"}), "sources", {"name": "web", "path": "x"}),
    ("string-for-columns", _source(0, columns="abc"), "sources[0].columns", "abc"),
    ("int-in-columns", _source(0, columns=["a", 1]), "sources[0].columns[1]", 1),
    ("list-for-transform-args", _source(0, transform_args=[1]), "sources[0].transform_args", [1]),
    ("repeat-zero", _source(1, repeat=0), "sources[1].repeat", 0),
    ("repeat-negative", _source(0, repeat=-2), "sources[0].repeat", -2),
    ("repeat-fraction", _source(0, repeat=1.5), "sources[0].repeat", 1.5),
    ("repeat-string", _source(0, repeat="2"), "sources[0].repeat", "2"),
    ("repeat-bool", _source(0, repeat=True), "sources[0].repeat", True),
    ("on-change-unknown", _source(1, on_change="ignore"), "sources[1].on_change", "ignore"),
    ("on-change-bool", _source(0, on_change=True), "sources[0].on_change", True),
    ("string-weight", _with(**{"mixture.weights": {"web": "1"}}), "mixture.weights.web", "1"),
    ("negative-keep-detail", _with(**{"ledger.keep_detail_steps": -1}), "ledger.keep_detail_steps", -1),
    ("group-unknown-source", _with(**{"loaders.groups": [["web", "wbe"]]}), "loaders.groups[0]", ["web", "wbe"]),
    ("group-twice", _with(**{"loaders.groups": [["web"], ["code", "web"]]}), "loaders.groups[1]", ["code", "web"]),
    ("group-missing", _with(**{"loaders.groups": [["web"]]}), "loaders.groups", [["web"]]),
    ("group-empty", _with(**{"loaders.groups": [["web", "code"], []]}), "loaders.groups[1]", []),
    ("groups-and-count", _with(**{"loaders.groups": [["web", "code"]], "loaders.count": 1}), "loaders.count", 1),
    # required fields
    ("missing-job", _drop("job"), "job", None),
    ("blank-job", _with(job="  "), "job", "  "),
    ("missing-sources", _drop("sources"), "sources", None),
    ("empty-sources", _with(sources=[]), "sources", []),
    ("missing-source-name", _drop("name", source=0), "sources[0].name", None),
    ("missing-source-path", _drop("path", source=0), "sources[0].path", None),
    ("missing-second-path", _drop("path", source=1), "sources[1].path", None),
    ("empty-source-path", _source(0, path=""), "sources[0].path", ""),
    # source names and transforms
    ("duplicate-source-name", _source(1, name="web"), "sources[1].name", "web"),
    ("source-name-space", _source(0, name="a b"), "sources[0].name", "a b"),
    ("source-name-slash", _source(1, name="a/b"), "sources[1].name", "a/b"),
    ("source-name-empty", _source(0, name=""), "sources[0].name", ""),
    ("transform-without-colon", _source(0, transform="mymodule.fn"), "sources[0].transform", "mymodule.fn"),
    # mixture weights
    ("weight-unknown-source", _with(**{"mixture.weights": {"nope": 1.0}}), "mixture.weights.nope", 1.0),
    ("weight-negative", _with(**{"mixture.weights": {"code": -1}}), "mixture.weights.code", -1.0),
    ("weight-nan", _with(**{"mixture.weights": {"web": NAN}}), "mixture.weights.web", NAN),
    ("weight-inf", _with(**{"mixture.weights": {"web": INF}}), "mixture.weights.web", INF),
    ("weights-all-zero", _with(**{"mixture.weights": {"web": 0, "code": 0.0}}), "mixture.weights", {"web": 0.0, "code": 0.0}),
    # epochs
    ("epochs-zero", _with(epochs=0), "epochs", 0),
    ("epochs-negative", _with(epochs=-1), "epochs", -1),
    ("epochs-forever", _with(epochs="forever"), "epochs", "forever"),
    ("epochs-bool", _with(epochs=True), "epochs", True),
    # batch and mesh
    (
        "gbs-below-dp-times-microbatches",
        _with(**{"mesh.dp": 4, "batch.microbatches": 2, "batch.global_batch_size": 7}),
        "batch.global_batch_size",
        7,
    ),
    ("gbs-zero", _with(**{"batch.global_batch_size": 0}), "batch.global_batch_size", 0),
    ("microbatches-zero", _with(**{"batch.microbatches": 0}), "batch.microbatches", 0),
    ("dp-zero", _with(**{"mesh.dp": 0}), "mesh.dp", 0),
    ("token-dtype-int16", _with(**{"batch.token_dtype": "int16"}), "batch.token_dtype", "int16"),
    ("token-dtype-float32", _with(**{"batch.token_dtype": "float32"}), "batch.token_dtype", "float32"),
    # balance and cost
    ("unknown-balance-method", _with(**{"balance.method": "lpt"}), "balance.method", "lpt"),
    ("empty-cost-kind", _with(**{"balance.cost.kind": " "}), "balance.cost.kind", " "),
    ("negative-linear", _with(**{"balance.cost.linear": -0.5}), "balance.cost.linear", -0.5),
    ("negative-quadratic", _with(**{"balance.cost.quadratic": -1}), "balance.cost.quadratic", -1.0),
    ("nan-quadratic", _with(**{"balance.cost.quadratic": NAN}), "balance.cost.quadratic", NAN),
    (
        "both-coefficients-zero",
        _with(**{"balance.cost.linear": 0, "balance.cost.quadratic": 0}),
        "balance.cost",
        {"kind": "quadratic", "linear": 0.0, "quadratic": 0.0},
    ),
    # loaders and constructors
    ("loaders-count-zero", _with(**{"loaders.count": 0}), "loaders.count", 0),
    ("loaders-count-above-sources", _with(**{"loaders.count": 3}), "loaders.count", 3),
    ("read-ahead-zero", _with(**{"loaders.read_ahead_samples": 0}), "loaders.read_ahead_samples", 0),
    ("buffer-bytes-zero", _with(**{"loaders.buffer_bytes": 0}), "loaders.buffer_bytes", 0),
    ("window-row-groups-zero", _with(**{"loaders.shuffle.window_row_groups": 0}), "loaders.shuffle.window_row_groups", 0),
    ("ranks-per-constructor-zero", _with(**{"constructors.ranks_per_constructor": 0}), "constructors.ranks_per_constructor", 0),
    ("prefetch-steps-negative", _with(**{"constructors.prefetch_steps": -1}), "constructors.prefetch_steps", -1),
    ("batch-steps-zero", _with(**{"constructors.batch_steps": 0}), "constructors.batch_steps", 0),
    ("batch-steps-above-64", _with(**{"constructors.batch_steps": 65}), "constructors.batch_steps", 65),
    # network
    ("max-message-below-2mib", _with(**{"network.max_message_bytes": 2 * MiB - 1}), "network.max_message_bytes", 2 * MiB - 1),
    ("rpc-timeout-zero", _with(**{"network.rpc_timeout_s": 0}), "network.rpc_timeout_s", 0.0),
    ("rpc-timeout-negative", _with(**{"network.rpc_timeout_s": -1.5}), "network.rpc_timeout_s", -1.5),
    ("rpc-timeout-nan", _with(**{"network.rpc_timeout_s": NAN}), "network.rpc_timeout_s", NAN),
    # seed
    ("seed-negative", _with(seed=-1), "seed", -1),
    ("seed-too-large", _with(seed=2**63), "seed", 2**63),
]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


@pytest.mark.parametrize(("mutate", "field", "value"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_configuration_names_field_and_value(mutate: Callable[[dict[str, Any]], None], field: str, value: Any) -> None:
    data = _base()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        job_from_mapping(data)
    err = info.value
    assert err.field == field
    assert _same(err.value, value), f"value {err.value!r} != {value!r}"
    message = str(err)
    assert message.startswith(f"{field}: ")
    assert repr(err.value) in message


def test_the_base_configuration_is_valid() -> None:
    # The table above is only meaningful if the unmutated base is accepted.
    job = job_from_mapping(_base())
    assert job.source_names == ("web", "code")


def test_unknown_field_suggests_the_nearest_name() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'seed'\?") as info:
        job_from_mapping({**_base(), "sed": 3})
    assert info.value.problem.startswith("unknown field")
    with pytest.raises(ConfigError, match=r"did you mean 'microbatches'\?"):
        job_from_mapping({**_base(), "batch": {"microbatch": 2}})
    with pytest.raises(ConfigError, match=r"did you mean 'transform'\?"):
        data = _base()
        data["sources"][0]["tranform"] = "m:f"
        job_from_mapping(data)


def test_unknown_field_without_a_near_name_lists_the_public_fields() -> None:
    with pytest.raises(ConfigError) as info:
        job_from_mapping({**_base(), "zzzzzzzz": 1})
    problem = info.value.problem
    assert "did you mean" not in problem
    assert "known fields:" in problem
    for name in ("job", "sources", "seed", "epochs", "mixture", "network", "run_dir"):
        assert name in problem
    assert "base_dir" not in problem  # internal, not offered to users


def test_global_batch_size_message_names_the_product() -> None:
    data = _base()
    _with(**{"mesh.dp": 4, "batch.microbatches": 2, "batch.global_batch_size": 7})(data)
    with pytest.raises(ConfigError, match=r"= 8"):
        job_from_mapping(data)


def test_weight_for_unknown_source_lists_the_sources() -> None:
    data = _base()
    data["mixture"] = {"weights": {"wbe": 1}}
    with pytest.raises(ConfigError) as info:
        job_from_mapping(data)
    assert "web" in info.value.problem and "code" in info.value.problem


@pytest.mark.parametrize(
    "mutate",
    [
        _with(**{"network.max_message_bytes": 2 * MiB}),
        _with(**{"mesh.dp": 4, "batch.microbatches": 2, "batch.global_batch_size": 8}),
        _with(**{"loaders.count": 2}),
        _with(**{"loaders.count": 1}),
        _with(seed=2**63 - 1),
        _with(seed=0),
        _with(**{"mixture.weights": {"web": 0, "code": 0.5}}),
        _with(**{"balance.cost.kind": "linear", "balance.cost.linear": 0, "balance.cost.quadratic": 0}),
        _with(**{"balance.cost.kind": "mypkg.costs:fn"}),
        _with(**{"balance.cost.linear": 1, "balance.cost.quadratic": 0}),
        _source(0, name="web-2.en_x"),
        _source(0, transform="pkg.mod:fn", transform_args={"k": [1, 2]}, columns=["a", "b"]),
        _with(**{"batch.token_dtype": "int32"}),
        _with(**{"balance.method": "round_robin"}),
        _with(**{"balance.method": "greedy"}),
    ],
)
def test_boundary_values_are_accepted(mutate: Callable[[dict[str, Any]], None]) -> None:
    data = _base()
    mutate(data)
    assert isinstance(job_from_mapping(data), JobSettings)


def test_top_level_must_be_a_mapping() -> None:
    for data in ([], None, "job: x"):
        with pytest.raises(ConfigError) as info:
            job_from_mapping(data)
        assert info.value.field == "(top level)"
        assert info.value.value == data


def test_defaults_of_a_minimal_config() -> None:
    job = job_from_mapping({"job": "j", "sources": [{"name": "a", "path": "p"}]})
    (src,) = job.sources
    assert (src.name, src.path, src.token_column, src.transform, dict(src.transform_args), src.columns) == (
        "a",
        "p",
        "input_ids",
        None,
        {},
        None,
    )
    assert job.seed == 0
    assert job.epochs == 1
    assert dict(job.mixture.weights) == {}
    assert job.weights == (1.0,)
    assert (job.batch.global_batch_size, job.batch.microbatches) == (32, 1)
    assert (job.batch.pad_id, job.batch.ignore_id, job.batch.token_dtype) == (0, -100, "int64")
    assert job.mesh.dp == 1
    assert job.balance.method == "karmarkar_karp"
    assert (job.balance.cost.kind, job.balance.cost.linear, job.balance.cost.quadratic) == ("quadratic", 0.0, 1.0)
    assert job.loaders.count is None and job.loader_count == 1
    assert job.loaders.read_ahead_samples == 4096
    assert job.loaders.buffer_bytes == 512 * MiB
    assert job.loaders.shuffle.enabled is True and job.loaders.shuffle.window_row_groups == 4
    assert job.constructors.ranks_per_constructor == 1 and job.constructors.prefetch_steps == 2
    assert job.constructors.batch_steps is None and job.batch_steps == 8
    assert job.network.host == "127.0.0.1"
    assert job.network.max_message_bytes == 4 * MiB
    assert job.network.rpc_timeout_s == 30.0
    assert job.run_dir == ".batchplane/run"
    assert job.base_dir == "."


def test_numbers_are_converted_to_float_where_floats_are_expected() -> None:
    data = _base()
    _with(**{"mixture.weights": {"web": 2}, "network.rpc_timeout_s": 5, "balance.cost.linear": 3})(data)
    job = job_from_mapping(data)
    assert job.weights == (2.0, 1.0)
    assert isinstance(job.mixture.weights["web"], float)
    assert isinstance(job.network.rpc_timeout_s, float) and job.network.rpc_timeout_s == 5.0
    assert isinstance(job.balance.cost.linear, float)


def test_settings_are_frozen() -> None:
    job = job_from_mapping(_base())
    with pytest.raises(AttributeError):
        job.seed = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        job.batch.microbatches = 3  # type: ignore[misc]


def test_epochs_infinite_gives_none() -> None:
    job = job_from_mapping({**_base(), "epochs": "infinite"})
    assert job.epochs is None
    assert job_from_mapping({**_base(), "epochs": 3}).epochs == 3


def test_job_from_mapping_does_not_mutate_its_input() -> None:
    data = {**_base(), "epochs": "infinite"}
    before = copy.deepcopy(data)
    job_from_mapping(data)
    assert data == before


# ---- files ---------------------------------------------------------------------------------


def _write(path: pathlib.Path, data: Any) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_relative_paths_resolve_against_the_config_folder(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "conf"
    data = _base()
    data["sources"][0]["path"] = "data/web.parquet"
    data["sources"][1]["path"] = str(tmp_path / "abs" / "code")
    data["run_dir"] = "run"
    data["epochs"] = "infinite"
    _write(conf / "job.yaml", data)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    job = load_job(pathlib.Path("..") / "conf" / "job.yaml")

    assert pathlib.Path(job.base_dir).is_absolute()
    assert pathlib.Path(job.base_dir) == conf.resolve()
    assert job.epochs is None
    assert job.resolve(job.sources[0].path) == conf.resolve() / "data" / "web.parquet"
    assert job.resolve(job.sources[1].path) == tmp_path / "abs" / "code"
    assert job.resolve(job.run_dir) == conf.resolve() / "run"


def test_base_dir_in_yaml_is_refused_as_an_unknown_field(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path / "job.yaml", {**_base(), "base_dir": "/somewhere/else"})
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert info.value.field == "base_dir"
    assert info.value.value == "/somewhere/else"


def test_an_empty_epochs_is_refused_rather_than_read_as_infinite() -> None:
    with pytest.raises(ConfigError) as info:
        job_from_mapping({**_base(), "epochs": None})
    assert info.value.field == "epochs"


def test_source_names_may_start_with_a_digit() -> None:
    data = _base()
    data["sources"] = [{**data["sources"][0], "name": "2023-web.v2"}]
    assert job_from_mapping(data).sources[0].name == "2023-web.v2"


def test_missing_file_names_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert info.value.field == str(path)
    assert "cannot read" in info.value.problem
    assert str(path) in str(info.value)


def test_invalid_yaml_names_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("job: [unclosed\nsources: {\n")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert info.value.field == str(path)
    assert "not valid YAML" in info.value.problem
    assert "\n" not in str(info.value)


def test_yaml_that_is_not_a_mapping_is_rejected(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert info.value.field == "(top level)"
    assert info.value.value == ["a", "b"]


def test_validation_errors_from_a_file_name_the_field(tmp_path: pathlib.Path) -> None:
    data = _base()
    data["mixture"] = {"weights": {"web": -1}}
    path = _write(tmp_path / "job.yaml", data)
    with pytest.raises(ConfigError, match=r"^mixture\.weights\.web: must be a finite number >= 0, got -1\.0$"):
        load_job(path)


# ---- loaders and constructors ----------------------------------------------------------------


def _job(num_sources: int, *, loaders: int | None = None, dp: int = 1, ranks_per_constructor: int = 1) -> JobSettings:
    data: dict[str, Any] = {
        "job": "j",
        "sources": [{"name": f"s{i}", "path": f"p{i}"} for i in range(num_sources)],
        "mesh": {"dp": dp},
        "batch": {"global_batch_size": dp},
        "constructors": {"ranks_per_constructor": ranks_per_constructor},
    }
    if loaders is not None:
        data["loaders"] = {"count": loaders}
    return job_from_mapping(data)


def test_loader_assignment_examples() -> None:
    job = _job(5, loaders=2)
    assert job.loader_count == 2
    assert job.loader_sources(0) == (0, 2, 4)
    assert job.loader_sources(1) == (1, 3)
    assert [job.loader_of(i) for i in range(5)] == [0, 1, 0, 1, 0]
    one_each = _job(3)
    assert one_each.loader_count == 3
    assert [one_each.loader_sources(i) for i in range(3)] == [(0,), (1,), (2,)]
    single = _job(4, loaders=1)
    assert single.loader_sources(0) == (0, 1, 2, 3)


def test_constructor_assignment_examples() -> None:
    job = _job(1, dp=5, ranks_per_constructor=2)
    assert job.constructor_count == 3
    assert [job.constructor_ranks(i) for i in range(3)] == [(0, 1), (2, 3), (4,)]
    wide = _job(1, dp=3, ranks_per_constructor=8)
    assert wide.constructor_count == 1
    assert wide.constructor_ranks(0) == (0, 1, 2)
    per_rank = _job(1, dp=4)
    assert per_rank.constructor_count == 4
    assert [per_rank.constructor_ranks(i) for i in range(4)] == [(0,), (1,), (2,), (3,)]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_sources=st.integers(1, 40))
def test_every_source_is_served_by_exactly_one_loader(data: st.DataObject, num_sources: int) -> None:
    count = data.draw(st.none() | st.integers(1, num_sources))
    job = _job(num_sources, loaders=count)
    # By default one group per source up to 8: a job of many sources shares loader processes.
    assert job.loader_count == (count if count is not None else min(num_sources, 8))
    served = [k for i in range(job.loader_count) for k in job.loader_sources(i)]
    assert sorted(served) == list(range(num_sources))
    for i in range(job.loader_count):
        assert job.loader_sources(i), f"loader {i} serves nothing"
        for k in job.loader_sources(i):
            assert job.loader_of(k) == i


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 20), per=st.integers(1, 24))
def test_every_rank_is_served_by_exactly_one_constructor(dp: int, per: int) -> None:
    job = _job(1, dp=dp, ranks_per_constructor=per)
    assert job.constructor_count == math.ceil(dp / per)
    served = [r for i in range(job.constructor_count) for r in job.constructor_ranks(i)]
    assert served == list(range(dp))
    for i in range(job.constructor_count):
        ranks = job.constructor_ranks(i)
        assert 1 <= len(ranks) <= per
    assert job.constructor_ranks(job.constructor_count) == ()


# ---- fingerprint -----------------------------------------------------------------------------


def _fingerprint_base() -> dict[str, Any]:
    data = _base()
    data.update(
        seed=7,
        mixture={"weights": {"web": 2.0, "code": 1.0}},
        batch={"global_batch_size": 16, "microbatches": 2},
        mesh={"dp": 2},
        balance={"method": "karmarkar_karp"},
        run_dir="run-a",
        network={"host": "127.0.0.1", "max_message_bytes": 4 * MiB, "rpc_timeout_s": 30},
    )
    return data


def test_fingerprint_is_stable_across_loads(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path / "job.yaml", _fingerprint_base())
    first, second = load_job(path), load_job(path)
    assert first.fingerprint == second.fingerprint
    assert len(first.fingerprint) == 16
    int(first.fingerprint, 16)  # hex
    # Another folder holding the same configuration plans the same sequence.
    other = load_job(_write(tmp_path / "sub" / "job.yaml", _fingerprint_base()))
    assert other.fingerprint == first.fingerprint


@pytest.mark.parametrize(
    "mutate",
    [
        _with(seed=8),
        _with(**{"mixture.weights": {"web": 3.0, "code": 1.0}}),
        _with(**{"batch.global_batch_size": 18}),
        _with(**{"mesh.dp": 4}),
        _with(**{"balance.method": "greedy"}),
        _with(**{"balance.method": "round_robin"}),
    ],
    ids=["seed", "weight", "global_batch_size", "dp", "greedy", "round_robin"],
)
def test_fingerprint_changes_with_planned_fields(mutate: Callable[[dict[str, Any]], None]) -> None:
    data = _fingerprint_base()
    mutate(data)
    assert job_from_mapping(data).fingerprint != job_from_mapping(_fingerprint_base()).fingerprint


@pytest.mark.parametrize(
    "mutate",
    [
        _with(run_dir="somewhere/else"),
        _with(**{"network.host": "0.0.0.0"}),
        _with(**{"network.max_message_bytes": 64 * MiB}),
        _with(**{"network.rpc_timeout_s": 1.5}),
    ],
    ids=["run_dir", "host", "max_message_bytes", "rpc_timeout_s"],
)
def test_fingerprint_ignores_run_dir_and_network(mutate: Callable[[dict[str, Any]], None]) -> None:
    data = _fingerprint_base()
    mutate(data)
    assert job_from_mapping(data).fingerprint == job_from_mapping(_fingerprint_base()).fingerprint


def test_fingerprint_ignores_base_dir() -> None:
    a = job_from_mapping(_fingerprint_base(), base_dir="/a")
    b = job_from_mapping(_fingerprint_base(), base_dir="/b")
    assert a.base_dir != b.base_dir
    assert a.fingerprint == b.fingerprint


def test_a_missing_weight_is_the_same_as_weight_one() -> None:
    explicit = _base()
    explicit["mixture"] = {"weights": {"web": 2.0, "code": 1.0}}
    implicit = _base()
    implicit["mixture"] = {"weights": {"web": 2.0}}
    a, b = job_from_mapping(explicit), job_from_mapping(implicit)
    assert a.weights == b.weights == (2.0, 1.0)
    assert a.fingerprint == b.fingerprint


# ---- values the checks above must also catch -------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_with(**{"mixture.weights": {"web": 10**400}}), "mixture.weights.web"),
        (_with(**{"balance.cost.linear": 10**400}), "balance.cost.linear"),
        (_with(**{"network.rpc_timeout_s": 10**400}), "network.rpc_timeout_s"),
    ],
    ids=["weight", "cost-linear", "rpc-timeout"],
)
def test_an_integer_too_large_for_a_float_field_is_a_config_error(mutate: Callable[[dict[str, Any]], None], field: str) -> None:
    # YAML reads a long run of digits as an int; it must fail as a ConfigError naming the field,
    # not as an OverflowError from float().
    data = _base()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        job_from_mapping(data)
    assert info.value.field == field
    assert info.value.value == 10**400


def test_an_integer_too_large_for_a_float_field_in_a_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("job: j\nsources:\n  - {name: web, path: data}\nmixture:\n  weights:\n    web: 1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert info.value.field == "mixture.weights.web"


@pytest.mark.parametrize(
    ("token_dtype", "field", "value"),
    [
        ("int32", "batch.pad_id", 2**31),
        ("int32", "batch.ignore_id", -(2**31) - 1),
        ("int64", "batch.pad_id", 2**63),
        ("int64", "batch.ignore_id", -(2**63) - 1),
    ],
)
def test_pad_and_ignore_ids_must_fit_the_token_dtype(token_dtype: str, field: str, value: int) -> None:
    # input_ids and labels are written in token_dtype; an id that does not fit would only fail
    # later, inside a constructor, instead of at the edge.
    data = _base()
    _with(**{"batch.token_dtype": token_dtype, field: value})(data)
    with pytest.raises(ConfigError) as info:
        job_from_mapping(data)
    assert info.value.field == field
    assert info.value.value == value


@pytest.mark.parametrize(
    ("token_dtype", "pad_id", "ignore_id"),
    [("int32", 2**31 - 1, -(2**31)), ("int64", 2**63 - 1, -(2**63)), ("int32", 0, -100)],
)
def test_pad_and_ignore_ids_at_the_token_dtype_limits_are_accepted(token_dtype: str, pad_id: int, ignore_id: int) -> None:
    data = _base()
    data["batch"] = {"token_dtype": token_dtype, "pad_id": pad_id, "ignore_id": ignore_id}
    job = job_from_mapping(data)
    assert (job.batch.pad_id, job.batch.ignore_id) == (pad_id, ignore_id)


def test_loader_groups_assign_sources_by_name() -> None:
    data = _base()
    data["sources"].append({"name": "chat", "path": "data/chat"})
    data["loaders"] = {"groups": [["chat", "web"], ["code"]]}
    job = job_from_mapping(data)
    assert job.loader_count == 2
    assert [job.loader_of(k) for k in range(3)] == [0, 1, 0]
    assert job.loader_sources(0) == (0, 2) and job.loader_sources(1) == (1,)


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_a_bad_repeat_says_it_must_be_an_integer_of_at_least_1(value: Any) -> None:
    data = _base()
    data["sources"][1]["repeat"] = value
    with pytest.raises(ConfigError, match=r"^sources\[1\]\.repeat: must be an integer >= 1, got "):
        job_from_mapping(data)


def test_repeat_multiplies_a_sources_passes_and_stream_end() -> None:
    data = _base()
    data["sources"][1]["repeat"] = 3
    job = job_from_mapping({**data, "epochs": 2})
    assert [s.repeat for s in job.sources] == [1, 3]
    assert (job.passes(0), job.passes(1)) == (2, 6)
    assert (job.stream_end(0, 10), job.stream_end(1, 10), job.stream_end(1, None)) == (20, 60, None)
    endless = job_from_mapping({**data, "epochs": "infinite"})
    assert (endless.passes(1), endless.stream_end(1, 10)) == (None, None)


def test_repeat_is_part_of_the_data_fingerprint_only_when_set() -> None:
    base = job_from_mapping(_fingerprint_base())
    one = _fingerprint_base()
    one["sources"][0]["repeat"] = 1
    two = _fingerprint_base()
    two["sources"][0]["repeat"] = 2
    assert job_from_mapping(one).fingerprints == base.fingerprints  # jobs written before `repeat` keep theirs
    assert job_from_mapping(two).fingerprints["data"] != base.fingerprints["data"]


def test_on_change_refuses_by_default_and_declaring_a_change_keeps_every_fingerprint() -> None:
    data = _fingerprint_base()
    base = job_from_mapping(data)
    assert [s.on_change for s in base.sources] == ["refuse"] * len(base.sources)
    data["sources"][0]["on_change"] = "restart"
    declared = job_from_mapping(data)
    assert declared.sources[0].on_change == "restart"
    assert declared.fingerprints == base.fingerprints, "declaring a change is no change of the data settings"
    data["sources"][0]["on_change"] = "Restart"
    with pytest.raises(ConfigError, match=r"^sources\[0\]\.on_change: must be one of \('refuse', 'restart'\), got 'Restart'$"):
        job_from_mapping(data)


@pytest.mark.parametrize(
    ("settings", "steps"),
    [
        ({}, 8),
        ({"constructors": {"batch_steps": 3}}, 3),
        ({"mixture": {"schedule": {"kind": "adaptive", "adaptive": {"initial": {"a": 1}, "delay_steps": 4}}}}, 1),
        (
            {
                "mixture": {"schedule": {"kind": "adaptive", "adaptive": {"initial": {"a": 1}, "delay_steps": 20}}},
                "constructors": {"batch_steps": 4},
            },
            4,
        ),
        ({"batch": {"delivery": "journal"}}, 1),
    ],
)
def test_a_getbatch_call_carries_eight_steps_unless_the_mixture_adapts_or_the_journal_delivers(settings: dict, steps: int) -> None:
    """`JobSettings.batch_steps`: an adaptive mixture plans each step from the reports of the
    ones before (steps handed ahead would make planning wait for training), and the journal's
    consumer serves one step per call; a setting wins."""
    job = job_from_mapping({"job": "t", "sources": [{"name": "a", "path": "a"}], **settings})
    assert job.batch_steps == steps


@pytest.mark.parametrize(
    ("network", "refused"),
    [
        ({"tls": False}, False),  # 127.0.0.1, the default
        ({"tls": False, "host": "::1"}, False),
        ({"tls": False, "host": "127.0.0.2"}, False),
        ({"tls": False, "host": "localhost"}, False),
        ({"tls": False, "host": "0.0.0.0"}, True),
        ({"tls": False, "host": "10.1.2.3"}, True),
        ({"tls": False, "host": "trainer-0.example"}, True),
        ({"tls": False, "host": "0.0.0.0", "insecure": True}, False),
        ({"host": "0.0.0.0"}, False),  # TLS on
    ],
)
def test_plaintext_is_refused_where_other_machines_reach_it_unless_said_to_be_meant(network: dict, refused: bool) -> None:
    """Issue 41, point 4: `network.tls: off` on an address other machines reach lets anyone who
    reaches a port act as any part; it takes `network.insecure: true` to say it is meant."""
    data = {**_base(), "network": network}
    if not refused:
        assert job_from_mapping(data).network.tls is network.get("tls", True)
        return
    with pytest.raises(ConfigError, match=r"^network.host: is an address other machines reach while network.tls is off") as caught:
        job_from_mapping(data)
    assert "network.insecure: true" in str(caught.value) and repr(network["host"]) in str(caught.value)
