"""Prometheus metrics of a source loader, named batchplane_loader_<noun>_<unit>."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class LoaderMetrics:
    """The loader's metrics, registered on its own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.samples_read = Counter(
            "batchplane_loader_samples_read_total",
            "Samples read and transformed, by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.read_seconds = Counter(
            "batchplane_loader_read_seconds_total",
            "Time spent reading, decoding, transforming and shuffling windows, by source (the source's name): "
            "its rate over the rate of samples_read_total is the loader's cost per sample.",
            ["source"],
            registry=registry,
        )
        self.samples_replayed = Counter(
            "batchplane_loader_samples_replayed_total",
            "Samples read again because the planner or a constructor needed a window this loader did not hold: "
            "after the loader restarted (its replay of the planner's ledger), or after the planner's restart routed it "
            "other windows, by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.start_step = Gauge(
            "batchplane_loader_start_step",
            "The step from which this loader process serves a source it joined mid-job (a restart: the planner's "
            "replay of its ledger), by source (the source's name); absent for a source it served from the job's start.",
            ["source"],
            registry=registry,
        )
        self.samples_sent = Counter(
            "batchplane_loader_samples_sent_total",
            "Samples sent to constructors, by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.bytes_sent = Counter(
            "batchplane_loader_sent_bytes_total",
            "Payload bytes sent to constructors.",
            registry=registry,
        )
        self.buffer_samples = Gauge(
            "batchplane_loader_buffer_samples",
            "Samples held in the read-ahead buffer, by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.buffer_bytes = Gauge(
            "batchplane_loader_buffer_bytes",
            "Payload bytes held in the read-ahead buffer over all sources.",
            registry=registry,
        )
        self.bad_samples = Counter(
            "batchplane_loader_bad_samples_total",
            "Samples skipped as bad, by source (the source's name) and reason: unreadable (row "
            "group cannot be read or decoded), transform (the transform failed on its row group), "
            "rejected (the transform returned a null token list), empty (no tokens), too_long (longer than "
            "batch.max_length under batch.length_policy reject).",
            ["source", "reason"],
            registry=registry,
        )
        self.truncated_samples = Counter(
            "batchplane_loader_truncated_samples_total",
            "Samples cut to their first batch.max_length tokens (batch.length_policy truncate), by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.read_retries = Counter(
            "batchplane_loader_read_retries_total",
            "Reads of a remote source's row group tried again because the store failed them "
            "(unreachable, throttled, credentials refused), by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.corrupt_row_groups = Counter(
            "batchplane_loader_corrupt_row_groups_total",
            "Row groups skipped because they cannot be read or decoded, by source (the source's name).",
            ["source"],
            registry=registry,
        )
        self.fetches_refused = Counter(
            "batchplane_loader_fetches_refused_total",
            "Fetches refused before anything was read or sent, by reason: not_planned (positions the planner cannot have "
            "planned from this replica yet, answered UNAVAILABLE), too_big (a payload larger than loaders.buffer_bytes, "
            "answered RESOURCE_EXHAUSTED).",
            ["reason"],
            registry=registry,
        )
        self.following_cut = Counter(
            "batchplane_loader_following_cut_total",
            "Fetches that served fewer of the following steps they asked for (constructors.fetch_steps) than asked, by the "
            "reason of the first one left out: too_big (it would take the payload past loaders.buffer_bytes), not_ready "
            "(positions the planner has not told this replica of yet, or windows it reads again). The constructor fetches "
            "them in a later call.",
            ["reason"],
            registry=registry,
        )
        self.fetch_steps = Histogram(
            "batchplane_loader_fetch_steps",
            "Steps each FetchSamples call served (its own and the following ones; constructors.fetch_steps at most).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
            registry=registry,
        )
        self.hook_failures = Counter(
            "batchplane_loader_hook_failures_total",
            "Fetches refused because the strategy's loader_do_plan hook raised or broke the plan.",
            registry=registry,
        )
