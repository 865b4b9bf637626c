"""The operator's local backend (batchplane.launcher.autoscale.LocalAutoscaler) on a simulated
clock, with a scripted Prometheus and a cluster that only keeps its list of loaders: replicas
started after a weight rises and the newest asked to leave after it falls, at the intervals the
policy says; a scale-down that waits out the cooldown; an interval Prometheus cannot answer;
replicas counted from the cluster (shadows left out); `run` stepping on its clock. What needs
real processes (a replica that joins and serves) is tests/integration/test_local_autoscaling.py."""

from __future__ import annotations

import dataclasses

import pytest

from batchplane.launcher.autoscale import Interval, LocalAutoscaler
from batchplane.operator.policy import GroupSpec, ScalingSettings
from batchplane.operator.prometheus import PrometheusError

THROUGHPUT = 120.0  # samples/s
COST = 2.4 / THROUGHPUT  # a's group needs 1 replica at weight 1/4 (need 0.72), 3 at 7/8 (need 2.52)
SCALING = ScalingSettings(window_intervals=2, consecutive_intervals=2, up_threshold=0.05, down_threshold=0.15, cooldown_s=2.0, headroom=0.2)
LOW, HIGH = {"a": 0.25, "b": 0.75}, {"a": 0.875, "b": 0.125}


@dataclasses.dataclass
class Process:
    """A loader process as the autoscaler sees it: its name."""

    name: str


class Cluster:
    """A running job's loaders, started and asked to leave at once; records what was done."""

    def __init__(self, *names: str) -> None:
        self.loaders = [Process(n) for n in names]
        self.started = 0
        self.done: list[str] = []

    def add_loader(self, index: int) -> Process:
        self.started += 1
        process = Process(f"loader-{index}-{self.started}")
        self.loaders.append(process)
        self.done.append(f"+{process.name}")
        return process

    def remove_loader(self, process: Process) -> None:
        self.loaders.remove(process)
        self.done.append(f"-{process.name}")


class Prometheus:
    """Answers each interval with the weights its script gives for that interval (None: an
    error), a constant throughput and one step a second."""

    def __init__(self, script: list[dict[str, float] | None]) -> None:
        self.script = script
        self.interval = -1

    def mixture_weights(self, job: str | None = None) -> dict[str, float]:
        self.interval += 1
        weights = self.script[self.interval]
        if weights is None:
            raise PrometheusError("http://prometheus", "batchplane_planner_mixture_weight_ratio", "connection refused")
        return weights

    def sample_rate(self, window_s: float = 30.0, job: str | None = None) -> dict[str, float]:
        return {"a": THROUGHPUT / 2, "b": THROUGHPUT / 2}  # only the sum counts

    def steps_planned(self, job: str | None = None) -> float | None:
        return float(self.interval)

    def step_rate(self, window_s: float = 30.0, job: str | None = None) -> float | None:
        return 1.0


def specs(scaling: ScalingSettings = SCALING) -> dict[int, GroupSpec]:
    return {
        0: GroupSpec("a", ("a",), {"a": COST}, min_replicas=1, max_replicas=3, scaling=scaling),
        1: GroupSpec("b", ("b",), {"b": COST / 10}, min_replicas=1, max_replicas=1, scaling=scaling),
    }


def run(
    script: list[dict[str, float] | None], *, scaling: ScalingSettings = SCALING, cluster: Cluster | None = None
) -> tuple[list[Interval | None], Cluster]:
    """One step per simulated second (t = 1, 2, ...) over `script`; the rows and the cluster."""
    cluster = cluster or Cluster("loader-0", "loader-1")
    autoscaler = LocalAutoscaler(cluster, Prometheus(script), specs(scaling), job="job", rate_window_s=3.0)  # type: ignore[arg-type]
    return [autoscaler.step(float(t)) for t in range(1, len(script) + 1)], cluster


def replicas_of_a(rows: list[Interval | None]) -> list[int]:
    return [row.groups[0][1] for row in rows if row is not None]


def test_replicas_start_the_second_interval_after_a_rise_and_the_newest_leave_after_the_fall() -> None:
    rise, fall = 5, 12  # intervals (0-based) where a's weight changes
    script: list[dict[str, float] | None] = [LOW] * rise + [HIGH] * (fall - rise) + [LOW] * 6
    rows, cluster = run(script)
    # The moving average of 2 intervals needs 2 intervals past the threshold (K = 2): the
    # change comes at the second interval with the new weight, straight to the target.
    assert replicas_of_a(rows) == [1] * (rise + 1) + [3] * (fall - rise) + [1] * 5
    assert cluster.done == ["+loader-0-1", "+loader-0-2", "-loader-0-2", "-loader-0-1"]  # the newest leaves first
    up, down = rows[rise + 1], rows[fall + 1]
    assert up is not None and up.t == rise + 2 and up.groups[0][:2] == (1, 3) and up.groups[0][2].startswith("up 1 -> 3: need 2.52")
    assert down is not None and down.groups[0][:2] == (3, 1) and down.groups[0][2].startswith("down 3 -> 1: need 0.72")
    assert all(row is not None and row.groups[1][:2] == (1, 1) for row in rows), "b's group stays at its one replica"
    assert rows[0] is not None and (rows[0].weights, rows[0].throughput, rows[0].step) == (LOW, THROUGHPUT, 0.0)


def test_a_fall_within_the_cooldown_waits_it_out_and_comes_right_after() -> None:
    scaling = dataclasses.replace(SCALING, cooldown_s=6.0)
    script: list[dict[str, float] | None] = [LOW] * 2 + [HIGH] * 2 + [LOW] * 8  # up at t = 4; down pending from t = 6
    rows, cluster = run(script, scaling=scaling)
    assert replicas_of_a(rows) == [1, 1, 1, 3, 3, 3, 3, 3, 3, 1, 1, 1]  # down at t = 10 = 4 + 6
    assert "down after cooldown, 1.0 s left" in rows[8].groups[0][2]  # type: ignore[union-attr]  # t = 9
    assert cluster.done == ["+loader-0-1", "+loader-0-2", "-loader-0-2", "-loader-0-1"]


def test_an_interval_prometheus_cannot_answer_is_skipped_and_changes_nothing() -> None:
    rows, cluster = run([HIGH, None, HIGH])
    assert rows[1] is None
    # The failed interval is no interval of the policy: K = 2 intervals with data, then up.
    assert replicas_of_a(rows) == [1, 3] and cluster.done == ["+loader-0-1", "+loader-0-2"]


def test_replicas_are_counted_from_the_cluster_and_shadows_are_not_replicas() -> None:
    cluster = Cluster("loader-0", "loader-0-shadow", "loader-0-7", "loader-0-8", "loader-0-9", "loader-1", "loader-1-shadow")
    rows, cluster = run([LOW], cluster=cluster)  # 4 replicas of a's group, above max_replicas 3
    assert rows[0] is not None and rows[0].groups[0][:2] == (4, 3) and rows[0].groups[0][2].startswith("bounds 4 -> 3")
    assert cluster.done == ["-loader-0-9"]
    assert [p.name for p in cluster.loaders] == ["loader-0", "loader-0-shadow", "loader-0-7", "loader-0-8", "loader-1", "loader-1-shadow"]


class Stop:
    """A stop event on a simulated clock: a wait advances the clock by its timeout and a quarter
    of a second more (a late wake-up); set after `intervals` waits."""

    def __init__(self, clock: list[float], intervals: int) -> None:
        self.clock = clock
        self.waits: list[float] = []
        self.intervals = intervals

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock[0] += timeout + 0.25
        return len(self.waits) > self.intervals


@pytest.mark.parametrize("interval_s", [1.0, 5.0])
def test_run_steps_every_interval_of_its_clock_without_drifting(interval_s: float) -> None:
    clock = [100.0]
    autoscaler = LocalAutoscaler(Cluster("loader-0", "loader-1"), Prometheus([LOW] * 4), specs(), job="job")  # type: ignore[arg-type]
    rows: list[Interval] = []
    stop = Stop(clock, intervals=4)
    autoscaler.run(stop, interval_s=interval_s, on_interval=rows.append, clock=lambda: clock[0])  # type: ignore[arg-type]
    # Each step is told the seconds since the start; a late wake-up shortens the next wait.
    assert [row.t for row in rows] == [k * interval_s + 0.25 for k in (1, 2, 3, 4)]
    assert stop.waits == [interval_s] + [interval_s - 0.25] * 4
