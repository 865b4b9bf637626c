"""moto's S3 server (`python -m moto.server`, from the `moto[server]` dev dependency) as a child
process on 127.0.0.1, stopped by its pid: the S3 endpoint of the benchmarks and of the
integration tests (tests/integration/s3_server.py builds on it).

moto's server speaks the S3 REST protocol over HTTP and honours conditional writes
(`If-None-Match: *` answers 412 when the key exists) and ranged GETs. Clients reach it through
the standard AWS environment (`env()`): pyarrow's S3FileSystem, obstore's S3Store and boto3 all
read `AWS_ENDPOINT_URL`, the keys and the region.

It runs as `python -m batchplane.bench.moto_server` (`main`): moto's application on its
threaded werkzeug server, as `python -m moto.server` runs it, but with the requests that write
(PUT, POST, DELETE) one at a time. moto checks a condition and then writes, so two conditional
writes of one key on two threads could both pass the check (eight threads racing for a key made
two winners once in CI under load); S3 decides each conditional write atomically, and so does
this server. Reads run concurrently.

    with MotoServer(workdir) as s3:
        s3.create_bucket("data")
        os.environ.update(s3.env())
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

REGION = "us-east-1"


def available() -> bool:
    """Whether moto is installed (without it there is no server to start)."""
    return importlib.util.find_spec("moto") is not None


class MotoServer:
    """One moto server process on a free port of 127.0.0.1.

    Args:
        workdir: Folder for its log, `moto.log` (created).
        access_key: The AWS access key `env()` hands out (moto accepts any).
        secret_key: The matching secret.
        start_timeout_s: Seconds to wait for it to answer.

    Raises:
        RuntimeError: It exited or did not answer in time (with its log's end).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        access_key: str = "batchplane",
        secret_key: str = "batchplane-secret",
        start_timeout_s: float = 30.0,
    ) -> None:
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.access_key = access_key
        self.secret_key = secret_key
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log_path = self.workdir / "moto.log"
        self._log = open(self._log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "batchplane.bench.moto_server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"moto's S3 server did not start within {start_timeout_s} s "
                    f"(exit {self._proc.returncode}); its log ends: {self.log_text()}"
                )
            try:
                self._call("GET", "/moto-api/", timeout=1.0)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        """The standard AWS environment that points a client here."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",  # obstore refuses plain http without it
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def create_bucket(self, name: str) -> None:
        """Creates bucket `name`."""
        self._call("PUT", f"/{name}")

    def reset(self) -> None:
        """Drops every bucket and object (moto's reset API)."""
        self._call("POST", "/moto-api/reset")

    def log_text(self) -> str:
        """The end of the server's log."""
        if not self._log.closed:
            self._log.flush()
        return self._log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """Stops the server (SIGTERM to its process group, SIGKILL after 10 s)."""
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()

    def _call(self, method: str, path: str, *, timeout: float = 30.0) -> None:
        urllib.request.urlopen(urllib.request.Request(self.endpoint + path, method=method), timeout=timeout).close()

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: HTTP methods that change a bucket: `main` serves them one at a time.
WRITES = frozenset({"PUT", "POST", "DELETE"})


def serialized_writes(app: Callable[[dict, Callable], Any]) -> Callable[[dict, Callable], Any]:
    """A WSGI application that runs `app` on each write request (`WRITES`) one at a time and on
    reads as they come."""
    lock = threading.Lock()

    def serve(environ: dict, start_response: Callable) -> Any:
        if environ.get("REQUEST_METHOD") not in WRITES:
            return app(environ, start_response)
        with lock:
            return app(environ, start_response)

    return serve


def main(argv: list[str] | None = None) -> None:
    """moto's S3 server on -H host and -p port, its writes serialized (see the module docstring)."""
    import argparse

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(prog="python -m batchplane.bench.moto_server")
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, serialized_writes(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
