"""Prometheus metrics of the planner, named batchplane_planner_<noun>_<unit>."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchplane.planner.balance import spread
from batchplane.planner.ledger import Ledger
from batchplane.planner.mixture import Allocation
from batchplane.planner.plan import StepPlan

log = logging.getLogger(__name__)


class PlannerMetrics:
    """The planner's metrics, registered on its own registry.

    Args:
        registry: The planner's registry.
        source_names: Sources in job order.
        target_weights: Normalized weight per source at step 0.
    """

    def __init__(self, registry: CollectorRegistry, *, source_names: Sequence[str], target_weights: Sequence[float]) -> None:
        self._names = tuple(source_names)
        self.steps = Counter("batchplane_planner_steps_planned_total", "Steps planned.", registry=registry)
        self.step = Gauge(
            "batchplane_planner_step",
            "The latest planned step of the job (absolute: it continues across planner restarts and resumes).",
            registry=registry,
        )
        self.start_step = Gauge(
            "batchplane_planner_start_step",
            "The step this planner process started planning at: 0 for a fresh job; past 0 when it resumed the job "
            "(a restart, from the ledger, or a trainer's checkpoint).",
            registry=registry,
        )
        self.rewinds = Counter(
            "batchplane_planner_rewinds_total",
            "Times the plan sequence went back to an earlier step because a trainer restarted from an older checkpoint "
            "than the plans the planner kept (re-planned from the ledger).",
            registry=registry,
        )
        self.loader_restarts = Counter(
            "batchplane_planner_loader_restarts_total",
            "Loader replicas that registered again as a new process (a failure recovered from), by loader group.",
            ["group"],
            registry=registry,
        )
        self.loader_failures = Counter(
            "batchplane_planner_loader_failures_total",
            "Loader replicas declared failed (consecutive failed health probes or summary requests), by loader group.",
            ["group"],
            registry=registry,
        )
        self.malformed_responses = Counter(
            "batchplane_planner_malformed_responses_total",
            "Answers of loader replicas refused as malformed (a summary that is not what was asked: wrong start, too many "
            "samples, unequal lengths, rows outside the source, a false end of stream), by loader group; each also counts "
            "as a failed observation of the replica.",
            ["group"],
            registry=registry,
        )
        self.fences = Counter(
            "batchplane_planner_loader_fences_total",
            "Loader replicas fenced because a constructor found samples they sent that differ from the plan's digests "
            "(another replica of the group serves their windows; they may not register again), by loader group.",
            ["group"],
            registry=registry,
        )
        self.promotions = Counter(
            "batchplane_planner_shadow_promotions_total",
            "Shadow loaders promoted to serve in place of a failed replica, by loader group.",
            ["group"],
            registry=registry,
        )
        self.adoptions = Counter(
            "batchplane_planner_loader_adoptions_total",
            "Failed loader replicas without a shadow whose windows another replica of the group took over, by loader group.",
            ["group"],
            registry=registry,
        )
        self.failover_seconds = Histogram(
            "batchplane_planner_failover_seconds",
            "Recovery time of a failover: from a replica's first failed observation until its shadow was promoted.",
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30),
        )
        self.plan_latency = Histogram(
            "batchplane_planner_plan_duration_seconds",
            "Time to plan one step once its sample metadata is known (mixing, costing, balancing, ledger).",
            registry=registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )
        self.ledger_write_steps = Histogram(
            "batchplane_planner_ledger_write_steps",
            "Steps whose records one ledger write holds (the steps planned in one go; one object, one PUT on a bucket).",
            registry=registry,
            buckets=(1, 2, 4, 8, 16, 32),
        )
        self.ledger_write_seconds = Histogram(
            "batchplane_planner_ledger_write_seconds",
            "Time of one ledger write, durable (flushed to disk, or the PUT answered); its steps wait for it to be served.",
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 4),
        )
        self.summary_wait = Counter(
            "batchplane_planner_summary_wait_seconds_total",
            "Time the planning thread waited for loaders' buffer summaries (data starvation).",
            registry=registry,
        )
        self.samples = Counter(
            "batchplane_planner_samples_total",
            "Samples planned, bad ones included, by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.tokens = Counter(
            "batchplane_planner_tokens_total", "Tokens planned, by source (the source's name).", ["source"], registry=registry
        )
        self.bad_samples = Counter(
            "batchplane_planner_bad_samples_total",
            "Planned samples left out as bad (reported by loaders with length 0), by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.weight = Gauge(
            "batchplane_planner_mixture_weight_ratio",
            "Share of samples the schedule gives each source at the latest planned step (renormalized over the sources "
            "that still have data), by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.target = Gauge(
            "batchplane_planner_mixture_target_ratio",
            "Target share of planned samples since the planner started: what the schedule asked for, step by step "
            "(shares renormalize over the sources that still have data), by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.realized = Gauge(
            "batchplane_planner_mixture_realized_ratio",
            "Realized share of planned samples since the planner started, by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.realized_tokens = Gauge(
            "batchplane_planner_mixture_realized_token_ratio",
            "Realized share of planned tokens since the planner started, by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.drift = Gauge(
            "batchplane_planner_mixture_drift_ratio",
            "Realized minus target share of samples since the planner started (the target being what the schedule "
            "asked for, step by step), by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.configured_drift = Gauge(
            "batchplane_planner_mixture_configured_drift_ratio",
            "Realized minus configured share of samples since the planner started, by source (the source's name): the "
            "configured share is what the schedule's weights give over every source they weigh, sources that have run "
            "out included, so a source that ran out in a finite job shows here (negative), where the drift against the "
            "renormalized target stays 0.",
            ["source"],
            registry=registry,
        )
        self.substitutions = Counter(
            "batchplane_planner_substitutions_total",
            "Bad samples replaced by the next good sample of their source (batch.bad_samples.policy substitute), by "
            "source and the reason the loader gave: unreadable, transform, rejected, empty, too_long, unknown",
            ["source", "reason"],
            registry=registry,
        )
        self.exhausted = Counter(
            "batchplane_planner_source_exhausted_total",
            "Sources whose stream ended (all epochs x repeat passes taken) in a step this planner planned, by source "
            "(the source's name): 1 from that step on (once per planner process, also across rewinds), 0 before.",
            ["source"],
            registry=registry,
        )
        self._exhausted: set[int] = set()
        self.imbalance = Gauge(
            "batchplane_planner_rank_cost_imbalance_ratio",
            "Max over min per-rank cost of the last planned step under the configured balancing: the cost of each "
            "rank's microbatches as built, padding included unless the job packs.",
            registry=registry,
        )
        for name, weight in zip(self._names, target_weights):
            self.target.labels(name).set(weight)  # until the first step is planned
            self.weight.labels(name).set(weight)
            self.exhausted.labels(name)  # exported as 0 until the source runs out
        # Each source's children of the per-source metrics, resolved once: `labels` takes a lock
        # and builds a key on every call, nine times per source and step otherwise.
        self._per_source = [
            _SourceChildren(
                samples=self.samples.labels(name),
                tokens=self.tokens.labels(name),
                bad_samples=self.bad_samples.labels(name),
                weight=self.weight.labels(name),
                realized=self.realized.labels(name),
                realized_tokens=self.realized_tokens.labels(name),
                target=self.target.labels(name),
                drift=self.drift.labels(name),
                configured_drift=self.configured_drift.labels(name),
            )
            for name in self._names
        ]

    def observe_step(
        self,
        allocation: Allocation | None,
        plan: StepPlan,
        ledger: Ledger,
        *,
        waited_s: float,
        planned_s: float,
        counts: Sequence[int] | None = None,
    ) -> None:
        """Records one planned step: `counts` samples of each source (the seqs it consumed, bad
        ones included; default: the allocation's); `allocation`: what the mixture allocated to
        it (None: nothing of its own, see `Ledger.record`)."""
        counts = allocation.counts if counts is None else counts
        self.steps.inc()
        self.step.set(plan.step)
        self.plan_latency.observe(planned_s)
        self.summary_wait.inc(waited_s)
        good = np.bincount(plan.samples.source, minlength=len(self._names))
        tokens = np.bincount(plan.samples.source, weights=plan.samples.length, minlength=len(self._names))
        total = sum(t.samples for t in ledger.sources) or 1
        total_tokens = sum(t.tokens for t in ledger.sources) or 1
        shares = allocation.shares if allocation is not None else None
        good, tokens = good.tolist(), tokens.tolist()
        for k, child in enumerate(self._per_source):
            if counts[k]:
                child.samples.inc(counts[k])
                child.tokens.inc(int(tokens[k]))
                child.bad_samples.inc(counts[k] - good[k])
            totals = ledger.sources[k]
            if shares:
                child.weight.set(shares[k])
            child.realized.set(totals.samples / total)
            child.realized_tokens.set(totals.tokens / total_tokens)
            child.target.set(totals.target_samples / total)
            child.drift.set((totals.samples - totals.target_samples) / total)
            child.configured_drift.set((totals.samples - totals.configured_samples) / total)
        if allocation is not None:
            self._observe_exhausted(allocation)
        max_over_min, _ = spread(plan.built_rank_costs())
        if np.isfinite(max_over_min):
            self.imbalance.set(max_over_min)

    def _observe_exhausted(self, allocation: Allocation) -> None:
        """Logs and counts each source that ran out in `allocation`'s step, once per source."""
        for k in allocation.exhausted:
            if k in self._exhausted:
                continue
            self._exhausted.add(k)
            self.exhausted.labels(self._names[k]).inc()
            log.info(
                "source %r ran out at step %d (its last sample is in this step); from step %d on the other sources share "
                "its places, so the mixture differs from the configured one (batchplane_planner_mixture_configured_drift_ratio)",
                self._names[k],
                allocation.step,
                allocation.step + 1,
            )


@dataclasses.dataclass(frozen=True)
class _SourceChildren:
    """One source's children of the planner's per-source metrics."""

    samples: Counter
    tokens: Counter
    bad_samples: Counter
    weight: Gauge
    realized: Gauge
    realized_tokens: Gauge
    target: Gauge
    drift: Gauge
    configured_drift: Gauge
