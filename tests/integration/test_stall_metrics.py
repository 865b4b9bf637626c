"""A stall is counted while it happens (issue 40): with every loader frozen (SIGSTOP) for 20 s,
the constructor's metrics, scraped in the middle of the freeze, show the rank waiting since the
trainer began to wait and its wait counter rising; once the loaders go on, the batch's
"data_wait_s" is what the trainer's own clock measured around `next()`, and the rank is no longer
waiting. Real processes: `batchplane up`'s data plane, an in-process client as the trainer."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from harness import running_cluster, scrape, skewed_lengths, wait_until, write_job, write_source

from batchplane.client import Client

pytestmark = pytest.mark.integration

FREEZE_S = 20.0
WAITING = 'batchplane_constructor_rank_waiting_since_timestamp_seconds{rank="0"}'
COUNTED = 'batchplane_constructor_rank_data_wait_seconds_total{rank="0"}'


def test_a_frozen_loader_shows_as_a_wait_growing_while_it_lasts(tmp_path, monkeypatch) -> None:
    sources = [write_source(tmp_path / "data", "a", skewed_lengths(400, seed=3), seed=3)]
    config = write_job(
        tmp_path / "job.yaml",
        sources,
        batch={"global_batch_size": 4, "microbatches": 1, "token_dtype": "int32"},
        mesh={"dp": 1},
        constructors={"prefetch_steps": 2, "fetch_steps": 1},
    )
    with running_cluster(config) as cluster:
        monkeypatch.setenv("BATCHPLANE_ENDPOINTS", str(cluster.endpoints_path))
        constructor = next(p for p in cluster.processes if p.name == "constructor-0")
        metrics = f"http://{cluster.job.network.host}:{constructor.metrics_port}/metrics"
        with Client(rank=0, timeout_s=120) as client:
            batches = iter(client)
            for _ in range(3):
                next(batches)
            waits: list[tuple[float, float]] = []  # (the batch's data_wait_s, the trainer's own measure)

            def trainer() -> None:  # takes batches until one made it wait through the freeze
                while not waits or waits[-1][1] < FREEZE_S / 2:
                    begin = time.monotonic()
                    batch = next(batches)
                    waits.append((batch["data_wait_s"], time.monotonic() - begin))

            frozen = [p.pid for p in cluster.loaders]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            froze_at = time.time()
            thread = threading.Thread(target=trainer, daemon=True)
            try:
                thread.start()
                wait_until(lambda: scrape(metrics).get(WAITING, 0) > 0, timeout_s=FREEZE_S / 2, what="the rank to show as waiting")
                first = scrape(metrics)
                time.sleep(4.0)
                second = scrape(metrics)
                assert time.time() < froze_at + FREEZE_S, "both scrapes fell inside the freeze"
                since = second[WAITING]
                assert abs(since - first[WAITING]) < 0.5, "the same wait (its start as each report of it says)"
                assert froze_at - 1.0 <= since <= time.time() - 4.0, "begun during the freeze"
                assert second[COUNTED] - first[COUNTED] >= 2.0, "the counter grows while the wait lasts"
                time.sleep(max(froze_at + FREEZE_S - time.time(), 0.0))
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)
            thread.join(timeout=120)
            assert not thread.is_alive() and waits, "the trainer got its batch once the loaders went on"
            reported, measured = waits[-1]
            assert measured > FREEZE_S / 2
            assert abs(reported - measured) < 1.0, f"data_wait_s {reported:.2f} s, the trainer's clock {measured:.2f} s"
            wait_until(lambda: scrape(metrics).get(WAITING, 1) == 0, timeout_s=10, what="the rank to stop waiting")
            after = scrape(metrics)[COUNTED]
            assert after >= sum(reported for reported, _ in waits) - 1.0
            print(
                f"loaders frozen {FREEZE_S:.0f} s: mid-stall the rank shows a wait begun {since - froze_at:.1f} s into the freeze, counter "
                f"{first[COUNTED]:.1f} -> {second[COUNTED]:.1f} s in 4 s; after: counter {after:.1f} s, data_wait_s {reported:.2f} s "
                f"vs the trainer's {measured:.2f} s"
            )
