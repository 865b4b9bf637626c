"""A real S3 endpoint for the tests: moto's server, started and stopped by
`batchplane.bench.moto_server.MotoServer`, with the test keys and boto3 helpers (creating
buckets, uploading folders, listing keys) on top.

    with S3Server(tmp_path) as s3:
        s3.create_bucket("data")
        monkeypatch.setenv(...) for each of s3.env().items()
"""

from __future__ import annotations

import os
import pathlib

from batchplane.bench.moto_server import REGION, MotoServer

ACCESS_KEY = "batchplane-test"
SECRET_KEY = "batchplane-test-secret"


class S3Server(MotoServer):
    """One moto server process on 127.0.0.1, with the test keys.

    Args:
        workdir: Folder for its log (created).
        start_timeout_s: Seconds to wait for it to answer.
    """

    def __init__(self, workdir: str | os.PathLike[str], *, start_timeout_s: float = 30.0) -> None:
        super().__init__(workdir, access_key=ACCESS_KEY, secret_key=SECRET_KEY, start_timeout_s=start_timeout_s)

    def client(self):  # -> botocore S3 client (boto3 comes with moto[server])
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

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
