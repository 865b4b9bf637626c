"""The order `make test` runs its files in (tests/conftest.py): every file it names as heaviest
exists, and the order puts them first, then the other integration files, then the unit tests."""

from __future__ import annotations

import conftest


def test_every_file_named_heaviest_exists() -> None:
    missing = [name for name in conftest.HEAVIEST_FIRST if not (conftest.TESTS / name).is_file()]
    assert not missing, f"tests/conftest.py HEAVIEST_FIRST names files that are gone: {missing}"


def test_the_heaviest_run_first_then_integration_then_unit() -> None:
    files = sorted(conftest.TESTS.glob("*/test_*.py"), key=conftest.test_file_rank)
    names = [f.relative_to(conftest.TESTS).as_posix() for f in files]
    assert names[: len(conftest.HEAVIEST_FIRST)] == list(conftest.HEAVIEST_FIRST)
    rest = names[len(conftest.HEAVIEST_FIRST) :]
    kinds = [name.split("/")[0] for name in rest]
    assert kinds == sorted(kinds), "the other integration files run before the unit tests"
