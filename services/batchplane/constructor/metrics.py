"""Prometheus metrics of a constructor, named batchplane_constructor_<noun>_<unit>."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from batchplane.constructor.waits import RankWaits

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ConstructorMetrics:
    """The constructor's metrics, registered on its own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches_built = Counter(
            "batchplane_constructor_batches_built_total", "Rank batches built (one per rank per step).", registry=registry
        )
        self.batches_sent = Counter("batchplane_constructor_batches_sent_total", "Rank batches streamed to clients.", registry=registry)
        self.samples_received = Counter(
            "batchplane_constructor_samples_received_total", "Samples received from loaders.", registry=registry
        )
        self.received_bytes = Counter(
            "batchplane_constructor_received_bytes_total", "Sample payload bytes received from loaders.", registry=registry
        )
        self.sent_bytes = Counter("batchplane_constructor_sent_bytes_total", "Batch payload bytes streamed to clients.", registry=registry)
        self.start_step = Gauge(
            "batchplane_constructor_start_step",
            "The step this constructor process started building at: 0 for a fresh job; past 0 when it started mid-job "
            "(a restart, or trainers resuming from a checkpoint).",
            registry=registry,
        )
        self.rewinds = Counter(
            "batchplane_constructor_rewinds_total",
            "Ranks whose trainer restarted at a step they had moved past (a rewind: building went back).",
            registry=registry,
        )
        self.prefetched_steps = Gauge(
            "batchplane_constructor_prefetched_steps",
            "Steps built ahead of the slowest rank served here, when that rank last asked.",
            registry=registry,
        )
        self.fetch_latency = Histogram(
            "batchplane_constructor_fetch_duration_seconds",
            "Time to fetch the samples of one step (and of the following steps fetched with it) from all loaders.",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.fetch_steps = Histogram(
            "batchplane_constructor_fetch_steps",
            "Steps each fetch took from its loaders: the step being built and the following ones fetched with it "
            "(constructors.fetch_steps at most).",
            registry=registry,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
        )
        self.build_latency = Histogram(
            "batchplane_constructor_build_duration_seconds",
            "Time to build one step's microbatches for all ranks served here.",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.batch_wait = Histogram(
            "batchplane_constructor_batch_wait_seconds",
            "Time each batch a client asked for waited to be ready (every step of a call that carries several; 0 when prefetch kept up).",
            registry=registry,
            buckets=(0.0001, *_LATENCY_BUCKETS),
        )
        #: The ranks' waits for data as their clients measure them (`waits`), read at each scrape.
        self.waits = WaitCollector()
        registry.register(self.waits)
        self.peer_failures = Counter(
            "batchplane_constructor_peer_failures_total",
            "Failures detected: times building a step began to fail because a part did not answer, by part "
            "(planner or loader); each counts once until a step builds again.",
            ["part"],
            registry=registry,
        )
        self.recovery = Histogram(
            "batchplane_constructor_recovery_seconds",
            "Recovery time: from the first failed attempt at a step until it was built (the failed part restarted, or another took over).",
            registry=registry,
            buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300),
        )
        self.malformed_responses = Counter(
            "batchplane_constructor_malformed_responses_total",
            "Answers of a peer that broke the wire contract (a size past what the request can take, arrays that do not "
            "agree, samples other than those asked for), by peer (planner or loader); the step is built again and the "
            "log names the peer's address.",
            ["peer"],
            registry=registry,
        )
        self.digest_mismatches = Counter(
            "batchplane_constructor_digest_mismatches_total",
            "Samples a loader replica sent whose content differs from the plan's digests (never built into a batch; the "
            "replica is reported to the planner, which fences it), by loader group and the replica's address.",
            ["group", "address"],
            registry=registry,
        )
        self.shm_slabs = Gauge(
            "batchplane_constructor_shm_slabs",
            "Shared-memory slabs allocated now (free or in use; reused, at most constructors.shm_bytes together).",
            registry=registry,
        )
        self.shm_mapped_bytes = Gauge(
            "batchplane_constructor_shm_mapped_bytes",
            "Bytes of the shared-memory slabs allocated now.",
            registry=registry,
        )
        self.shm_placements = Counter(
            "batchplane_constructor_shm_placements_total",
            "Batch payloads copied into a shared-memory slab (a slab shared by ranks served the same batch counts once).",
            registry=registry,
        )
        self.shm_fallbacks = Counter(
            "batchplane_constructor_shm_fallbacks_total",
            "Batches of a client with a shared-memory session that went over the gRPC stream instead, by reason: full "
            "(the slabs in use fill constructors.shm_bytes), too_large (one batch is past it), unknown_session (a session "
            "this constructor does not know: it restarted, or the session ended), session_lost (the fd could not be sent).",
            ["reason"],
            registry=registry,
        )
        self.shm_sessions = Gauge(
            "batchplane_constructor_shm_sessions",
            "Clients connected to the slab socket now (one per trainer process using shared memory).",
            registry=registry,
        )
        self.hook_failures = Counter(
            "batchplane_constructor_hook_failures_total",
            "Steps that could not be built because the strategy's constructor_do_plan hook raised or broke the delivery rules.",
            registry=registry,
        )
        # Journal delivery (batch.delivery: journal): the producer's writer and the consumers' readers.
        self.journal_steps_written = Counter(
            "batchplane_constructor_journal_steps_written_total",
            "Journal delivery, producer: steps written to the journal as TGB objects (committed or pending).",
            registry=registry,
        )
        self.journal_written_bytes = Counter(
            "batchplane_constructor_journal_written_bytes_total",
            "Journal delivery, producer: bytes of the TGB objects written.",
            registry=registry,
        )
        self.journal_commits = Counter(
            "batchplane_constructor_journal_commits_total",
            "Journal delivery, producer: manifest versions committed (commit attempts whose put won).",
            registry=registry,
        )
        self.journal_conflicts = Counter(
            "batchplane_constructor_journal_conflicts_total",
            "Journal delivery, producer: commit attempts that lost their race to another writer of the manifest.",
            registry=registry,
        )
        self.journal_backpressure = Counter(
            "batchplane_constructor_journal_backpressure_seconds_total",
            "Journal delivery, producer: time paused because it ran journal.max_lag_steps ahead of the lowest "
            "live checkpoint mark (the slowest pod).",
            registry=registry,
        )
        self.checkpoint_marks = Counter(
            "batchplane_constructor_checkpoint_marks_total",
            "Checkpoints trainers recorded (MarkCheckpoint); with journal delivery each keeps the pod's checkpoint mark.",
            registry=registry,
        )
        self.journal_steps_read = Counter(
            "batchplane_constructor_journal_steps_read_total",
            "Journal delivery, consumer: logical steps read from the journal for the ranks served here.",
            registry=registry,
        )
        self.journal_read_bytes = Counter(
            "batchplane_constructor_journal_read_bytes_total",
            "Journal delivery, consumer: bytes range-read from the journal (trailers, footers and slices).",
            registry=registry,
        )


class WaitCollector:
    """The ranks' waits for data, as their clients measured them (`waits.RankWaits`, under a
    lock: the servicers' threads note them, a scrape reads them), at the time of the scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits = RankWaits()

    def note(self, rank: int, *, client: str, total_s: float, waiting_s: float, now: float) -> None:
        """See `RankWaits.note`."""
        with self._lock:
            self._waits.note(rank, client=client, total_s=total_s, waiting_s=waiting_s, now=now)

    def describe(self) -> list[Metric]:
        """The families it collects, without samples (the registry checks their names)."""
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        total, longest, since = self._families()
        wall = time.time()
        with self._lock:
            waits = self._waits.snapshot(time.monotonic())
        for wait in waits:
            rank = [str(wait.rank)]
            total.add_metric(rank, wait.counted_s)
            longest.add_metric(rank, wait.longest_s)
            since.add_metric(rank, wall - wait.waiting_s if wait.waiting_s > 0 else 0.0)
        yield from (total, longest, since)

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        total = CounterMetricFamily(
            "batchplane_constructor_rank_data_wait_seconds_total",  # (exposed as it reads; the family drops "_total")
            "Time each rank's trainer waited for its batches, by rank (global rank), as its client measured it across every "
            "call and retry; it grows while a wait lasts (the client reports about once a second).",
            labels=["rank"],
        )
        longest = GaugeMetricFamily(
            "batchplane_constructor_rank_longest_data_wait_seconds",
            "The longest single wait of the rank's trainer for a batch so far, by rank (global rank).",
            labels=["rank"],
        )
        since = GaugeMetricFamily(
            "batchplane_constructor_rank_waiting_since_timestamp_seconds",
            "When the rank's trainer began waiting for the batch it waits for now (Unix time), by rank (global rank); "
            "0 when it is not waiting.",
            labels=["rank"],
        )
        return total, longest, since
