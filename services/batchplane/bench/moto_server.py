"""moto's S3 server (`python -m moto.server`, from the `moto[server]` dev dependency) as a child
process on 127.0.0.1, stopped by its pid: the S3 endpoint of the benchmarks and of the
integration tests (tests/integration/s3_server.py builds on it).

moto's server speaks the S3 REST protocol over HTTP and honours conditional writes
(`If-None-Match: *` answers 412 when the key exists) and ranged GETs. Clients reach it through
the standard AWS environment (`env()`): pyarrow's S3FileSystem, obstore's S3Store and boto3 all
read `AWS_ENDPOINT_URL`, the keys and the region.

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
import time
import urllib.error
import urllib.request

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
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
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
