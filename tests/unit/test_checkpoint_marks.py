"""Checkpoint marks of journal delivery: the pure pod mark (`constructor.checkpoint_marks`), the
bounds of MarkCheckpoint, which marks pace the producer, and the reclaim loop's retries."""

from __future__ import annotations

import pytest

from batchplane.constructor.bounds import MAX_STEP, check_checkpoint_request
from batchplane.constructor.checkpoint_marks import CheckpointMarks, PodMark, checkpoint_mark, counts_for_lag, start_mark
from batchplane.constructor.reclaim_loop import ReclaimLoop
from batchplane.core.errors import FailedPrecondition, InvalidArgument
from batchplane.journal.retention import RetentionPolicy, Watermark, backpressure, reclaim


def test_no_mark_until_every_holding_rank_started() -> None:
    marks = CheckpointMarks([0, 1])
    assert marks.mark() is None
    marks.handed(0, 0, restart=True)
    assert marks.mark() is None
    marks.handed(1, 0, restart=True)
    assert marks.mark() == PodMark(0, checkpointed=False)


def test_the_mark_is_the_minimum_of_latest_checkpoints_and_unchecked_starts() -> None:
    marks = CheckpointMarks([0, 1])
    for step in range(6):
        marks.handed(0, step)
        marks.handed(1, step)
    marks.checkpointed(0, 4)
    assert marks.mark() == PodMark(0, checkpointed=False)  # rank 1 holds it at its start
    marks.checkpointed(1, 5)
    assert marks.mark() == PodMark(4, checkpointed=True)
    marks.checkpointed(0, 6)  # one past the last step handed: allowed
    assert marks.mark() == PodMark(5, checkpointed=True)


def test_a_restart_forgets_the_ranks_checkpoint_and_holds_at_the_new_start() -> None:
    marks = CheckpointMarks([0])
    for step in range(8):
        marks.handed(0, step)
    marks.checkpointed(0, 8)
    marks.handed(0, 3, restart=True)  # restored from an older checkpoint
    assert marks.mark() == PodMark(3, checkpointed=False)


def test_only_holding_ranks_hold_the_mark() -> None:
    marks = CheckpointMarks([0, 1], holding=[0])
    marks.handed(0, 2, restart=True)
    assert marks.mark() == PodMark(2, checkpointed=False)
    marks.handed(1, 2, restart=True)
    marks.checkpointed(1, 3)
    marks.checkpointed(0, 3)
    assert marks.mark() == PodMark(3, checkpointed=True)
    with pytest.raises(InvalidArgument):
        CheckpointMarks([0], holding=[1])


@pytest.mark.parametrize(
    ("rank", "step", "error", "words"),
    [
        (5, 1, InvalidArgument, "not served here"),
        (0, -1, InvalidArgument, ">= 0"),
        (1, 0, FailedPrecondition, "has not been handed"),
        (0, 1, FailedPrecondition, "before step 2"),
        (0, 5, FailedPrecondition, "past what the rank was handed"),
    ],
)
def test_a_checkpoint_of_a_step_not_handed_is_refused(rank: int, step: int, error: type, words: str) -> None:
    marks = CheckpointMarks([0, 1])
    marks.handed(0, 2, restart=True)
    marks.handed(0, 3)
    with pytest.raises(error, match=words):
        marks.checkpointed(rank, step)
    assert marks.mark() is None  # nothing recorded by a refusal


@pytest.mark.parametrize(("rank", "step"), [(-1, 0), (4, 0), (0, -1), (0, MAX_STEP + 1)])
def test_mark_checkpoint_requests_out_of_bounds_are_invalid(rank: int, step: int) -> None:
    with pytest.raises(InvalidArgument):
        check_checkpoint_request(rank=rank, step=step, world=4)
    check_checkpoint_request(rank=3, step=MAX_STEP, world=4)


def test_start_holds_keep_the_reclaimer_off_but_never_stall_the_producer() -> None:
    assert checkpoint_mark("pod-0") == "ckpt-pod-0" and start_mark("pod-0") == "start-pod-0"
    assert counts_for_lag("ckpt-pod-0") and counts_for_lag("pod-0") and not counts_for_lag("start-pod-0")
    # No checkpoint ever: the start hold at 0 and the progress mark at 90.
    marks = {"start-pod-0": Watermark(1, 0), "pod-0": Watermark(5, 90)}
    lagging = [w for m, w in marks.items() if counts_for_lag(m)]
    assert not backpressure(watermarks=lagging, next_step=100, policy=RetentionPolicy(max_lag=16)).pause
    assert backpressure(watermarks=marks.values(), next_step=100, policy=RetentionPolicy(max_lag=16)).pause
    decision = reclaim(watermarks=marks.values(), steps=[], versions=[], now_s=0.0, policy=RetentionPolicy(min_age_s=0))
    assert decision.floor_step == 0  # the start is kept


class _Flaky:
    def __init__(self) -> None:
        self.calls = 0

    def run_once(self) -> str:
        self.calls += 1
        if self.calls == 1:
            raise OSError("storage down")
        return "report"


def test_a_failed_reclaim_round_is_logged_and_the_next_one_runs(caplog: pytest.LogCaptureFixture) -> None:
    flaky = _Flaky()
    made = []

    def make() -> _Flaky:
        made.append(1)
        return flaky

    loop = ReclaimLoop(storage=None, min_age_s=600, make_reclaimer=make)  # type: ignore[arg-type]
    assert loop.run_once() is None and loop.failures == 1
    assert "round failed" in caplog.text
    assert loop.run_once() == "report" and loop.rounds == 1
    assert len(made) == 2  # built again after the failure
