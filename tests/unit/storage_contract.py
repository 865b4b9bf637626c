"""The contract of `batchplane.core.storage.Storage`: one set of tests that every implementation
passes. A test module runs them against its implementations by importing them and defining
two fixtures:

    storage       an empty storage
    new_storage   a callable that returns another empty storage each call (for hypothesis,
                  whose examples each need a fresh one)

tests/unit/test_storage.py runs them on LocalStorage, MemoryStorage and ObjectStorage over
obstore's in-memory store; tests/integration/test_ledger_bucket.py on ObjectStorage over a real
S3 endpoint.
"""

from __future__ import annotations

import string
import threading
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchplane.core.errors import FailedPrecondition, InvalidArgument, NotFound
from batchplane.core.storage import Storage

NewStorage = Callable[[], Storage]

# --- Semantics -------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 4096])
def test_put_then_get_round_trips(storage: Storage, data: bytes) -> None:
    assert storage.put_if_absent("jobs/j1/ledger/000001.json", data) is True
    assert storage.get("jobs/j1/ledger/000001.json") == data


def test_bytearray_and_memoryview_are_data(storage: Storage) -> None:
    assert storage.put_if_absent("a", bytearray(b"abc"))
    assert storage.put_if_absent("b", memoryview(b"xyz")[1:])
    assert (storage.get("a"), storage.get("b")) == (b"abc", b"yz")
    with pytest.raises(TypeError, match="must be bytes, not str"):
        storage.put_if_absent("c", "text")  # type: ignore[arg-type]


def test_put_if_absent_keeps_the_first_content(storage: Storage) -> None:
    assert storage.put_if_absent("k", b"first") is True
    assert storage.put_if_absent("k", b"second") is False
    assert storage.get("k") == b"first"
    assert storage.list() == ["k"]


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [(0, 10, b"0123456789"), (2, 5, b"234"), (3, 3, b""), (7, 100, b"789"), (10, 20, b""), (50, 60, b"")],
)
def test_get_range_returns_the_slice_clipped_to_the_size(storage: Storage, start: int, end: int, expected: bytes) -> None:
    storage.put_if_absent("digits", b"0123456789")
    assert storage.get_range("digits", start, end) == expected


@pytest.mark.parametrize(("start", "end", "problem"), [(-1, 3, "start must be >= 0"), (5, 4, "end must be >= start")])
def test_get_range_refuses_bad_ranges(storage: Storage, start: int, end: int, problem: str) -> None:
    storage.put_if_absent("digits", b"0123456789")
    with pytest.raises(ValueError, match=problem):
        storage.get_range("digits", start, end)


def test_missing_objects_are_not_found_by_name(storage: Storage) -> None:
    storage.put_if_absent("a/b", b"x")
    for key in ("missing", "a", "a/b/c", "a/c"):
        with pytest.raises(NotFound) as caught:
            storage.get(key)
        assert repr(key) in str(caught.value) and storage.describe() in str(caught.value)
        for start, end in ((0, 1), (0, 0), (5, 9)):
            with pytest.raises(NotFound, match=repr(key)):
                storage.get_range(key, start, end)


def test_list_returns_the_keys_with_a_prefix_sorted(storage: Storage) -> None:
    keys = ["ledger/000010", "ledger/000002", "ledger/sub/x", "ledger2", "leg", "other/a=1/b.json", "z"]
    for key in keys:
        assert storage.put_if_absent(key, key.encode())
    assert storage.list() == sorted(keys)
    assert storage.list("ledger/") == ["ledger/000002", "ledger/000010", "ledger/sub/x"]
    assert storage.list("ledger") == ["ledger/000002", "ledger/000010", "ledger/sub/x", "ledger2"]
    assert storage.list("le") == ["ledger/000002", "ledger/000010", "ledger/sub/x", "ledger2", "leg"]
    assert storage.list("ledger/0000") == ["ledger/000002", "ledger/000010"]
    assert storage.list("other/a=1/") == ["other/a=1/b.json"]
    for nothing in ("nothing", "nothing/", "z/", "../", "a//", "ledger/.", "/"):
        assert storage.list(nothing) == [], nothing


def test_delete_is_idempotent_and_frees_the_key(storage: Storage) -> None:
    storage.put_if_absent("a/b/c", b"1")
    storage.put_if_absent("a/d", b"2")
    storage.delete("a/b/c")
    storage.delete("a/b/c")
    storage.delete("never/was")
    storage.delete("a")  # a folder, not an object
    assert storage.list() == ["a/d"]
    assert storage.put_if_absent("a/b", b"3"), "the emptied folder a/b can become an object"
    assert storage.put_if_absent("a/b", b"4") is False
    assert storage.get("a/b") == b"3"


def test_a_key_cannot_be_both_an_object_and_a_folder(storage: Storage) -> None:
    storage.put_if_absent("a/b", b"1")
    with pytest.raises(FailedPrecondition, match="cannot put 'a' in .*: it is a folder of other keys"):
        storage.put_if_absent("a", b"2")
    storage.put_if_absent("c", b"1")
    with pytest.raises(FailedPrecondition, match="'c/d/e'.*'c' is an object, not a folder"):
        storage.put_if_absent("c/d/e", b"2")
    with pytest.raises(FailedPrecondition, match="'c/d'.*'c' is an object, not a folder"):
        storage.put_if_absent("c/d", b"2")
    assert storage.list() == ["a/b", "c"]


def test_eight_threads_racing_for_a_key_make_exactly_one_winner(storage: Storage) -> None:
    threads = 8
    for round_ in range(10):
        key = f"race/{round_}"
        barrier = threading.Barrier(threads)
        won = [False] * threads

        def put(i: int) -> None:
            barrier.wait()
            won[i] = storage.put_if_absent(key, f"thread {i}".encode() * (i + 1))

        workers = [threading.Thread(target=put, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert won.count(True) == 1, won
        winner = won.index(True)
        assert storage.get(key) == f"thread {winner}".encode() * (winner + 1)


# --- Key rules -------------------------------------------------------------------------------

SEGMENT_CHARS = string.ascii_letters + string.digits + "._=-"
segments = st.text(SEGMENT_CHARS, min_size=1, max_size=20).filter(lambda s: not s.startswith("."))
keys = st.lists(segments, min_size=1, max_size=5).map("/".join)


@st.composite
def bad_keys(draw: st.DrawFn) -> str:
    parts = draw(st.lists(segments, min_size=1, max_size=4))
    i = draw(st.integers(0, len(parts) - 1))
    how = draw(st.sampled_from(["char", "empty", "dot", "dotdot", "hidden", "lead", "trail", "long"]))
    if how == "char":
        bad = draw(st.characters(exclude_characters=SEGMENT_CHARS + "/", exclude_categories=["Cs"]))
        at = draw(st.integers(0, len(parts[i])))
        parts[i] = parts[i][:at] + bad + parts[i][at:]
    elif how == "empty":
        parts.insert(i, "")
    elif how in ("dot", "dotdot"):
        parts[i] = "." if how == "dot" else ".."
    elif how == "hidden":
        parts[i] = "." + parts[i]
    elif how == "lead":
        return "/" + "/".join(parts)
    elif how == "trail":
        return "/".join(parts) + "/"
    else:
        parts[i] = "x" * 256
    return "/".join(parts)


# `new_storage` gives each example a fresh storage, so the function-scoped fixture is safe.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=keys)
def test_valid_keys_are_stored(new_storage: NewStorage, key: str) -> None:
    storage = new_storage()
    assert storage.put_if_absent(key, key.encode())
    assert storage.get(key) == key.encode()
    assert storage.list() == [key]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=bad_keys())
def test_invalid_keys_are_refused_naming_the_key(new_storage: NewStorage, key: str) -> None:
    storage = new_storage()
    for call in (
        lambda: storage.put_if_absent(key, b"x"),
        lambda: storage.get(key),
        lambda: storage.get_range(key, 0, 1),
        lambda: storage.delete(key),
    ):
        with pytest.raises(InvalidArgument) as caught:
            call()
        assert f"bad storage key {key!r}: " in str(caught.value)
    assert storage.list() == []


@pytest.mark.parametrize(
    ("key", "rule"),
    [
        ("", "must not be empty"),
        ("a//b", "empty segment"),
        ("/a", "empty segment"),
        ("a/../b", "segment '..' starts with '.'"),
        (".tmp-123", "segment '.tmp-123' starts with '.'"),
        ("a b", "character outside"),
        ("x" * 1025, "at most 1024 characters"),
        ("a/" + "x" * 256, "at most 255 characters"),
        (b"bytes", "must be a str, not bytes"),
    ],
)
def test_invalid_keys_name_the_rule(storage: Storage, key: str, rule: str) -> None:
    with pytest.raises(InvalidArgument, match=rule):
        storage.get(key)
