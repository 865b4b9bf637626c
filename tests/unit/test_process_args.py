"""The command line every service process takes."""

from __future__ import annotations

import pathlib
import threading

import pytest

from batchplane.core.process import ProcessSettings, parse_process_args, set_from_signal


def test_a_loader_in_a_cluster_advertises_its_pod_address() -> None:
    settings = parse_process_args(
        "loader", ["-c", "job.yaml", "--index", "3", "--planner", "planner:50051", "--port", "50052", "--advertise", "10.1.2.3:50052"]
    )
    assert settings == ProcessSettings(
        config=pathlib.Path("job.yaml"),
        index=3,
        planner="planner:50051",
        port=50052,
        advertise="10.1.2.3:50052",
        log_level=settings.log_level,
    )


def test_without_advertise_the_served_address_is_used() -> None:
    assert parse_process_args("planner", ["-c", "job.yaml"]).advertise is None


def test_the_configuration_is_required() -> None:
    with pytest.raises(SystemExit):
        parse_process_args("planner", [])


def test_listen_takes_only_a_unix_socket(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_process_args("constructor", ["-c", "j.yaml", "--listen", "unix:///run/c.sock"]).listen == "unix:///run/c.sock"
    with pytest.raises(SystemExit):
        parse_process_args("planner", ["-c", "j.yaml", "--listen", "0.0.0.0:50051"])
    assert "--listen takes a Unix socket address" in capsys.readouterr().err


def test_a_signal_handler_sets_the_stop_event_even_while_the_main_thread_holds_its_lock() -> None:
    """A handler runs between two bytecodes of the main thread, which may then hold the event's
    lock inside Event.wait(); setting the event there must not wait on that lock."""
    stop = threading.Event()
    returned = threading.Event()

    def handler_while_lock_held() -> None:
        with stop._cond:  # what the main thread holds inside stop.wait()
            set_from_signal(stop)  # what on_signal does: it must return at once
            returned.set()

    caller = threading.Thread(target=handler_while_lock_held, daemon=True)
    caller.start()
    caller.join(timeout=10)
    assert returned.is_set(), "the handler waited on the lock its own thread holds"
    assert stop.wait(timeout=10), "the stop event was never set once the lock was free"
