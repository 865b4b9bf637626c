"""What every test process shares: one OpenMP thread for torch, in the test process and the
processes it starts (trainers, torchrun's workers), unless OMP_NUM_THREADS says otherwise; and
Python's faulthandler in each of them, so a process killed as hung says where it stood.

The models the tests train are tiny: a second intra-op thread buys nothing on them, and on a
loaded machine (or beside `make test`'s other pytest-xdist workers) its busy-waiting costs a
multiple of the work itself (the plain-loop step of test_hf_trainer.py: 0.9 s of CPU on one
thread, 34 s on two, on a 2-core machine under load). It is set here, before any test module
imports torch, because OpenMP reads it once, when torch is loaded. torchrun sets the same for
the workers it starts."""

from __future__ import annotations

import os
import pathlib

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Python process the tests start prints its threads' stacks on a fatal signal: a hung
# trainer is sent SIGABRT before it is killed (disturbed.wait_trainer), so a failure says where.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

TESTS = pathlib.Path(__file__).parent


#: The test files that take longest on 2 cores (measured with `--junitxml`, heaviest first): they
#: start first, so pytest-xdist's workers (`--dist loadfile`: whole files, in collection order)
#: do not finish on one of them while the others sit idle. The other integration files follow,
#: then the unit tests, short ones that fill the gaps at the end. tests/unit/test_test_order.py
#: checks that every file named here exists.
HEAVIEST_FIRST = (
    "integration/test_lightning.py",
    "integration/test_torchtitan.py",
    "integration/test_chaos.py",
    "integration/test_restarts.py",
    "integration/test_mesh_delivery.py",
    "integration/test_hf_trainer.py",
    "unit/test_types.py",
    "integration/test_kill_resume_dcp.py",
    "integration/test_bad_input.py",
    "integration/test_journal_chaos.py",
    "integration/test_resume_matrix.py",
    "integration/test_client_start.py",
    "unit/test_bench_vlm.py",
    "integration/test_launcher.py",
    "unit/test_invariants.py",
    "integration/test_demo.py",
)


def test_file_rank(path: pathlib.Path) -> tuple[int, int]:
    """Where a test file runs in the order: the heaviest first, then integration, then unit."""
    relative = path.relative_to(TESTS).as_posix()
    if relative in HEAVIEST_FIRST:
        return (0, HEAVIEST_FIRST.index(relative))
    return (1 if relative.startswith("integration/") else 2, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Orders the collected tests by file (`test_file_rank`), keeping each file's own order."""
    items.sort(key=lambda item: test_file_rank(item.path))
