"""The README's metrics table names every metric family each part registers, with its labels,
and nothing else: a new series cannot go undocumented, a renamed one cannot stay documented."""

from __future__ import annotations

import pathlib
import re

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.core.rpc import ServerMetrics
from batchplane.loader.metrics import LoaderMetrics
from batchplane.operator.metrics import OperatorMetrics
from batchplane.planner.metrics import PlannerMetrics

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def registered(*metric_sets: object) -> dict[str, set[str]]:
    """Family name (counters with `_total`) -> label names of the metrics held by `metric_sets`:
    metric objects, and custom collectors by the families they describe."""
    out = {}
    for metrics in metric_sets:
        for value in vars(metrics).values():
            if isinstance(value, MetricWrapperBase):
                out[value._name + ("_total" if value._type == "counter" else "")] = set(value._labelnames)
            elif callable(getattr(value, "describe", None)) and callable(getattr(value, "collect", None)):
                for family in value.describe():
                    out[family.name + ("_total" if family.type == "counter" else "")] = set(family._labelnames)
    return out


PARTS = {
    "planner": lambda: registered(
        PlannerMetrics(CollectorRegistry(), source_names=["a"], target_weights=[1.0]), ServerMetrics("planner", CollectorRegistry())
    ),
    "loader": lambda: registered(LoaderMetrics(CollectorRegistry()), ServerMetrics("loader", CollectorRegistry())),
    "constructor": lambda: registered(ConstructorMetrics(CollectorRegistry()), ServerMetrics("constructor", CollectorRegistry())),
    "operator": lambda: registered(OperatorMetrics(CollectorRegistry())),
}


def documented(part: str) -> dict[str, set[str]]:
    """The README metrics table's row of `part`: `noun_unit{label,...}` entries, where
    `a_{x,y}_b` stands for a_x_b and a_y_b."""
    row = re.search(rf"^\| {part} \| (.*) \|$", README.read_text(), re.M)
    assert row, f"README.md's metrics table has no row for {part}"
    out = {}
    for entry in re.findall(r"`([^`]+)`", row.group(1)):
        m = re.fullmatch(r"(.+?)(?:\{([a-z_,]+)\})?", entry)
        name, labels = m.group(1), set(filter(None, (m.group(2) or "").split(",")))
        choice = re.search(r"\{([^}]*)\}", name)
        for n in [name[: choice.start()] + x + name[choice.end() :] for x in choice.group(1).split(",")] if choice else [name]:
            out[f"batchplane_{part}_{n}"] = labels
    return out


@pytest.mark.parametrize("part", sorted(PARTS))
def test_the_readme_metrics_table_matches_what_each_part_registers(part: str) -> None:
    code, doc = PARTS[part](), documented(part)
    assert sorted(set(code) - set(doc)) == [], f"registered by the {part} but missing from README.md's metrics table"
    assert sorted(set(doc) - set(code)) == [], f"in README.md's metrics table but not registered by the {part}"
    drift = {name: (sorted(doc[name]), sorted(code[name])) for name in code if doc[name] != code[name]}
    assert drift == {}, f"labels in README.md (first) differ from the {part}'s (second)"


def test_the_table_reader_expands_choices() -> None:
    assert {"batchplane_planner_mixture_weight_ratio", "batchplane_planner_mixture_drift_ratio"} <= set(documented("planner"))
    assert documented("planner")["batchplane_planner_mixture_weight_ratio"] == {"source"}
