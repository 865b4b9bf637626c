"""Content you can trust (issue 41, point 5), with real processes and mutual TLS: a compromised
replica of a loader group, registered with real loader credentials, summarizes its windows
honestly but sends constructors other tokens for the positions planned from it. Each
constructor finds the samples' digests differ from the plan's, counts them and reports the
replica with its next plan request; the planner fences it (its sibling serves its windows, it
may not register again), and the step is fetched again from the sibling. No altered token
reaches a trainer: the real clients receive every row of the job exactly once, each equal to
the row written to Parquet."""

from __future__ import annotations

import collections
import json
import pathlib
import re
import signal
import subprocess
import sys

import pytest
from harness import assert_rows_as_written, collect, running_cluster, sample_ids, scrape, wait_until, write_job, write_source

from batchplane.core.identity import Identity

pytestmark = pytest.mark.integration

ROGUE = pathlib.Path(__file__).resolve().parent / "rogue_loader.py"


def _start_rogue(cluster, run_dir: pathlib.Path) -> tuple[subprocess.Popen, dict, pathlib.Path]:
    """Starts the rogue as replica "rogue" of loader group 0, with a certificate of that
    identity from the run's CA; returns the process, its ready file's contents and its log."""
    ready, log_path = run_dir / ".rogue.ready", run_dir / "logs" / "rogue.log"
    tls = cluster.ca.issue(Identity("loader", 0, "rogue"), cluster.tls_dir / "rogue")
    command = [
        sys.executable,
        str(ROGUE),
        *("--config", str(cluster.config_path), "--ready-file", str(ready), "--exit-with-parent", "--log-level", "INFO"),
        *("--index", "0", "--replica", "rogue", "--planner", cluster.planner.address, "--tls-dir", str(tls)),
    ]
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    wait_until(lambda: ready.exists() or process.poll() is not None, timeout_s=60, what="the rogue replica to serve")
    assert process.poll() is None, log_path.read_text()[-3000:]
    return process, json.loads(ready.read_text()), log_path


def test_a_rogue_replica_is_detected_by_digest_fenced_and_no_altered_token_reaches_a_trainer(tmp_path: pathlib.Path) -> None:
    sources = [
        write_source(tmp_path / "data", "a", [6 + i % 9 for i in range(240)], files=2, row_group_size=10, seed=1),
        write_source(tmp_path / "data", "b", [4 + i % 5 for i in range(80)], files=1, row_group_size=10, seed=2),
    ]
    batch = {"global_batch_size": 8, "microbatches": 1, "token_dtype": "int32"}
    job = write_job(tmp_path / "job.yaml", sources, batch=batch, loaders={"read_ahead_samples": 40, "shuffle": {"window_row_groups": 1}})
    with running_cluster(job) as cluster:
        # Before the trainers start: the planner routes the group's windows over both replicas
        # from the first on, so the rogue owns every other window of both sources.
        rogue, ready, rogue_log = _start_rogue(cluster, tmp_path / "run")
        try:
            got, _ = collect(cluster.endpoints_path, [0, 1])
            # Its next heartbeat (it registers again every network.heartbeat_s) is refused.
            refused = "refuses this loader: replica 'rogue' of loader group 0 was fenced"
            wait_until(lambda: refused in rogue_log.read_text(), timeout_s=30, what="the rogue's registration refused, saying why")
            host = cluster.job.network.host
            sent = scrape(f"http://{host}:{ready['metrics_port']}/metrics")
            found = [scrape(f"http://{host}:{p.metrics_port}/metrics") for p in cluster.constructors]
            planner = scrape(f"http://{host}:{cluster.planner.metrics_port}/metrics")
            constructor_logs = "".join(p.log_path.read_text() for p in cluster.constructors)
            planner_log = cluster.planner.log_path.read_text()
        finally:
            rogue.send_signal(signal.SIGTERM)
            rogue.wait(timeout=30)
    address = ready["address"]
    served = sum(v for k, v in sent.items() if k.startswith("batchplane_loader_samples_sent_total"))
    assert served > 0, "the rogue served altered samples"
    key = f'batchplane_constructor_digest_mismatches_total{{address="{address}",group="0"}}'
    assert sum(metrics.get(key, 0) for metrics in found) > 0, [{k: v for k, v in m.items() if "digest" in k} for m in found]
    assert planner['batchplane_planner_loader_fences_total{group="0"}'] == 1
    assert f"loader replica at {address} (group 0) sent" in constructor_logs and "differs from the plan's digests" in constructor_logs
    assert re.search(rf"loader replica 'rogue' of group 0 at {re.escape(address)} sent constructor \d altered samples", planner_log)
    assert "fenced; replica '0' serves its windows" in planner_log
    # Every row of the job reached the trainers exactly once, and as written.
    assert [b["step"] for b in got[0]] == [b["step"] for b in got[1]]
    delivered = collections.Counter(s for rank in (0, 1) for step in sample_ids(got[rank]) for mb in step for s in mb)
    assert set(delivered) == {(k, r) for k, s in enumerate(sources) for r in range(len(s.rows))} and max(delivered.values()) == 1
    assert assert_rows_as_written(got, sources) == sum(len(s.rows) for s in sources)
