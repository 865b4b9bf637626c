"""What operators watch, as the chart ships it: the PrometheusRule (templates/monitoring/
prometheusrule.yaml) and the Grafana dashboard (dashboards/batchplane.json).

- Every series a rule or a panel reads is one a batchplane process exports: the names in their
  PromQL are checked against the registries the services build (their metrics modules, the
  request metrics of core.rpc and the default collectors and build info of core.metrics), each
  with the samples its type exposes (a counter's _total, a histogram's _bucket/_sum/_count), and
  the labels they group or select by against the metrics' own labels plus the scrape's target
  labels. `up` is Prometheus's own.
- The PrometheusRule renders only when asked, with its extra labels; its rule groups pass
  `promtool check rules`, and `promtool test rules` feeds each alert the series it watches and
  checks it fires with the right labels (and that the quiet series next to it do not).
- The dashboard reads replicas from the operator's own metrics (no kube-state-metrics) and the
  data wait per rank, and has panels for the alerts' series and each process's memory and CPU.

promtool comes with Debian's prometheus package (`make test` installs it); without it the
promtool tests fail, saying so. helm as in test_helm_chart.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from test_helm_chart import CHART, NAMESPACE, RELEASE, all_of, helm, run_helm, template  # noqa: F401 - helm is a fixture

from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.core.metrics import BuildInfo, process_registry
from batchplane.core.rpc import ServerMetrics
from batchplane.loader.metrics import LoaderMetrics
from batchplane.operator.metrics import OperatorMetrics
from batchplane.planner.metrics import PlannerMetrics

pytestmark = pytest.mark.integration

FULLNAME = f"{RELEASE}-batchplane"
#: Labels a scrape attaches (Kubernetes service discovery, the ServiceMonitor's relabeling).
TARGET_LABELS = {"namespace", "pod", "instance", "job", "service", "endpoint", "container", "component"}
#: Samples each metric type exposes, by suffix.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
    "summary": ("_sum", "_count", "_created"),
    "info": ("_info",),
}
#: Series Prometheus itself makes.
PROMETHEUS_SERIES = {"up": set()}
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "increase", "irate", "abs", "absent", "histogram_quantile", "by", "without",
    "on", "ignoring", "group_left", "group_right", "or", "and", "unless", "bool", "clamp_min", "topk", "offset", "time",
}  # fmt: skip


def exported_series() -> dict[str, set[str]]:
    """Every sample name a batchplane process can expose -> the labels it carries."""
    registries = []
    for part in ("planner", "loader", "constructor", "operator"):
        registry = process_registry(part, BuildInfo())
        if part == "planner":
            PlannerMetrics(registry, source_names=["web"], target_weights=[1.0])
        elif part == "loader":
            LoaderMetrics(registry)
        elif part == "constructor":
            ConstructorMetrics(registry)
        else:
            OperatorMetrics(registry)
        if part != "operator":
            ServerMetrics(part, registry)
        registries.append(registry)
    out: dict[str, set[str]] = {}
    for registry in registries:
        for collector in list(registry._collector_to_names):  # noqa: SLF001 - the label names of metrics without samples yet
            labels = set(getattr(collector, "_labelnames", ()))
            for family in collector.collect():
                labels |= set(getattr(family, "_labelnames", ()))  # a custom collector's families name theirs
                names = {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
                names |= {s.name for s in family.samples}
                for name in names:
                    extra = {"le"} if name.endswith("_bucket") else set()
                    out.setdefault(name, set()).update(labels | extra | {k for s in family.samples if s.name == name for k in s.labels})
    return out


def referenced(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses (enough PromQL for ours)."""
    text = re.sub(r'"[^"]*"', '""', expr)  # no names inside strings
    labels = set()
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        labels |= {label.strip() for label in clause.split(",") if label.strip()}
    for selector in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    names = {n for n in re.findall(r"(?<![\w$])([a-zA-Z_:][a-zA-Z0-9_:]*)", text) if n not in PROMQL_WORDS}
    return names, labels


def check_exprs(exprs: list[str], where: str) -> set[str]:
    """Fails unless every expression names exported series and their labels; returns the names."""
    known = {**exported_series(), **PROMETHEUS_SERIES}
    used: set[str] = set()
    problems = []
    for expr in exprs:
        names, labels = referenced(expr)
        assert names, f"{where}: no metric in {expr!r}"
        used |= names
        missing = sorted(n for n in names if n not in known)
        if missing:
            problems.append(f"{missing} in {expr!r}")
            continue
        available = set().union(*(known[n] for n in names)) | TARGET_LABELS
        if not labels <= available:
            problems.append(f"labels {sorted(labels - available)} of none of {sorted(names)} in {expr!r}")
    assert problems == [], f"{where} reads series no batchplane process exports:\n" + "\n".join(problems)
    return used


def test_the_expression_check_can_fail() -> None:
    """The check itself: it finds a misspelled metric and a label the metric does not have."""
    assert referenced('sum by (rank) (rate(batchplane_constructor_rank_data_wait_seconds_total{namespace="x"}[5m]))') == (
        {"batchplane_constructor_rank_data_wait_seconds_total"},
        {"rank", "namespace"},
    )
    with pytest.raises(AssertionError, match="batchplane_planner_mixture_drift"):
        check_exprs(["batchplane_planner_mixture_drift{namespace='x'}"], "probe")
    with pytest.raises(AssertionError, match=r"labels \['source'\]"):
        check_exprs(["sum by (source) (batchplane_planner_step)"], "probe")
    assert check_exprs(
        ["up == 0", "process_resident_memory_bytes * on (pod, instance) group_left (part) batchplane_build_info"], "probe"
    ) == {
        "up",
        "process_resident_memory_bytes",
        "batchplane_build_info",
    }


# ---- the PrometheusRule ----------------------------------------------------------------------------


def render_rule(helm_path: pathlib.Path, *args: str) -> dict[str, Any]:
    docs = template(helm_path, "--set", "prometheusRule.enabled=true", *args)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return rule


#: The subset of monitoring.coreos.com/v1 PrometheusRule the chart uses, with the API's field
#: names (no CRD of the prometheus-operator is available offline).
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "rules": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "required": ["alert", "expr", "labels", "annotations"],
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^Batchplane[A-Za-z]+$"},
                                        "expr": {"type": "string"},
                                        "for": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"},
                                        "labels": {
                                            "type": "object",
                                            "required": ["severity"],
                                            "properties": {"severity": {"enum": ["critical", "warning", "info"]}},
                                        },
                                        "annotations": {
                                            "type": "object",
                                            "required": ["summary", "description"],
                                            "additionalProperties": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

ALERTS = {
    "BatchplaneRankDataWait", "BatchplaneRankStalled", "BatchplaneBatchesStopped", "BatchplaneMixtureDrift", "BatchplanePlannerDown", "BatchplaneBadSamples", "BatchplaneLoaderFailover",
    "BatchplaneShadowTakeover", "BatchplaneOperatorReconcileErrors", "BatchplaneOperatorNoLeader",
}  # fmt: skip


def test_the_prometheus_rule_renders_when_asked(helm: pathlib.Path) -> None:  # noqa: F811 - the fixture
    import jsonschema

    assert not [d for d in template(helm) if d["kind"] == "PrometheusRule"]  # off by default, as the ServiceMonitor
    rule = render_rule(helm, "--set", "prometheusRule.additionalLabels.release=kube-prometheus-stack")
    jsonschema.validate(rule, PROMETHEUS_RULE_SCHEMA)
    assert rule["metadata"]["namespace"] == NAMESPACE and rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"]["app.kubernetes.io/component"] == "monitoring"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    check_exprs([r["expr"] for r in rules], "the PrometheusRule")
    exprs = {r["alert"]: r["expr"] for r in rules}
    assert (
        "rate(batchplane_constructor_rank_data_wait_seconds_total" in exprs["BatchplaneRankDataWait"]
        and "> 0.1" in exprs["BatchplaneRankDataWait"]
    )
    assert (
        f'up{{namespace="{NAMESPACE}", pod=~"{FULLNAME}-planner-.*"}} == 0' in exprs["BatchplanePlannerDown"]
        and "absent(up{" in exprs["BatchplanePlannerDown"]
    )
    assert "batchplane_planner_shadow_promotions_total" in exprs["BatchplaneShadowTakeover"]
    # Thresholds and the waiting time come from the values; without the operator, no operator alerts.
    tuned = render_rule(
        helm,
        "--set-json",
        "prometheusRule.mixtureDrift=0.2",
        "--set",
        "prometheusRule.for=30m",
        "--set",
        "operator.enabled=false",  # its operator pods are the issuer alone: no reconcile errors, no leader
    )
    tuned_rules = {r["alert"]: r for g in tuned["spec"]["groups"] for r in g["rules"]}
    assert set(tuned_rules) == ALERTS - {"BatchplaneOperatorReconcileErrors", "BatchplaneOperatorNoLeader"}
    assert tuned_rules["BatchplaneMixtureDrift"]["expr"].endswith("> 0.2") and tuned_rules["BatchplaneMixtureDrift"]["for"] == "30m"


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("prometheusRule.dataWaitRatio=0", "dataWaitRatio"),
        ("prometheusRule.for=soon", "for"),
        ("prometheusRule.mixtureDrift=2", "mixtureDrift"),
    ],
)
def test_the_schema_refuses_bad_rule_values(helm: pathlib.Path, value: str, field: str) -> None:  # noqa: F811 - the fixture
    result = run_helm(helm, "template", RELEASE, CHART, "--namespace", NAMESPACE, "--set", "prometheusRule.enabled=true", "--set", value)
    assert result.returncode != 0 and field in result.stderr, result.stderr


def find_promtool() -> str:
    path = shutil.which("promtool") or ("/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None)
    if path is None:
        pytest.fail(
            "promtool is missing: `sudo apt-get install -y prometheus` (Debian's package ships it; `make test` installs it)", pytrace=False
        )
    return path


def rule_file(helm_path: pathlib.Path, folder: pathlib.Path, *, annotations: bool = True) -> pathlib.Path:
    """The rendered rule groups as a Prometheus rule file (what the prometheus-operator loads)."""
    groups = render_rule(helm_path)["spec"]["groups"]
    if not annotations:  # promtool's unit tests compare annotations exactly; their templates are checked by `check rules`
        groups = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]} for g in groups]
    path = folder / ("rules.yaml" if annotations else "rules-bare.yaml")
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def test_promtool_checks_the_rules(helm: pathlib.Path, tmp_path: pathlib.Path) -> None:  # noqa: F811 - the fixture
    promtool = find_promtool()
    done = subprocess.run([promtool, "check", "rules", str(rule_file(helm, tmp_path))], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout
    broken = tmp_path / "broken.yaml"  # promtool does fail on a bad expression
    broken.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "X", "expr": "sum by (rank (up)"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, timeout=60).returncode != 0


PLANNER = f'namespace="{NAMESPACE}", pod="{FULLNAME}-planner-5d9f-abcde"'
OPERATOR = f'namespace="{NAMESPACE}", pod="{FULLNAME}-operator-7c8d-fghij"'


def test_each_alert_fires_on_the_series_it_watches(helm: pathlib.Path, tmp_path: pathlib.Path) -> None:  # noqa: F811 - the fixture
    """promtool's unit tests: one minute between samples; each alert's series and a quiet one."""
    promtool = find_promtool()
    rules = rule_file(helm, tmp_path, annotations=False)
    series = [
        # rank 3 waits 30 s every minute (half its time), rank 4 one second a minute
        (f'batchplane_constructor_rank_data_wait_seconds_total{{namespace="{NAMESPACE}", pod="trainer-1", rank="3"}}', "0+30x40"),
        (f'batchplane_constructor_rank_data_wait_seconds_total{{namespace="{NAMESPACE}", pod="trainer-1", rank="4"}}', "0+1x40"),
        # rank 3 waits for one batch from minute 20 on (since 1200 s past the epoch); rank 4 waits a
        # few seconds each minute (a new wait each time), never long
        (
            f'batchplane_constructor_rank_waiting_since_timestamp_seconds{{namespace="{NAMESPACE}", pod="trainer-1", rank="3"}}',
            "0x19 1200x20",
        ),
        (f'batchplane_constructor_rank_waiting_since_timestamp_seconds{{namespace="{NAMESPACE}", pod="trainer-1", rank="4"}}', "0+60x40"),
        # batches are served until minute 20, then none
        (f'batchplane_constructor_batches_sent_total{{namespace="{NAMESPACE}", pod="trainer-1"}}', "0+10x20 200x20"),
        (f'batchplane_planner_mixture_drift_ratio{{{PLANNER}, source="code"}}', "-0.08x40"),
        (f'batchplane_planner_mixture_drift_ratio{{{PLANNER}, source="web"}}', "0.01x40"),
        # the planner is scraped until minute 10, then not at all (its series vanish)
        (f"up{{{PLANNER}}}", "1x10"),
        (f'batchplane_planner_samples_total{{{PLANNER}, source="web"}}', "0+600x40"),
        (f'batchplane_planner_bad_samples_total{{{PLANNER}, source="web"}}', "0+30x40"),  # 5 % bad
        (f'batchplane_planner_samples_total{{{PLANNER}, source="code"}}', "0+600x40"),
        (f'batchplane_planner_bad_samples_total{{{PLANNER}, source="code"}}', "0+1x40"),
        (f'batchplane_planner_loader_failures_total{{{PLANNER}, group="text"}}', "0x20 1x20"),
        (f'batchplane_planner_loader_failures_total{{{PLANNER}, group="code"}}', "0x40"),
        (f'batchplane_planner_shadow_promotions_total{{{PLANNER}, group="text"}}', "0x20 1x20"),
        (f'batchplane_operator_reconcile_errors_total{{{OPERATOR}, reason="metrics"}}', "0+2x40"),
        (f'batchplane_operator_reconcile_errors_total{{{OPERATOR}, reason="api"}}', "0x40"),
        (f"batchplane_operator_leader{{{OPERATOR}}}", "0x40"),
    ]
    planner_labels = {"namespace": NAMESPACE, "pod": f"{FULLNAME}-planner-5d9f-abcde"}
    expected = {
        "BatchplaneRankDataWait": [{"severity": "warning", "namespace": NAMESPACE, "pod": "trainer-1", "rank": "3"}],
        "BatchplaneRankStalled": [{"severity": "warning", "namespace": NAMESPACE, "pod": "trainer-1", "rank": "3"}],
        "BatchplaneBatchesStopped": [{"severity": "critical", "namespace": NAMESPACE}],
        "BatchplaneMixtureDrift": [{"severity": "warning", **planner_labels, "source": "code"}],
        "BatchplanePlannerDown": [{"severity": "critical", "namespace": NAMESPACE}],  # absent(): the equality matchers' labels
        "BatchplaneBadSamples": [{"severity": "warning", "namespace": NAMESPACE, "source": "web"}],
        "BatchplaneLoaderFailover": [{"severity": "warning", "namespace": NAMESPACE, "group": "text"}],
        "BatchplaneShadowTakeover": [{"severity": "info", "namespace": NAMESPACE, "group": "text"}],
        "BatchplaneOperatorReconcileErrors": [{"severity": "warning", "namespace": NAMESPACE, "reason": "metrics"}],
        "BatchplaneOperatorNoLeader": [{"severity": "warning", "namespace": NAMESPACE}],
    }
    assert set(expected) == ALERTS
    early = {"BatchplaneLoaderFailover", "BatchplaneShadowTakeover"}  # they fire at once, and not before the failure
    alert_tests = [
        {"eval_time": "30m", "alertname": a, "exp_alerts": [{"exp_labels": labels} for labels in exp]}
        for a, exp in expected.items()
        if a not in early
    ]
    alert_tests += [{"eval_time": "25m", "alertname": a, "exp_alerts": [{"exp_labels": expected[a][0]}]} for a in sorted(early)]
    alert_tests += [{"eval_time": "15m", "alertname": a, "exp_alerts": []} for a in sorted(early)]
    alert_tests += [{"eval_time": "8m", "alertname": "BatchplanePlannerDown", "exp_alerts": []}]  # still scraped
    alert_tests += [{"eval_time": "9m", "alertname": "BatchplaneRankDataWait", "exp_alerts": []}]  # not for 10m yet
    alert_tests += [{"eval_time": "21m", "alertname": "BatchplaneRankStalled", "exp_alerts": []}]  # waiting 1 minute: not yet
    alert_tests += [{"eval_time": "25m", "alertname": "BatchplaneBatchesStopped", "exp_alerts": []}]  # 5 minutes without: not yet
    unit = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series], "alert_rule_test": alert_tests}],
    }
    tests = tmp_path / "rules-test.yaml"
    tests.write_text(yaml.safe_dump(unit, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # ... and fails when an alert does not fire as expected.
    unit["tests"][0]["alert_rule_test"] = [{"eval_time": "30m", "alertname": "BatchplaneMixtureDrift", "exp_alerts": []}]
    tests.write_text(yaml.safe_dump(unit, sort_keys=False))
    assert subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, timeout=120).returncode != 0


# ---- the dashboard ---------------------------------------------------------------------------------


def dashboard(helm_path: pathlib.Path) -> dict[str, Any]:
    (configmap,) = [d for d in all_of(template(helm_path), "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    ((_, text),) = configmap["data"].items()
    return json.loads(text)


def test_the_dashboard_reads_only_exported_series(helm: pathlib.Path) -> None:  # noqa: F811 - the fixture
    board = dashboard(helm)
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    used = check_exprs(exprs, "the dashboard")
    assert not any(n.startswith("kube_") for n in used)  # replicas come from the operator itself
    titles = {p["title"]: [t["expr"] for t in p["targets"]] for p in board["panels"]}
    replicas = " ".join(titles["Loader replicas per source group"])
    assert "batchplane_operator_replicas{" in replicas and "batchplane_operator_desired_replicas{" in replicas
    variables = {v["name"]: v.get("query") for v in board["templating"]["list"]}
    assert (
        'dataplane="$dataplane"' in replicas and variables["dataplane"] == FULLNAME
    )  # the operator labels its gauges with the DataPlane's name
    assert variables["namespace"] == NAMESPACE
    wait = " ".join(titles["Data wait per rank"])
    assert "sum by (rank) (rate(batchplane_constructor_rank_data_wait_seconds_total" in wait
    assert "batchplane_constructor_batch_wait_seconds" not in " ".join(exprs)  # the per-pod histogram gave way to per-rank
    assert "process_resident_memory_bytes" in " ".join(titles["Process memory (resident)"])
    assert "rate(process_cpu_seconds_total" in " ".join(titles["Process CPU"])
    # Every series an alert reads is on the dashboard.
    rule_series = {n for r in render_rule(helm)["spec"]["groups"][0]["rules"] for n in referenced(r["expr"])[0]}
    assert rule_series <= used, f"alerts whose series no panel shows: {sorted(rule_series - used)}"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    grid = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in board["panels"]}
    assert len(grid) == len(board["panels"])  # no two panels on top of each other
