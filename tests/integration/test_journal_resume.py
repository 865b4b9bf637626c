"""Resumes of journal delivery that carry the journal cursor in the client's state (issue 18),
with real processes: a job written at DP 2 resumes at DP 4 (two written steps per step), then
again at DP 2 from the DP 4 checkpoint, where logical and written steps no longer coincide.
The second resume goes on at the journal position the first stopped at: every sample is
delivered exactly once over the three runs, and the last run's batches are byte-identical to
the written run's batches of the same written steps. In every run each step's
`global_loss_tokens` is the loss-carrying labels of all its ranks' tensors."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    Batch,
    assert_same_batches,
    collect,
    sample_ids,
    skewed_lengths,
    start_cluster,
    wait_until,
    write_job,
    write_source,
)

from batchplane.client import Client, InvalidRequestError  # noqa: E402
from batchplane.core.storage import LocalStorage  # noqa: E402
from batchplane.journal.writer import read_end  # noqa: E402

pytestmark = pytest.mark.integration

BATCH = {"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32", "delivery": "journal"}
ROWS = 160
STEPS = ROWS // BATCH["global_batch_size"]
PODS = {"ranks_per_constructor": 2}


def _identities(batches: dict[int, list[Batch]]) -> list[tuple[int, int]]:
    return [sample for per_rank in batches.values() for step in sample_ids(per_rank) for mb in step for sample in mb]


def _assert_loss_tokens_are_the_steps(batches: dict[int, list[Batch]]) -> None:
    """Every rank's batch of a step carries the step's loss tokens: the labels that carry a loss
    in the tensors of all its ranks (ground truth no header produced)."""
    for i in range(len(batches[0])):
        counted = sum(int((mb["labels"] != -100).sum()) for per_rank in batches.values() for mb in per_rank[i]["microbatches"])
        assert {per_rank[i]["global_loss_tokens"] for per_rank in batches.values()} == {counted}, batches[0][i]["step"]


def _cursors(state: dict) -> dict[int, tuple[int, int]]:
    """A client state's journal cursors: logical step -> (written step, DP slice)."""
    return {int(step): (c["step"], c["offset"]) for step, c in json.loads(state["journal"]).items()}


def test_a_second_resume_after_a_dp_change_reads_on_from_the_checkpoints_journal_cursor(tmp_path: pathlib.Path) -> None:
    first_stop, wide_steps = 6, 2
    source = write_source(tmp_path / "data", "a", skewed_lengths(ROWS, seed=3, long=200), row_group_size=20, seed=3)

    def job(name: str, *, dp: int, journal: dict | None = None) -> pathlib.Path:
        (tmp_path / name).mkdir()
        return write_job(
            tmp_path / name / "job.yaml",
            [source],
            mesh={"dp": dp, "cp": 1},
            batch=BATCH,
            constructors=PODS,
            journal={"policy": "naive", **(journal or {})},
        )

    # Written at DP 2: the whole job, with a checkpoint after step 5 (the reference bytes too).
    cluster = start_cluster(job("written", dp=2))
    journal = cluster.run_dir / "journal"
    try:
        first, states = collect(cluster.endpoints_path, range(2), stop_after=first_stop)
        rest, _ = collect(cluster.endpoints_path, range(2), states=states)
        wait_until(lambda: read_end(LocalStorage(journal)) is not None, timeout_s=60, what="the producer to reach the end")
    finally:
        cluster.stop()
    written = {rank: first[rank] + rest[rank] for rank in range(2)}
    assert [b["step"] for b in written[0]] == list(range(STEPS))
    assert _cursors(states[0]) == {first_stop - 1: (first_stop - 1, 0), first_stop: (first_stop, 0)}

    # Resumed at DP 4 (two pods): step s reads written steps 2s - 6 and 2s - 5; a checkpoint after two steps.
    cluster = start_cluster(job("wide", dp=4, journal={"location": str(journal)}))
    try:
        for producer in cluster.producers:  # the journal holds every step: no producer needed
            producer.popen.kill()
            producer.popen.wait()
        wide, wide_states = collect(cluster.endpoints_path, range(4), states={r: states[0] for r in range(4)}, stop_after=wide_steps)
    finally:
        cluster.stop()
    resume_at = first_stop + wide_steps
    for rank in range(4):
        assert [b["step"] for b in wide[rank]] == list(range(first_stop, resume_at)), rank
    _assert_loss_tokens_are_the_steps(written)
    _assert_loss_tokens_are_the_steps(wide)  # two written steps' loss tokens, read by two pods
    after_wide = first_stop + 2 * wide_steps  # the written step the next run starts at
    assert {json.dumps(_cursors(s)) for s in wide_states.values()} == {
        json.dumps({resume_at - 1: (after_wide - 2, 0), resume_at: (after_wide, 0)})
    }

    # Resumed at DP 2 again from the DP 4 checkpoint: logical step 8 is written step 10.
    cluster = start_cluster(job("narrow", dp=2, journal={"location": str(journal)}))
    try:
        for producer in cluster.producers:
            producer.popen.kill()
            producer.popen.wait()
        narrow, _ = collect(cluster.endpoints_path, range(2), states={r: wide_states[0] for r in range(2)})
        os.environ["BATCHPLANE_ENDPOINTS"] = str(cluster.endpoints_path)
        with Client(rank=0, timeout_s=10) as client:
            for bad in ("[8]", json.dumps({"8": {"manifest_version": 1, "step": -1, "offset": 0}}), json.dumps({"x": {}})):
                with pytest.raises(InvalidRequestError, match="state_dict journal"):
                    client.load_state_dict({**wide_states[0], "journal": bad})
    finally:
        cluster.stop()
    left = STEPS - after_wide
    for rank in range(2):
        assert [b["step"] for b in narrow[rank]] == list(range(resume_at, resume_at + left)), rank
    renumbered = {rank: [{**b, "step": b["step"] - after_wide + resume_at} for b in written[rank][after_wide:]] for rank in range(2)}
    assert_same_batches(narrow, renumbered)
    _assert_loss_tokens_are_the_steps(narrow)

    delivered = collections.Counter(_identities(first) + _identities(wide) + _identities(narrow))
    repeated = sorted(sample for sample, n in delivered.items() if n > 1)
    assert not repeated, f"delivered more than once: {repeated[:20]}"
    assert set(delivered) == {(0, row) for row in range(ROWS)}
