"""The zygote that forks service processes: a child runs its module as `python -m` would (as
__main__, with its arguments, environment, working directory and log file), its exit status
and the signal that ended it reach the launcher, `ps` shows its own command line, and a request
the zygote cannot serve falls back to a plain subprocess.

Real processes: a zygote importing only small modules (json), and a probe module written here."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from batchplane.launcher import zygote

PROBE = """
import json, os, sys, time
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                  "sid": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read()}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if "--sleep" in sys.argv:
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def probe_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    (tmp_path / "zygote_probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)  # the child runs in the launcher's working directory, first on its path
    return tmp_path


@pytest.fixture
def small_zygote() -> zygote.Zygote:
    z = zygote.Zygote(["json"])
    yield z
    z.close()


def _spawn(
    z: zygote.Zygote, folder: pathlib.Path, *args: str, env: dict[str, str] | None = None
) -> tuple[zygote.ZygoteProcess, pathlib.Path]:
    log_path = folder / "child.log"
    with open(log_path, "ab") as log_file:
        return z.spawn("zygote_probe", list(args), log_fd=log_file.fileno(), env=env), log_path


def test_a_child_runs_its_module_as_main_with_its_arguments_environment_and_log(
    small_zygote: zygote.Zygote, probe_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROBE_VALUE", "set after the zygote started")
    child, log_path = _spawn(small_zygote, probe_dir, "3", "--flag", "a b")
    assert child.wait(timeout=30) == 3 and child.returncode == 3 and child.poll() == 3
    first, second = log_path.read_text().splitlines()
    seen = json.loads(first)
    assert seen == {
        "name": "__main__",
        "argv": ["3", "--flag", "a b"],
        "cwd": str(probe_dir),
        "env": "set after the zygote started",
        "sid": True,
        "stdin": "",
    }
    assert second == "to stderr"


EXITING = """
import io, logging, os, sys
logging.basicConfig(stream=sys.stderr, format="%(message)s")
sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False))  # block-buffered, whatever PYTHONUNBUFFERED says
print("buffered on stdout")  # not flushed
logging.getLogger("probe").warning("logged")
if sys.argv[1] == "int":
    sys.exit(4)
if sys.argv[1] == "message":
    sys.exit("a message")
"""


@pytest.mark.parametrize(("how", "status", "said"), [("end", 0, None), ("int", 4, None), ("message", 1, "a message")])
def test_a_child_exits_with_its_status_and_everything_it_wrote_without_tearing_down(
    small_zygote: zygote.Zygote, probe_dir: pathlib.Path, how: str, status: int, said: str | None
) -> None:
    """A child leaves through os._exit (finalization would copy every page it shares with the
    zygote): the status is what sys.exit or the module's end says, and what it buffered or
    logged is in its log all the same."""
    (probe_dir / "zygote_exiting.py").write_text(EXITING)
    log_path = probe_dir / "child.log"
    with open(log_path, "ab") as log_file:
        child = small_zygote.spawn("zygote_exiting", [how], log_fd=log_file.fileno())
    assert child.wait(timeout=30) == status
    written = log_path.read_text().splitlines()
    assert {"buffered on stdout", "logged"} <= set(written)
    if said:  # sys.exit's message, on stderr
        assert said in written


def test_the_signal_that_ends_a_child_is_its_negative_status_and_wait_times_out_while_it_runs(
    small_zygote: zygote.Zygote, probe_dir: pathlib.Path
) -> None:
    child, log_path = _spawn(small_zygote, probe_dir, "0", "--sleep")
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.2)
        assert child.poll() is None
        cmdline = pathlib.Path(f"/proc/{child.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert cmdline == [os.fsencode(sys.executable), b"-m", b"zygote_probe", b"0", b"--sleep"]
    finally:
        child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.kill()  # after its exit: nothing is signalled (its pid may be another process's by now)


def test_children_outlive_a_closed_zygote_and_then_report_no_status_of_their_own(
    probe_dir: pathlib.Path,
) -> None:
    z = zygote.Zygote(["json"])
    child, _ = _spawn(z, probe_dir, "0", "--sleep")
    z.close()
    try:
        assert z._process.returncode == 0
        assert child.poll() is None  # still running: the zygote never signals its children
    finally:
        os.kill(child.pid, signal.SIGKILL)
    # Its status went with the zygote: known to have ended, not how.
    assert child.wait(timeout=30) == zygote.LOST_STATUS
    with pytest.raises(zygote.ZygoteError, match="stopped answering|exited"):
        _spawn(z, probe_dir, "0")


def test_a_zygote_that_cannot_import_names_the_module() -> None:
    with pytest.raises(zygote.ZygoteError, match="no_such_module_here"):
        zygote.Zygote(["json", "no_such_module_here"])


def test_what_a_fork_cannot_honour_is_left_to_a_plain_subprocess(small_zygote: zygote.Zygote, monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(os.environ)
    assert small_zygote.serves(env)
    assert not small_zygote.serves({**env, "PYTHONPATH": "/elsewhere"})  # read as the interpreter starts
    assert small_zygote.fits("m", ["x" * 100]) and not small_zygote.fits("m", ["x" * zygote.CMDLINE_ROOM])
    monkeypatch.setenv(zygote.ENV_SWITCH, "0")
    assert zygote.spawn("json", [], log_fd=1) is None


def test_the_launchers_zygote_starts_again_after_it_died(probe_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(zygote.ENV_SWITCH, "1")
    monkeypatch.setattr(zygote, "SERVICE_MODULES", ("json",))
    monkeypatch.setattr(zygote, "_shared", None)
    log_path = probe_dir / "child.log"
    with open(log_path, "ab") as log_file:
        first = zygote.spawn("zygote_probe", ["0"], log_fd=log_file.fileno())
        assert first is not None and first.wait(timeout=30) == 0
        dead = zygote._shared
        os.kill(dead.pid, signal.SIGKILL)
        dead._process.wait()
        second = zygote.spawn("zygote_probe", ["4"], log_fd=log_file.fileno())
    try:
        assert second is not None and second.wait(timeout=30) == 4
        assert zygote._shared is not dead
    finally:
        zygote._shared.close()
    assert [json.loads(line)["argv"] for line in log_path.read_text().splitlines() if line.startswith("{")] == [["0"], ["4"]]


def test_many_children_at_once_each_get_their_own_status(small_zygote: zygote.Zygote, probe_dir: pathlib.Path) -> None:
    children = [_spawn(small_zygote, probe_dir, str(code))[0] for code in range(12)]
    give_up = time.monotonic() + 60
    while any(c.poll() is None for c in children) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert [c.returncode for c in children] == list(range(12))
