"""A real Prometheus server for the integration tests: started on 127.0.0.1 with a temporary
configuration and data folder, scraping given targets every second, stopped by its pid.

The binary comes from Debian's `prometheus` package (or anything named `prometheus` on PATH);
when it is missing, `find_prometheus` fails the test with how to install it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

import yaml

DEBIAN_BINARY = pathlib.Path("/usr/bin/prometheus")
INSTALL_HINT = (
    "the prometheus server binary is missing (looked on PATH and at /usr/bin/prometheus); install "
    "Debian's package: `sudo apt-get install -y prometheus` (`make test` does this when run as root), "
    "or put a Prometheus 2.x binary on PATH (https://prometheus.io/download/)"
)


def find_prometheus() -> str:
    """The prometheus binary's path.

    Raises:
        AssertionError: it is missing; the message says how to install it (a failure, never a skip).
    """
    found = shutil.which("prometheus") or (str(DEBIAN_BINARY) if os.access(DEBIAN_BINARY, os.X_OK) else None)
    if found is None:
        raise AssertionError(INSTALL_HINT)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """One Prometheus process scraping `targets` (name -> metrics URL) as scrape job `job`,
    each target labelled `process=<name>`.

    Args:
        workdir: Folder for its configuration, data and log (created).
        targets: Metrics URL per process name, e.g. {"planner": "http://127.0.0.1:4711/metrics"}.
        job: The scrape job's name, Prometheus's `job` label.
        scrape_interval_s: Seconds between scrapes.
        scrape: More of the scrape job's configuration, e.g. `scheme`, `tls_config`, `authorization`.
    """

    def __init__(
        self,
        workdir: pathlib.Path,
        targets: Mapping[str, str],
        *,
        job: str,
        scrape_interval_s: float = 1.0,
        scrape: Mapping[str, object] | None = None,
    ) -> None:
        self.workdir = workdir
        self.scrape = dict(scrape or {})
        self.targets = dict(targets)
        self.job = job
        self.scrape_interval_s = scrape_interval_s
        self.popen: subprocess.Popen | None = None
        self.url = ""
        self.log_path = workdir / "prometheus.log"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def _write_config(self) -> pathlib.Path:
        interval = f"{round(self.scrape_interval_s * 1000)}ms"
        static = []
        path = None
        for name, url in sorted(self.targets.items()):
            parts = urllib.parse.urlsplit(url)
            if path not in (None, parts.path or "/metrics"):
                raise ValueError(f"targets use different metrics paths: {self.targets}")
            path = parts.path or "/metrics"
            static.append({"targets": [parts.netloc], "labels": {"process": name}})
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": self.job, "metrics_path": path or "/metrics", "static_configs": static, **self.scrape}],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        return config_path

    def start(self, *, timeout_s: float = 20.0) -> PrometheusServer:
        """Starts the server and waits until it is ready (not until its first scrape).

        Raises:
            AssertionError: no binary (with how to install it), or it exited or was not ready in
                time (with the end of its log).
        """
        binary = find_prometheus()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self._write_config()
        for attempt in range(3):  # the free port may be taken between probing and binding
            port = _free_port()
            self.url = f"http://127.0.0.1:{port}"
            command = [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ]
            with open(self.log_path, "ab") as log:
                self.popen = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
            give_up = time.monotonic() + timeout_s
            while time.monotonic() < give_up:
                if self.popen.poll() is not None:
                    break
                if self._ready():
                    return self
                time.sleep(0.1)
            exited = self.popen.poll() is not None
            self.stop()
            if not (exited and "address already in use" in self.log_tail()):
                raise AssertionError(
                    f"prometheus ({' '.join(command)}) {'exited' if exited else f'not ready after {timeout_s:g} s'}; "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
        raise AssertionError(f"prometheus could not bind a free port in 3 attempts; end of {self.log_path}:\n{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_for_scrapes(self, *, timeout_s: float = 15.0) -> None:
        """Waits until every target has been scraped successfully (`up == 1`).

        Raises:
            AssertionError: not all targets up in time; names those that are not.
        """
        query = urllib.parse.urlencode({"query": f'up{{job="{self.job}"}}'})
        give_up = time.monotonic() + timeout_s
        up: dict[str, float] = {}
        while time.monotonic() < give_up:
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=2) as response:
                    result = json.loads(response.read())["data"]["result"]
                up = {r["metric"].get("process", "?"): float(r["value"][1]) for r in result}
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                up = {}
            if set(up) >= set(self.targets) and all(up[name] == 1 for name in self.targets):
                return
            time.sleep(0.2)
        down = sorted(name for name in self.targets if up.get(name) != 1)
        raise AssertionError(
            f"prometheus at {self.url} has not scraped {down} after {timeout_s:g} s; end of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM to its pid, SIGKILL after `timeout_s`."""
        if self.popen is None or self.popen.poll() is not None:
            return
        os.kill(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
