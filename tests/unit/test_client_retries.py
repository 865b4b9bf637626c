"""How the client's connection to its constructor retries and gives up (`ConstructorConnection._call`):
retryable codes are tried again within the timeout, others raise at once, and an error raised
on a deadline also carries the constructor's last answer (what it waits for, e.g. a loader that
is gone), which the last, short attempt may not have lived to receive."""

from __future__ import annotations

import grpc
import pytest

from batchplane.client.errors import DataPlaneError, DataPlaneUnavailable
from batchplane.client.transport import ConstructorConnection
from batchplane.v1 import constructor_pb2

from rpc_fakes import Failed


UNAVAILABLE = Failed(grpc.StatusCode.UNAVAILABLE, "batch of step 2 for rank 0 not ready: loader at 127.0.0.1:5 is gone")
DEADLINE = Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


@pytest.fixture
def connection():
    c = ConstructorConnection("127.0.0.1:9", timeout_s=0.5)
    yield c
    c.close()


def scripted(*outcomes):
    """An attempt that raises the given errors in turn, then the last one for ever."""
    seen: list[float] = []

    def attempt(remaining: float):
        seen.append(remaining)
        raise outcomes[min(len(seen), len(outcomes)) - 1]

    return attempt, seen


def test_a_deadline_after_an_answer_names_what_the_constructor_waited_for(connection) -> None:
    attempt, seen = scripted(UNAVAILABLE, DEADLINE)
    with pytest.raises(DataPlaneUnavailable) as raised:
        connection._call(attempt, "GetBatch(rank 0, step 2)")
    message = str(raised.value)
    assert len(seen) >= 2 and "DEADLINE_EXCEEDED" in message
    assert "its last answer: UNAVAILABLE: batch of step 2 for rank 0 not ready: loader at 127.0.0.1:5 is gone" in message


def test_a_deadline_with_no_answer_before_says_only_that(connection) -> None:
    attempt, _ = scripted(DEADLINE)
    with pytest.raises(DataPlaneUnavailable) as raised:
        connection._call(attempt, "GetBatch(rank 0, step 2)")
    assert "DEADLINE_EXCEEDED: Deadline Exceeded" in str(raised.value) and "last answer" not in str(raised.value)


def test_an_answer_that_is_not_retried_raises_at_once_as_it_is(connection) -> None:
    attempt, seen = scripted(Failed(grpc.StatusCode.FAILED_PRECONDITION, "step 2 was already consumed"))
    with pytest.raises(DataPlaneError, match="FAILED_PRECONDITION: step 2 was already consumed$"):
        connection._call(attempt, "GetBatch(rank 0, step 2)")
    assert len(seen) == 1


def test_a_retried_call_that_then_succeeds_returns_its_answer(connection) -> None:
    calls = iter([UNAVAILABLE, DEADLINE, None])

    def attempt(remaining: float) -> str:
        failure = next(calls)
        if failure is not None:
            raise failure
        return "batch"

    assert connection._call(attempt, "GetBatch(rank 0, step 2)") == "batch"


def test_a_wait_note_is_never_the_trainers_error(connection) -> None:
    """NoteWait goes out from the trainer's thread while it waits: a constructor that does not
    answer, or a channel the fetch thread just closed (the constructor moved), is no error there."""
    wait = constructor_pb2.DataWait(client="c", total_s=2.0, waiting_s=1.0)
    connection.note_wait(0, wait)  # nobody listens at 127.0.0.1:9: the future fails, logged at debug
    connection._channel.close()
    connection.note_wait(0, wait)  # a closed channel refuses the call at once
    connection.cancel()
    connection.note_wait(0, wait)  # a closed client sends nothing
