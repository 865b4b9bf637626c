"""A crash during a ledger write leaves a ledger that opens and resumes correctly.

Through the real planner: trainers take batches and checkpoint after each; at a seeded random
moment the planner is killed (SIGKILL) while it is writing a step's record. The ledger then
opens, every record in it parses, its steps run from 0 without a gap, and it holds every step a
trainer got, naming the samples the trainer got; a new data plane on the same run folder resumes
from the trainers' checkpoint and delivers the rest of the epoch, every sample exactly once (I1)
over both runs.

Through `LedgerWriter` alone (the planner never compacts a job this small): a writer that appends,
compacts and thins is killed in each of those writes once, at seeded moments, and resumed; each
time the ledger opens whole and reads back what the writer reported written.

The ledger is checked only through `LedgerReader`, so the checks do not depend on its file format;
the moments to crash in are recognised from its layout of keys.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from harness import Batch, collect, sample_ids, skewed_lengths, start_cluster, to_numpy, write_job, write_source

from batchplane.client import Client
from batchplane.core.storage import TEMP_PREFIX, LocalStorage
from batchplane.launcher.zygote import ZygoteProcess
from batchplane.planner.journal import LedgerReader

pytestmark = pytest.mark.integration

log = logging.getLogger(__name__)


def temp_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX))


class GenerationsThrough:
    """A ledger's storage as it was when generation `gen` was the newest (later ones hidden)."""

    def __init__(self, storage: LocalStorage, gen: int) -> None:
        self.storage = storage
        self.gen = gen

    def list(self, prefix: str = "") -> list[str]:
        return [k for k in self.storage.list(prefix) if not k.startswith("gen-") or int(k[4:10]) <= self.gen]

    def get(self, key: str) -> bytes:
        return self.storage.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.storage.get_range(key, start, end)

    def describe(self) -> str:
        return f"{self.storage.describe()} through generation {self.gen}"


def read_every_generation(storage: LocalStorage) -> None:
    """Reads the ledger as each of its generations saw it when newest: so every record of every
    generation is read (superseded ones too) and parses, and each view has steps 0..last."""
    for g in LedgerReader(storage).generations:
        assert_contiguous(LedgerReader(GenerationsThrough(storage, g.gen)))


def assert_contiguous(reader: LedgerReader) -> int:
    """Asserts that the authoritative records are of steps 0..last; returns last."""
    last = reader.last_step()
    assert last is not None, "the ledger holds no step"
    assert [r["step"] for r in reader.records()] == list(range(last + 1))
    return last


# --- Through the real planner ----------------------------------------------------------------


class Trainer(threading.Thread):
    """One rank's training loop: takes batches, trains on each for `step_s` (so the planner has
    work for a while: it plans one step ahead) and checkpoints after each, until halted."""

    def __init__(self, rank: int, *, step_s: float) -> None:
        super().__init__(name=f"trainer-{rank}", daemon=True)
        self.rank = rank
        self.step_s = step_s
        self.client = Client(rank=rank, timeout_s=30)
        self.batches: list[Batch] = []
        self.states: list[dict] = []  # states[i]: the checkpoint after batches[i]
        self.error: BaseException | None = None
        self._halted = False

    def run(self) -> None:
        try:
            for batch in self.client:
                self.batches.append(to_numpy(batch))
                time.sleep(self.step_s)
                self.states.append(self.client.state_dict())
        except BaseException as exc:  # noqa: BLE001 - reported by halt()
            if not self._halted:  # a halted client fails its pending request, as expected
                self.error = exc

    def halt(self) -> None:
        """Closes the client (failing its pending request) and ends the loop."""
        self._halted = True
        self.client.close()
        self.join(timeout=30)
        assert not self.is_alive(), f"trainer {self.rank} did not end after its client was closed"
        if self.error is not None:
            raise self.error


def kill_when(process: subprocess.Popen | ZygoteProcess, condition: Callable[[], bool], *, timeout_s: float = 20.0) -> int:
    """SIGKILLs `process` at a moment when `condition()` holds (a write in progress).

    Polls `condition` and, as soon as it holds, stops the process (SIGSTOP, then waits until all
    its threads stopped: one inside fsync stops when the call returns). If the condition still
    holds, kills it there: SIGKILL to a stopped process is a crash at the moment it stopped.
    Otherwise lets the process go on and tries again.

    Returns:
        How many times the process was stopped, the last one the kill.
    """
    give_up = time.monotonic() + timeout_s
    stops = 0
    while time.monotonic() < give_up:
        if not condition():
            continue
        os.kill(process.pid, signal.SIGSTOP)
        stops += 1
        _wait_stopped(process.pid)
        if condition():
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            assert process.returncode == -signal.SIGKILL
            return stops
        os.kill(process.pid, signal.SIGCONT)
    raise AssertionError(f"pid {process.pid} did not reach the moment to kill it within {timeout_s} s")


def _wait_stopped(pid: int) -> None:
    """Waits until every thread of process `pid` has stopped (its /proc task states are all T):
    one inside a system call stops only when the call returns. Read from /proc, not waitpid, as
    the process need not be this one's child (the launcher forks services from its zygote)."""
    give_up = time.monotonic() + 10
    while True:
        states = []
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if all(state in "Tt" for state in states):
            return
        assert time.monotonic() < give_up and "Z" not in states, f"pid {pid} did not stop (thread states {states})"
        time.sleep(0.001)


def writing_in(folder: pathlib.Path) -> bool:
    """Whether an object is being written in `folder` (its temporary file exists)."""
    try:
        return any(e.name.startswith(TEMP_PREFIX) for e in os.scandir(folder))
    except FileNotFoundError:
        return False


def _describe_temp(path: pathlib.Path) -> str:
    data = path.read_bytes()
    try:
        return f"{len(data)} bytes, the whole record of step {json.loads(data)['step']}"
    except ValueError:
        return f"{len(data)} bytes, not yet a whole record"


def _sources(root: pathlib.Path):
    """About 75 steps of 8: the planner still writes dozens of records after the trainers' 2-8
    steps, so the kill catches one in the making however loaded the machine (with about 18 steps
    it could miss the last few writes and find planning over)."""
    return [
        write_source(root / "data", "a", skewed_lengths(360, seed=5), seed=5),
        write_source(root / "data", "b", skewed_lengths(240, seed=6), seed=6),
    ]


@pytest.mark.parametrize("seed", range(3))
def test_a_planner_killed_mid_ledger_write_resumes_with_every_sample_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Trainers take a seeded number of steps; the planner is killed while it writes the next
    record it plans; the ledger opens with every step a trainer got, and a new data plane resumes
    from the trainers' last common checkpoint with every sample delivered once over both runs."""
    rng = random.Random(seed)
    sources = _sources(tmp_path)
    run_dir = tmp_path / "run"
    config = write_job(
        tmp_path / "job.yaml",
        sources,
        mesh={"dp": 2},
        run_dir=str(run_dir),
        batch={"global_batch_size": 8, "microbatches": 2, "token_dtype": "int32"},
    )
    ledger_dir = run_dir / "ledger"
    steps_dir = ledger_dir / "gen-000001" / "steps"

    cluster = start_cluster(config)
    try:
        monkeypatch.setenv("BATCHPLANE_ENDPOINTS", str(cluster.endpoints_path))
        # 0.05 s a step: the planner's grouped writes (the steps planned in one go) spread over
        # about 4 s, so the poll below catches one in the making even when a loaded machine
        # gives this thread few time slices (at 0.02 s it once saw the job's last write go by).
        trainers = [Trainer(rank, step_s=0.05) for rank in (0, 1)]
        for t in trainers:
            t.start()
        try:
            taken = rng.randint(2, 8)
            wait_until_taken = time.monotonic() + 60
            while min(len(t.batches) for t in trainers) < taken:
                assert time.monotonic() < wait_until_taken and all(t.is_alive() for t in trainers), "trainers stalled"
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.03))
            stops = kill_when(cluster.planner.popen, lambda: writing_in(steps_dir))
        finally:
            for t in trainers:
                t.halt()
    finally:
        cluster.stop()

    # The ledger as the crash left it: it opens (sweeping the record in the making), parses,
    # has no gap, and holds every step a trainer got, with the samples the trainer got.
    records_at_kill = sorted(_step_records(steps_dir.parent))
    in_the_making = [_describe_temp(t) for t in temp_files(ledger_dir)]
    assert in_the_making, "killed while no record was being written"
    storage = LocalStorage(ledger_dir)
    assert temp_files(ledger_dir) == []
    read_every_generation(storage)
    reader = LedgerReader(storage)
    assert [(g.gen, g.start_step) for g in reader.generations] == [(1, 0)]
    crashed_last = assert_contiguous(reader)
    for t in trainers:
        for batch in t.batches:
            record = reader.record(batch["step"])
            assert record is not None, f"rank {t.rank} got step {batch['step']}, which the ledger lacks"
            recorded = [[(s, row) for s, row, _ in mb] for mb in record["ranks"][t.rank]]
            assert recorded == sample_ids([batch])[0], f"rank {t.rank}, step {batch['step']}"

    # The trainers' last common checkpoint; the ledger may hold steps past it (planned ahead).
    resume_at = min(len(t.batches) for t in trainers)
    checkpoint = {t.rank: t.states[resume_at - 1] for t in trainers}
    assert {s["next_step"] for s in checkpoint.values()} == {resume_at}
    log.info(
        "seed %d: trainers took %s batches (checkpoint at step %d); killed at stop %d with step records %s on disk, in the making: %s",
        seed,
        [len(t.batches) for t in trainers],
        resume_at,
        stops,
        records_at_kill,
        in_the_making,
    )

    cluster = start_cluster(config)
    try:
        second, _ = collect(cluster.endpoints_path, [0, 1], states=checkpoint)
        planner_log = cluster.planner.log_tail(400)
    finally:
        cluster.stop()
    assert f"job resumes at step {resume_at} from the ledger's record of step {resume_at - 1} (generation 1)" in planner_log

    delivered = collections.Counter()
    for batches in (*[[b for b in t.batches if b["step"] < resume_at] for t in trainers], *second.values()):
        for step in sample_ids(batches):
            delivered.update(sample for mb in step for sample in mb)
    assert max(delivered.values()) == 1, "a sample was delivered twice"
    assert set(delivered) == {(k, row) for k, s in enumerate(sources) for row in range(len(s.rows))}, "a sample was lost"

    storage = LocalStorage(ledger_dir)
    read_every_generation(storage)
    reader = LedgerReader(storage)
    assert [(g.gen, g.start_step) for g in reader.generations] == [(1, 0), (2, resume_at)]
    last = assert_contiguous(reader)
    assert [b["step"] for b in second[0]] == [b["step"] for b in second[1]] == list(range(resume_at, last + 1))
    assert crashed_last < last, "the planner had planned the whole epoch before the kill"
    # Steps the first run planned ahead of the checkpoint are superseded by the second run's.
    assert [reader.owner(s).gen for s in range(last + 1)] == [1] * resume_at + [2] * (last + 1 - resume_at)


# --- Through LedgerWriter alone: appending, compacting, thinning -------------------------------

SEGMENT_STEPS = 3
KEEP_DETAIL_STEPS = 3

LEDGER_WRITER = """
import hashlib, json, sys
from batchplane.core.storage import LocalStorage
from batchplane.planner import journal
root, start = sys.argv[1], int(sys.argv[2])
journal.SEGMENT_STEPS = int(sys.argv[3])
writer = journal.LedgerWriter(
    journal.LedgerReader(LocalStorage(root)), start_step=start, fingerprints={"data": "d"}, sources=("a", "b"),
    keep_detail_steps=int(sys.argv[4]),
)
gen = writer.generation.gen
digest = lambda record: hashlib.sha256(json.dumps(record, separators=(",", ":")).encode()).hexdigest()
print("generation", gen, flush=True)
def record_of(step):
    return {
        "step": step, "gen": gen, "shares": [0.75, 0.25], "take": {"a": [6 * step, 6], "b": [2 * step, 2]},
        "tokens": {"a": 60 * step % 997, "b": 20 * step % 991}, "bad": 0,
        "ranks": [[[[0, (6 * step + 2 * b + m) % 90, 0] for m in range(2)], [[1, (2 * step + b) % 60, 0]]] for b in range(2)],
        "after": {"step": step + 1, "cursors": [6 * step + 6, 2 * step + 2]},
        "consumed": {"a": [[0, 6 * step + 6]], "b": [[0, 2 * step + 2]]},
    }
step = start
for group in range(100_000):  # groups of 1 to 5 steps, as a planner records what it plans in one go
    records = [record_of(s) for s in range(step, step + 1 + group % 5)]
    writer.append(records)
    for record in records:
        thin = {k: v for k, v in record.items() if k not in journal.DETAIL_FIELDS}
        print("appended", record["step"], digest(record), digest(thin), flush=True)
    step += len(records)
    writer.compact(step - 1)  # every rank has moved past the steps before the group's last
"""


def _digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, separators=(",", ":")).encode()).hexdigest()


def _segments(folder: pathlib.Path) -> dict[str, range]:
    """A generation's segments (whole and thinned) and the steps each holds, by file name."""
    try:
        names = [e.name for e in os.scandir(folder / "segments") if e.name.endswith(".json.gz")]
    except FileNotFoundError:
        return {}
    return {name: range(int(name[:12]), int(name[13:25]) + 1) for name in names}


def _step_records(folder: pathlib.Path) -> set[int]:
    """The steps of a generation's step records: one step's (`<step>.json`) or a group's
    (`<first>-<last>.json`)."""
    try:
        names = [e.name for e in os.scandir(folder / "steps") if e.name.endswith(".json")]
    except FileNotFoundError:
        return set()
    return {s for n in names for s in range(int(n[:12]), int(n[13:25] if n[12] == "-" else n[:12]) + 1)}


def deleting_compacted(folder: pathlib.Path) -> bool:
    """Whether a compaction wrote its segment but has not deleted all its step records yet."""
    steps = _step_records(folder)
    return any(s in steps for covered in _segments(folder).values() for s in covered)


def deleting_thinned(folder: pathlib.Path) -> bool:
    """Whether a thinned segment was written and the whole one it replaces not yet deleted."""
    names = set(_segments(folder))
    return any(n.replace(".thin.json.gz", ".json.gz") in names for n in names if n.endswith(".thin.json.gz"))


#: Moments of a LedgerWriter's work to crash in, by name; each tells from the generation's
#: folder (the layout in `journal`'s docstring) whether the writer is there.
PHASES: dict[str, Callable[[pathlib.Path], bool]] = {
    "appending a record": lambda folder: writing_in(folder / "steps"),
    "writing a segment": lambda folder: writing_in(folder / "segments"),
    "deleting compacted records": deleting_compacted,
    "deleting a thinned segment's whole one": deleting_thinned,
}


def write_ledger_until_killed(
    root: pathlib.Path, start: int, phase: str, rng: random.Random
) -> tuple[int, dict[int, tuple[str, str]], str]:
    """Runs LEDGER_WRITER from step `start` and, a seeded number of steps in, kills it with
    SIGKILL in `phase` (see PHASES).

    Returns:
        Its generation; for each record it reported written, the digests of the record whole
        and thinned; what its generation's folder held at the kill.
    """
    out = root.parent / f"writer-{start}.out"
    with open(out, "w") as stdout:
        writer = subprocess.Popen(
            [sys.executable, "-c", LEDGER_WRITER, str(root), str(start), str(SEGMENT_STEPS), str(KEEP_DETAIL_STEPS)],
            stdout=stdout,
            text=True,
        )
    try:
        ready = f"appended {start + rng.randint(1, 6)} "
        give_up = time.monotonic() + 30
        while ready not in out.read_text():
            assert writer.poll() is None and time.monotonic() < give_up, f"the writer ended or stalled: {out.read_text()[-300:]}"
            time.sleep(0.001)
        gen = int(out.read_text().split()[1])
        folder = root / f"gen-{gen:06d}"
        kill_when(writer, lambda: PHASES[phase](folder))
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    lines = out.read_text().splitlines()
    written = {int(step): (whole, thin) for _, step, whole, thin in (line.split() for line in lines if line.startswith("appended"))}
    segments = _segments(folder)
    steps = _step_records(folder)
    landing = (
        f"temporary files in {[t.parent.name for t in temp_files(folder)]}; step records {sorted(steps)}; "
        f"segments {sorted(segments)}; records also in a segment {sorted(s for r in segments.values() for s in r if s in steps)}"
    )
    return gen, written, landing


@pytest.mark.parametrize("seed", range(3))
def test_a_ledger_writer_killed_in_any_ledger_write_leaves_a_ledger_that_opens(tmp_path: pathlib.Path, seed: int) -> None:
    """A run killed in each phase of writing (in a seeded order), each resumed at a checkpoint
    at or before the step after the last one the previous run reported written. After each kill
    the ledger opens whole, every generation's records parse, the steps have no gap, and every
    record the last run reported written reads back from its generation, byte for byte (or
    thinned: without its detail fields)."""
    rng = random.Random(seed)
    root = tmp_path / "ledger"
    runs: list[tuple[int, int]] = []  # (generation, start step)
    start = 0
    for phase in rng.sample(sorted(PHASES), len(PHASES)):
        gen, written, landing = write_ledger_until_killed(root, start, phase, rng)
        runs.append((gen, start))
        log.info("seed %d, generation %d from step %d, killed %s: %s", seed, gen, start, phase, landing)
        storage = LocalStorage(root)
        assert temp_files(root) == []
        read_every_generation(storage)
        reader = LedgerReader(storage)
        assert [(g.gen, g.start_step) for g in reader.generations] == runs
        last = assert_contiguous(reader)
        assert written and last >= max(written)
        for step, digests in written.items():
            record = reader.record(step)
            assert record["gen"] == gen and _digest(record) in digests, f"step {step}: {record}"
        assert all(reader.record(s)["gen"] < gen for s in range(start)), "a step before this run's start is not an earlier run's"
        start = rng.randint(max(start, max(written) - 3), max(written) + 1)  # where the trainers checkpointed
