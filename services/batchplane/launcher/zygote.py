"""Starts service processes by forking one that has already imported them.

A service process spends about half a second of CPU importing grpc, pyarrow, numpy and its
own modules before it serves anything; a job of many loaders and constructors, and every
restart, pays that again. The launcher instead starts one zygote process (`python -m
batchplane.launcher.zygote`) that imports the service modules once and then forks a child per
service: the child runs the service module as `python -m` would (as `__main__`, with its
arguments, environment, working directory and log file), so it costs only the fork. The zygote
also imports what the services' libraries import only on first use (pyarrow's pandas), and a
child leaves without finalizing the interpreter it shares with the zygote (finalization would
copy every shared page). Both together: a planner, two loaders and two constructors cost about
1.5 CPU-s less over their life (0.7 of pandas, 0.9 at exit), measured on a 2-core machine.

What the launcher holds for such a child is a `ZygoteProcess`, which answers as much of
`subprocess.Popen` as the launcher uses (pid, poll, wait, send_signal, kill, returncode). The
zygote reaps its children and writes each one's exit status into a pipe that only that child's
`ZygoteProcess` reads, as `multiprocessing`'s forkserver does.

Lifetimes: the zygote exits when the launcher closes its end of the control socket or dies;
it never signals its children. A child that was started with `--exit-with-parent` watches its
parent (the zygote) and so stops by itself once the launcher is gone, as it would under the
launcher directly.

The zygote is single-threaded when it forks (it imports, it never serves); what a child needs
from the interpreter's own start-up (PYTHON* variables) is the zygote's, so a request whose
PYTHON* variables differ from the zygote's is started as a plain subprocess instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import pathlib
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

#: The modules a zygote imports before it forks: the three services' entry points.
SERVICE_MODULES = ("batchplane.planner.__main__", "batchplane.loader.__main__", "batchplane.constructor.__main__")

#: Set to 0 to start every service process as a plain `python -m` subprocess.
ENV_SWITCH = "BATCHPLANE_FORK_SERVER"

#: Bytes of command line a child can show (its /proc/PID/cmdline, what `ps` and `pgrep -f`
#: read): the zygote starts with this much room in its own argv, which each child overwrites
#: with its `python -m module args`. A longer command starts as a plain subprocess.
CMDLINE_ROOM = 4096

#: The exit status of a child whose zygote died before it: unknown, reported as a kill.
LOST_STATUS = -signal.SIGKILL

_STATUS = struct.Struct("<i")
_LENGTH = struct.Struct("<I")
_MAX_REQUEST = 1 << 24


class ZygoteError(RuntimeError):
    """The zygote could not be started or stopped answering."""


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether service processes start from a zygote (BATCHPLANE_FORK_SERVER is not 0)."""
    return (os.environ if env is None else env).get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def interpreter_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a Python interpreter reads as it starts (PYTHON*), which a fork cannot
    change."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


class ZygoteProcess:
    """A child of the zygote, answering the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, pid: int, status_fd: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._status_fd = status_fd
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """Its exit status (negative: the signal that ended it), or None while it runs."""
        return self._read(timeout_s=0.0)

    def wait(self, timeout: float | None = None) -> int:
        """Waits for it to exit and returns its status.

        Raises:
            subprocess.TimeoutExpired: it still runs after `timeout` seconds.
        """
        code = self._read(timeout_s=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        """Sends `sig` unless it has already exited (whose pid may be another's by now)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, *, timeout_s: float | None) -> int | None:
        with self._lock:
            if self.returncode is None and self._status_fd >= 0:
                self._read_status(timeout_s)
            if self.returncode is None and self._status_fd < 0:  # the zygote is gone: watch the pid
                give_up = None if timeout_s is None else time.monotonic() + timeout_s
                while _running(self.pid):
                    if give_up is not None and time.monotonic() >= give_up:
                        return None
                    time.sleep(0.05)
                # Its status went with the zygote; it stopped by itself (exit-with-parent) or was killed.
                self.returncode = LOST_STATUS
            return self.returncode

    def _read_status(self, timeout_s: float | None) -> None:
        ready, _, _ = select.select([self._status_fd], [], [], timeout_s)
        if not ready:
            return
        data = b""
        while len(data) < _STATUS.size:
            chunk = os.read(self._status_fd, _STATUS.size - len(data))
            if not chunk:
                break
            data += chunk
        os.close(self._status_fd)
        self._status_fd = -1
        if len(data) == _STATUS.size:
            self.returncode = _STATUS.unpack(data)[0]
        else:
            log.warning("the zygote that started pid %d is gone; its exit status will not be known", self.pid)

    def __del__(self) -> None:
        if self._status_fd >= 0:
            try:
                os.close(self._status_fd)
            except OSError:
                pass


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class Zygote:
    """One zygote process and its control socket; `spawn` is safe from any thread.

    Args:
        modules: What it imports before forking.
    Raises:
        ZygoteError: it exited before it had imported them (the message carries its error).
    """

    def __init__(self, modules: Sequence[str] = SERVICE_MODULES) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._env = interpreter_env(os.environ)
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), *modules, " " * CMDLINE_ROOM],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        theirs.close()
        self._socket = ours
        self._lock = threading.Lock()
        if self._socket.recv(1) != b"\x01":  # it writes one byte once it has imported everything
            self._process.wait()
            error = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
            raise ZygoteError(f"the zygote exited with status {self._process.returncode} while importing {list(modules)}:\n{error}")
        self._process.stderr.close()

    @property
    def pid(self) -> int:
        return self._process.pid

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a child with environment `env` can be forked from this zygote."""
        return self._process.poll() is None and interpreter_env(env) == self._env

    def fits(self, module: str, args: Sequence[str]) -> bool:
        """Whether the child's command line fits in the room the zygote has for it."""
        return len(_cmdline([sys.executable, "-m", module, *args])) <= CMDLINE_ROOM

    def spawn(self, module: str, args: Sequence[str], *, log_fd: int, env: Mapping[str, str] | None = None) -> ZygoteProcess:
        """Forks a child that runs `python -m module *args` with stdout and stderr on `log_fd`,
        stdin on /dev/null, in a new session, with `env` (default: this process's environment)
        and this process's working directory.

        Raises:
            ZygoteError: the zygote is gone.
        """
        request = json.dumps({"module": module, "args": list(args), "env": dict(os.environ if env is None else env), "cwd": os.getcwd()})
        status_r, status_w = os.pipe()
        try:
            with self._lock:
                body = request.encode()
                self._socket.sendall(_LENGTH.pack(len(body)))
                socket.send_fds(self._socket, [body], [log_fd, status_w])  # the descriptors ride on the body's first bytes
                reply = _recv_exactly(self._socket, _STATUS.size)
        except OSError as exc:
            os.close(status_r)
            raise ZygoteError(f"the zygote (pid {self.pid}) stopped answering: {exc}") from exc
        finally:
            os.close(status_w)
        if reply is None:
            os.close(status_r)
            raise ZygoteError(f"the zygote (pid {self.pid}) exited with status {self._process.poll()}")
        return ZygoteProcess(_STATUS.unpack(reply)[0], status_r, [sys.executable, "-m", module, *args])

    def close(self) -> None:
        """Stops the zygote (its children run on) and waits for it."""
        self._socket.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


_shared: Zygote | None = None
#: A zygote could not be started in this process: every later spawn is a plain subprocess.
_broken = False
_shared_lock = threading.Lock()


def spawn(module: str, args: Sequence[str], *, log_fd: int) -> ZygoteProcess | None:
    """Forks `python -m module *args` from this process's zygote (started on first use, and
    again if it died); None where it cannot: the zygote is switched off (BATCHPLANE_FORK_SERVER=0)
    or this process's PYTHON* variables changed since it started, or it cannot start (logged).
    The caller then starts a plain subprocess."""
    global _shared, _broken
    if _broken or not enabled():
        return None
    with _shared_lock:
        if _shared is not None and _shared._process.poll() is not None:
            log.warning("the zygote (pid %d) exited with status %s; starting another", _shared.pid, _shared._process.returncode)
            _shared = None
        if _shared is None:
            try:
                _shared = Zygote()
            except (OSError, ZygoteError) as exc:
                log.warning("starting service processes without a zygote: %s", exc)
                _broken = True
                return None
        zygote = _shared
    if not zygote.serves(os.environ) or not zygote.fits(module, args):
        return None
    try:
        return zygote.spawn(module, args, log_fd=log_fd)
    except ZygoteError as exc:
        log.warning("%s; starting %s as a plain subprocess", exc, module)
        return None


def _cmdline(argv: Sequence[str]) -> bytes:
    return b"".join(os.fsencode(a) + b"\0" for a in argv)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# ---- the zygote itself -------------------------------------------------------------------------


def _serve(control: socket.socket) -> tuple[dict, int] | None:
    """The zygote's loop: forks a child per request and reports each child's exit status on its
    status pipe. Returns in a child: its request and log descriptor. Returns None (in the
    zygote) once the launcher is gone."""
    statuses: dict[int, int] = {}  # child pid -> write end of its status pipe
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    try:
        while True:
            try:
                ready, _, _ = select.select([control, wake_r], [], [])
            except InterruptedError:
                continue
            if wake_r in ready:
                os.read(wake_r, 512)
                _reap(statuses)
            if control not in ready:
                continue
            header = _recv_exactly(control, _LENGTH.size)
            if header is None:
                return None
            (size,) = _LENGTH.unpack(header)
            if size > _MAX_REQUEST:
                raise ZygoteError(f"request of {size} bytes")
            message, fds, _, _ = socket.recv_fds(control, size, 2)
            while len(message) < size:
                chunk = control.recv(size - len(message))
                if not chunk:
                    return None
                message += chunk
            request = json.loads(message)
            log_fd, status_w = fds
            pid = os.fork()
            if pid == 0:  # the child: leave the zygote's loop
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, status_w, *statuses.values()):
                    os.close(fd)
                statuses.clear()
                control.close()
                return request, log_fd
            os.close(log_fd)
            statuses[pid] = status_w
            control.sendall(_STATUS.pack(pid))
            _reap(statuses)
    finally:
        for fd in statuses.values():  # the zygote only: its children run on, unreported
            os.close(fd)


def _reap(statuses: dict[int, int]) -> None:
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = statuses.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, _STATUS.pack(os.waitstatus_to_exitcode(status)))
            except OSError as exc:  # its ZygoteProcess is gone
                if exc.errno != errno.EPIPE:
                    raise
            os.close(fd)


def _become(request: dict, log_fd: int) -> None:
    """Turns this forked child into `python -m module args` as the launcher asked."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
    sys.argv = [request["module"], *request["args"]]
    _show_cmdline([sys.executable, "-m", request["module"], *request["args"]])
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        _exit_without_teardown(exc.code)
    _exit_without_teardown(0)


def _exit_without_teardown(code: object) -> None:
    """Exits as `sys.exit(code)` would, but without tearing the interpreter down: finalization
    drops every object the zygote imported, which writes to each page of the heap the child
    shares with the zygote and so copies it (about 0.2 s of CPU per child, more than the fork
    saved). Logs and standard streams are flushed first. A service has stopped gracefully by
    then (or exits with an error status); what finalization would still do (join worker
    threads, run atexit hooks) is what a SIGKILL skips too, which every part survives."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        status = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status & 0xFF)


def _show_cmdline(argv: Sequence[str]) -> None:
    """Overwrites this process's command line in place (the memory the kernel shows as
    /proc/self/cmdline, between its arg_start and arg_end), NUL-padded; a command longer than
    that room is cut (the launcher does not ask for one)."""
    try:
        fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49: arg_start, arg_end
    except (OSError, IndexError, ValueError):
        return
    text = _cmdline(argv)[: end - start - 1]
    ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)


def _import_lazy_dependencies() -> None:
    """Imports what the services' libraries import only on first use, so that children inherit
    it instead of each paying for it: pyarrow imports pandas (about 0.2 s of CPU) the first time
    it converts Python objects to an array, which every loader and constructor does on its first
    request. Without pandas installed pyarrow just goes on without it."""
    import pyarrow

    pyarrow.array([0])


def main(argv: Sequence[str]) -> int:
    control = socket.socket(fileno=int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the launcher's terminal is the launcher's
    modules = [a for a in argv[1:] if a.strip()]  # the last one is the room for children's command lines
    for module in modules:
        __import__(module)
        # What it imported stays; the module itself runs afresh in each child, as __main__.
        del sys.modules[module]
    _import_lazy_dependencies()
    _show_cmdline([sys.executable, "-m", "batchplane.launcher.zygote", *argv[:1], *modules])
    control.sendall(b"\x01")
    forked = _serve(control)
    if forked is None:
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _become(*forked)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
