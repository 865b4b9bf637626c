"""Tests of loading a job's mixture schedule (`planner.strategy.load_schedule`): every kind from
YAML, errors that name the field, a callable imported by path, the strategy's fixed mix, the
fingerprint group a schedule belongs to, and the mixture allocator that runs it
(`planner.strategy.job_mixture`)."""

from __future__ import annotations

import pathlib
import textwrap
from typing import Any

import pytest

from batchplane.core.config import job_from_mapping
from batchplane.core.errors import ConfigError
from batchplane.core.schedule import Curriculum, FromCallable, Staged, Static
from batchplane.planner.strategy import job_mixture, load_schedule, load_strategy


def _job(mixture: dict[str, Any] | None = None, **extra: Any):
    data: dict[str, Any] = {"job": "t", "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}], **extra}
    if mixture is not None:
        data["mixture"] = mixture
    return job_from_mapping(data)


def _load(job):
    return load_schedule(job, load_strategy(job))


def test_without_a_schedule_the_weights_are_static() -> None:
    loaded = _load(_job({"weights": {"a": 3}}))
    assert isinstance(loaded.schedule, Static) and loaded.granularity == "step"
    assert loaded.initial_shares == (0.75, 0.25)


def test_a_staged_schedule_from_yaml_changes_at_its_stage_starts() -> None:
    loaded = _load(
        _job(
            {
                "schedule": {
                    "kind": "staged",
                    "granularity": "microbatch",
                    "stages": [
                        {"start": 0, "weights": {"a": 1, "b": 0}},
                        {"start": 5, "weights": {"a": 1, "b": 3}},
                    ],
                }
            }
        )
    )
    assert isinstance(loaded.schedule, Staged) and loaded.granularity == "microbatch"
    assert loaded.schedule.weights_at(4.99) == (1.0, 0.0) and loaded.schedule.weights_at(5.0) == (1.0, 3.0)
    assert loaded.initial_shares == (1.0, 0.0)


def test_a_curriculum_interpolates_between_anchors() -> None:
    loaded = _load(
        _job(
            {
                "schedule": {
                    "kind": "curriculum",
                    "anchors": [
                        {"step": 0, "weights": {"a": 1, "b": 0}},
                        {"step": 10, "weights": {"a": 0, "b": 1}},
                    ],
                }
            }
        )
    )
    assert isinstance(loaded.schedule, Curriculum)
    assert loaded.schedule.weights_at(5) == pytest.approx((0.5, 0.5))


def test_a_callable_is_imported_by_path(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_mixing.py").write_text(
        textwrap.dedent("""
        def weights(t):
            return {"a": 1.0, "b": 1.0 + t}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = _load(_job({"schedule": {"kind": "callable", "callable": "my_mixing:weights"}}))
    assert isinstance(loaded.schedule, FromCallable)
    assert loaded.schedule.weights_at(3) == (1.0, 4.0)


@pytest.mark.parametrize(
    ("mixture", "field", "problem"),
    [
        ({"schedule": {"kind": "stepped"}}, "mixture.schedule.kind", "must be one of"),
        (
            {"schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {}}, {"start": 0, "weights": {}}]}},
            "mixture.schedule.stages[1].start",
            "increasing",
        ),
        (
            {"schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {"c": 1}}]}},
            "mixture.schedule.stages[0].weights.c",
            "names no source",
        ),
        (
            {"schedule": {"kind": "curriculum", "anchors": [{"step": 0, "weights": {"a": -1}}]}},
            "mixture.schedule.anchors[0].weights.a",
            ">= 0",
        ),
        ({"schedule": {"kind": "static", "granularity": "token"}}, "mixture.schedule.granularity", "must be one of"),
        ({"schedule": {"kind": "callable", "callable": "no_such_module_here:f"}}, "mixture.schedule.callable", "no_such_module_here"),
        ({"schedule": {"kind": "callable", "callable": "math:pi"}}, "mixture.schedule.callable", "not callable"),
        ({"schedule": {"kind": "callable", "callable": "math:sqrt"}}, "mixture.schedule", "math:sqrt"),
        (
            {"weights": {"a": 2}, "schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {}}]}},
            "mixture.weights",
            "cannot be combined",
        ),
    ],
    ids=[
        "kind",
        "stage-order",
        "stage-source",
        "anchor-weight",
        "granularity",
        "module",
        "not-callable",
        "bad-result",
        "weights-and-stages",
    ],
)
def test_a_bad_schedule_is_a_config_error_naming_the_field(mixture: dict, field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(_job(mixture))
    assert caught.value.field == field
    assert problem in str(caught.value)


def test_a_strategy_mix_cannot_be_combined_with_a_changing_schedule(tmp_path: pathlib.Path) -> None:
    (tmp_path / "mixing.py").write_text(
        textwrap.dedent("""
        from batchplane.planner import DGraph
        def strategy(mesh):
            g = DGraph("text")
            g.mix({"a": 2, "b": 1})
            g.distribute(axis="DP")
            return g.plan()
    """)
    )
    staged = {"schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {}}, {"start": 4, "weights": {"a": 0}}]}}
    job = job_from_mapping(
        {"job": "t", "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}], "strategy": "mixing.py", "mixture": staged},
        base_dir=tmp_path,
    )
    with pytest.raises(ConfigError, match="text.mix sets fixed weights, but mixture.schedule changes them") as caught:
        _load(job)
    assert caught.value.field == "strategy"
    static = job_from_mapping(
        {"job": "t", "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}], "strategy": "mixing.py"}, base_dir=tmp_path
    )
    assert _load(static).initial_shares == pytest.approx((2 / 3, 1 / 3))


def test_a_schedule_changes_only_the_mixture_fingerprint() -> None:
    plain = _job({"weights": {"a": 1}})
    staged = _job({"schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {"a": 1}}, {"start": 9, "weights": {"b": 0}}]}})
    later = _job({"schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {"a": 1}}, {"start": 10, "weights": {"b": 0}}]}})
    changed = {k for k in plain.fingerprints if plain.fingerprints[k] != staged.fingerprints[k]}
    assert changed == {"mixture"}
    assert staged.fingerprints["mixture"] != later.fingerprints["mixture"]


@pytest.mark.parametrize("epochs", [2, "infinite"])
def test_the_jobs_mixture_runs_its_schedule_over_its_batch_and_ends_each_stream_after_its_passes(epochs: int | str) -> None:
    """`job_mixture`, as the planner builds it once every loader has registered: source b
    repeats 3 times an epoch; a source whose rows are not known yet has no end."""
    job = job_from_mapping(
        {
            "job": "t",
            "sources": [{"name": "a", "path": "a"}, {"name": "b", "path": "b", "repeat": 3}, {"name": "c", "path": "c"}],
            "epochs": epochs,
            "batch": {"global_batch_size": 12, "microbatches": 3},
            "mixture": {"schedule": {"kind": "staged", "granularity": "microbatch", "stages": [{"start": 0, "weights": {"a": 2}}]}},
        }
    )
    schedule = _load(job)
    mixture = job_mixture(job, schedule, num_rows=[100, 10, None])
    assert mixture.stream_ends == ((200, 60, None) if epochs == 2 else (None, None, None))
    assert (mixture.schedule, mixture.granularity, mixture.microbatches) == (schedule.schedule, "microbatch", 3)
    assert mixture.global_batch_size == 12
