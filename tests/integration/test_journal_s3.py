"""The journal's writer and reader on a real S3 endpoint (moto's server, which honours
`If-None-Match: *` and ranged GETs): slices round-trip byte-identical and each rank's read
fetches only its slice (plus the trailer and footer once per step); a writer killed with
uncommitted steps resumes after its last committed step with nothing committed twice; a store
that ignores conditional puts (a proxy dropping If-None-Match) is refused."""

from __future__ import annotations

import argparse
import pathlib
import sys
import uuid

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from s3_proxy import S3Proxy  # noqa: E402
from s3_server import S3Server  # noqa: E402

from batchplane.bench import journal as bench  # noqa: E402
from batchplane.core.errors import FailedPrecondition  # noqa: E402
from batchplane.core.object_storage import ObjectStorage  # noqa: E402
from batchplane.journal.commit import ManifestStore  # noqa: E402
from batchplane.journal.manifest import Fenced  # noqa: E402
from batchplane.journal.reader import JournalReader  # noqa: E402
from batchplane.journal.slices import DataMesh  # noqa: E402
from batchplane.journal.writer import JournalWriter  # noqa: E402

pytestmark = pytest.mark.integration

BUCKET = "journal"
PREFIX = "job/"
MESH = DataMesh(4)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(autouse=True)
def aws_environment(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)


class Counting:
    """A Storage that counts the bytes of TGB objects fetched, whole or by range."""

    def __init__(self, inner: ObjectStorage) -> None:
        self.inner = inner
        self.range_bytes = 0
        self.whole_gets = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def get(self, key: str) -> bytes:
        if "/tgb/" in key:
            self.whole_gets += 1
        return self.inner.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        data = self.inner.get_range(key, start, end)
        self.range_bytes += len(data)
        return data


def batch(step: int, dp: int) -> dict[str, np.ndarray]:
    tag = step * 10 + dp
    return {"input_ids": np.arange(4096, dtype=np.int32).reshape(4, 1024) + tag, "tag": np.array([tag], dtype=np.int64)}


def new_storage() -> ObjectStorage:
    return ObjectStorage.from_url(f"s3://{BUCKET}/{uuid.uuid4().hex}")


def writer(storage: object, **kw) -> JournalWriter:
    return JournalWriter(storage, prefix=PREFIX, producer_id="p0", mesh=MESH, token_names=("input_ids",), **kw)


def test_round_trip_reads_only_the_slice_and_a_killed_writer_resumes_once() -> None:
    storage = new_storage()
    first = writer(storage, policy="fixed10")
    assert first.resume() == 0
    for step in range(4):
        first.write(step, {(d, 0): batch(step, d) for d in range(MESH.dp)})
    first.flush()
    for step in (4, 5):  # written, not committed: the process dies here
        first.write(step, {(d, 0): batch(step, d) for d in range(MESH.dp)})

    second = writer(storage, policy="naive")
    assert second.resume() == 4
    assert second.stats.orphans_deleted == 2
    for step in range(4, 8):
        second.write(step, {(d, 0): batch(step, d) for d in range(MESH.dp)})
    with pytest.raises(Fenced):
        first.flush()

    state = ManifestStore(storage, prefix=PREFIX, check_writes=False).latest()
    assert [s.step for s in state.steps] == list(range(8))
    listed = {o.key for s in state.steps for o in s.entry.objects}
    assert set(storage.list(PREFIX + "tgb/")) == listed, "no orphan left"
    sizes = [s.entry.objects[0].size for s in state.steps]

    counting = Counting(storage)
    with JournalReader(counting, prefix=PREFIX, mesh=MESH, coords=[(2, 0)], depth=2, poll_s=0.01) as reader:
        for step in range(8):
            got = reader.next(timeout_s=20)
            want = batch(step, 2)
            assert got.step == step and got.batches[(2, 0)]["tag"].tolist() == [step * 10 + 2]
            assert got.batches[(2, 0)]["input_ids"].tobytes() == want["input_ids"].tobytes()
    assert counting.whole_gets == 0
    assert counting.range_bytes < sum(sizes) / 3, "one slice of four, plus the footers"
    slice_bytes = 4 * 1024 * 4 + 64
    footers = counting.range_bytes - 8 * slice_bytes
    assert 0 < footers < 8 * 2048, "trailer and footer once per step"


def test_a_store_that_ignores_conditional_puts_is_refused(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    location = f"s3://{BUCKET}/careless-{uuid.uuid4().hex}"
    with S3Proxy(s3.endpoint, drop=("If-None-Match",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        storage = ObjectStorage.from_url(location)
        with pytest.raises(FailedPrecondition, match="ignores conditional writes") as caught:
            writer(storage).resume()
        assert "the journal's manifest cannot be committed" in str(caught.value)
        assert proxy.dropped >= 1
        assert storage.list("") == [], "nothing was written"


def test_bench_journal_runs_on_an_existing_bucket_and_leaves_it_as_it_found_it(s3: S3Server, tmp_path: pathlib.Path) -> None:
    """`bench journal --s3-url` (for a real object store: moto on this machine's cores bounds
    the s3 figures) runs every part on the bucket the AWS variables reach, starting no server of
    its own, and deletes what each point wrote; the bucket's other objects stay."""
    s3.create_bucket("figures")
    s3.client().put_object(Bucket="figures", Key="runs-of-others/keep.txt", Body=b"theirs")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    small = ["--producers", "2", "--policies", "dac", "--duration-s", "1", "--warmup-s", "0.2", "--cycles", "1"]
    small += ["--max-duration-s", "15", "--max-warmup-s", "10", "--payload-kb", "10", "--build-ms", "5", "--pregrown-steps", "10"]
    small += ["--worlds", "4", "--slice-kb", "4", "--read-steps", "1", "--read-ranks", "2", "--trace-steps", "30"]
    small += ["--checkpoint-every", "5", "--max-lag", "20", "--trace-points", "2", "--state-payload-kb", "10", "--state-commits", "1"]
    args = parser.parse_args(["--dir", str(tmp_path), "--stores", "s3", "--s3-url", "s3://figures/runs/", *small])
    messages: list[str] = []
    out = bench.run(args, messages.append)

    assert not any("moto's S3 server" in m for m in messages), "no server of its own"
    assert any(m.startswith("journal: s3 store s3://figures/runs/") and s3.endpoint in m for m in messages)
    kinds = {r["kind"] for r in out["records"]}
    assert kinds == {"commit", "read", "storage", "producer_state"} and {r["store"] for r in out["records"]} == {"s3"}
    commit = next(r for r in out["records"] if r["kind"] == "commit")
    assert commit["commits"] > 0 and commit["exactly_once"]
    deleted = sum(int(m.split()[2]) for m in messages if m.startswith("journal: deleted "))
    assert deleted > 0, "each point's objects were there to delete"
    assert s3.keys("figures") == ["runs-of-others/keep.txt"]
    for bad in ("http://figures/runs", "s3:///runs", "figures/runs"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--s3-url", bad])
