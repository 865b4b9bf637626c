"""A real S3 endpoint for the tests: moto's server (`moto[server]`, a dev dependency) started on
127.0.0.1 as its own process, stopped by its pid.

moto's server speaks the S3 REST protocol over HTTP and honours conditional writes
(`If-None-Match: *` answers 412 when the key exists), which is what the ledger's object store
relies on. Clients reach it through the standard AWS environment (`env()`): pyarrow's
S3FileSystem and obstore's S3Store both read `AWS_ENDPOINT_URL`, the keys and the region.

    with S3Server(tmp_path) as s3:
        s3.create_bucket("data")
        monkeypatch.setenv(...) for each of s3.env().items()
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ACCESS_KEY = "batchplane-test"
SECRET_KEY = "batchplane-test-secret"
REGION = "us-east-1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """One moto server process on 127.0.0.1.

    Args:
        workdir: Folder for its log (created).
        start_timeout_s: Seconds to wait for it to answer.
    """

    def __init__(self, workdir: str | os.PathLike[str], *, start_timeout_s: float = 30.0) -> None:
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(self.workdir / "moto.log", "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise AssertionError(f"moto server exited with {self._proc.returncode}; log: {self.log_text()}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"moto server did not answer in {start_timeout_s} s; log: {self.log_text()}")
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        """The standard AWS environment that points a client (pyarrow, obstore, boto3) here."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",  # obstore refuses plain http without it
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self):  # -> botocore S3 client (boto3 comes with moto[server])
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def upload_folder(self, folder: str | os.PathLike[str], bucket: str, prefix: str) -> list[str]:
        """Uploads every file below `folder` to s3://bucket/prefix/<relative path>; returns the keys."""
        client, root, keys = self.client(), pathlib.Path(folder), []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = f"{prefix.rstrip('/')}/{path.relative_to(root).as_posix()}".lstrip("/")
            client.upload_file(str(path), bucket, key)
            keys.append(key)
        return keys

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def log_text(self) -> str:
        self._log.flush()
        return (self.workdir / "moto.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
