"""LocalStorage across processes: processes racing for keys make exactly one winner each, and
writers killed with SIGKILL mid-write leave whole objects only (what the planner's ledger relies
on). Spawns processes, so integration; the rest of the storage tests are in
tests/unit/test_storage.py."""

from __future__ import annotations

import hashlib
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from batchplane.core.storage import TEMP_PREFIX, LocalStorage

pytestmark = pytest.mark.integration


def temp_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX))


RACER = """
import sys
from batchplane.core.storage import LocalStorage
store, me = LocalStorage(sys.argv[1]), sys.argv[2]
sys.stdin.readline()  # start together
for i in range(int(sys.argv[3])):
    if store.put_if_absent(f"race/{i}", me.encode()):
        print(i, flush=True)
"""


def test_processes_racing_for_keys_make_exactly_one_winner_each(tmp_path: pathlib.Path) -> None:
    keys = 60
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path), f"process {p}", str(keys)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in range(4)
    ]
    for racer in racers:
        racer.stdin.write("go\n")  # type: ignore[union-attr]
        racer.stdin.flush()  # type: ignore[union-attr]
    wins = [[int(line) for line in racer.communicate(timeout=60)[0].split()] for racer in racers]
    assert all(racer.returncode == 0 for racer in racers)
    assert sorted(i for won in wins for i in won) == list(range(keys)), "each key has exactly one winner"
    store = LocalStorage(tmp_path)
    for p, won in enumerate(wins):
        assert all(store.get(f"race/{i}") == f"process {p}".encode() for i in won)


WRITER = """
import hashlib, random, sys
from batchplane.core.storage import LocalStorage
store, run, rng = LocalStorage(sys.argv[1]), sys.argv[2], random.Random(sys.argv[2])
for i in range(100_000):
    payload = rng.randbytes(rng.randrange(1 << 20))
    data = hashlib.sha256(payload).digest() + payload
    print("writing", i, flush=True)
    assert store.put_if_absent(f"{run}/{i % 7}/{i:06d}", data)
    print("stored", i, flush=True)
"""


def write_until_killed(root: pathlib.Path, run: str, rng: random.Random) -> list[str]:
    """Runs WRITER and kills it with SIGKILL a random moment after it starts writing an object,
    a few objects in; returns the keys it reported stored."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), run], stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        target = f"writing {rng.randint(1, 4)}"
        while not lines or lines[-1] != target:
            lines.append(writer.stdout.readline().strip())  # type: ignore[union-attr]
        time.sleep(rng.uniform(0, 0.004))
    finally:
        writer.send_signal(signal.SIGKILL)
        lines += writer.communicate(timeout=30)[0].split("\n")[:-1]  # the kill may cut the last line short
    assert writer.returncode == -signal.SIGKILL, f"the writer ended before the kill: {lines[-3:]}"
    stored = [int(line.split()[1]) for line in lines if line.startswith("stored")]
    return [f"{run}/{i % 7}/{i:06d}" for i in stored]


@pytest.mark.parametrize("seed", range(5))
def test_local_storage_survives_writers_killed_mid_stream(tmp_path: pathlib.Path, seed: int) -> None:
    """After each kill, a fresh LocalStorage holds whole objects only, every one a writer
    reported stored among them, and its sweep has removed the writers' temporary files."""
    rng = random.Random(seed)
    stored: list[str] = []
    for run in range(3):
        stored += write_until_killed(tmp_path, f"seed{seed}-run{run}", rng)
        store = LocalStorage(tmp_path)
        keys = store.list()
        assert set(stored) <= set(keys)
        for key in keys:
            data = store.get(key)
            assert hashlib.sha256(data[32:]).digest() == data[:32], f"{key} is torn"
        assert temp_files(tmp_path) == []
