"""Object storage for durable state such as the planner's ledger: a small interface with
write-once objects, one implementation on local disk and one in memory for unit tests (the
object store one, on S3, GCS or Azure, is `batchplane.core.object_storage.ObjectStorage`).

The interface is the part of an object store that conditional writes make safe:
`put_if_absent` creates an object atomically or reports that the key is taken, so two writers
of the same key never both believe they won, and a reader sees a whole object or none. Code
written against `Storage` can move from `LocalStorage` to an object store (S3 with
`If-None-Match: *`) without change.

Keys are '/'-separated paths such as "jobs/j1/ledger/000042.json": at most 1024 characters;
each segment 1 to 255 characters of [A-Za-z0-9._=-], not starting with '.' (so no '.' or '..').
Every implementation enforces the same rules (`check_key`), including one a file system
imposes: a key cannot be both an object and a folder of other keys ("a" and "a/b").

Raises the domain errors of `batchplane.core.errors`; imports nothing else of the services.
"""

from __future__ import annotations

import builtins
import os
import pathlib
import re
import secrets
import threading
from typing import Protocol

from batchplane.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

MAX_KEY_CHARS = 1024  # as S3
MAX_SEGMENT_CHARS = 255  # a file name on most file systems
TEMP_PREFIX = ".tmp-"  # LocalStorage's files in the making; never a key (keys never start with '.')

_SEGMENT = re.compile(r"[A-Za-z0-9._=-]+")
_PUT_ATTEMPTS = 5


class Storage(Protocol):
    """Write-once objects under '/'-separated keys."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Creates the object `key` holding `data`, atomically.

        Args:
            key: Where to store it.
            data: The whole content.

        Returns:
            True if this call created the object; False if the key was taken (nothing changes).

        Raises:
            InvalidArgument: The key breaks the key rules.
            FailedPrecondition: The key is a folder of other keys, or one of its folders is an
                object.
        """
        ...

    def get(self, key: str) -> bytes:
        """Returns the whole object.

        Raises:
            InvalidArgument: The key breaks the key rules.
            NotFound: There is no such object.
        """
        ...

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Returns bytes [start, end) of the object; `end` is clipped to its size.

        Raises:
            InvalidArgument: The key breaks the key rules.
            ValueError: start < 0 or end < start.
            NotFound: There is no such object.
        """
        ...

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Returns the keys that start with `prefix` (a plain string prefix), sorted."""
        ...

    def delete(self, key: str) -> None:
        """Deletes the object; deleting a missing one is not an error.

        Raises:
            InvalidArgument: The key breaks the key rules.
        """
        ...

    def describe(self) -> str:
        """Says which storage this is, for messages (e.g. "local storage at /data/ledger")."""
        ...


class LocalStorage(Storage):
    """Objects as files under a root directory, crash-safe and safe across processes.

    An object is written to a temporary file beside its final path, flushed to disk, then
    linked to the final path (`os.link` fails if the path exists, which makes the write
    conditional) and the directory is flushed too. A crash leaves the complete object or none,
    plus perhaps a temporary file, which readers ignore and `sweep` removes. `put_if_absent`
    also raises `Unavailable` if its temporary file or new folder keeps vanishing (a sweep by
    another instance removes them; the write is tried up to five times).

    Args:
        root: The directory; created if missing. Stray temporary files in it are swept.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = pathlib.Path(root).absolute()
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.root.parent)
        self.sweep()

    def describe(self) -> str:
        return f"local storage at {self.root}"

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        check_data(data)
        for _ in range(_PUT_ATTEMPTS):
            try:
                return self._put_once(key, path, data)
            except FileNotFoundError as e:
                # A concurrent sweep (another process opening the storage) removed our new
                # folder or our temporary file before the link; write again.
                error = e
        raise Unavailable(f"could not write {key!r} to {self.describe()}: its folder or temporary file kept vanishing") from error

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise self._not_found(key) from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        check_range(start, end)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise self._not_found(key) from None

    def list(self, prefix: str = "") -> builtins.list[str]:
        folder = prefix.rpartition("/")[0]
        if folder and not is_key(folder):
            return []  # no key has this prefix
        keys = []
        for dirpath, dirnames, filenames in os.walk(self.root / folder):
            dirnames[:] = [d for d in dirnames if is_key(d)]
            relative = pathlib.Path(dirpath).relative_to(self.root).as_posix()
            base = "" if relative == "." else relative + "/"
            keys.extend(base + name for name in filenames if is_key(name))
        return sorted(k for k in keys if k.startswith(prefix))

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
            # Missing, or a folder (Linux says EISDIR, macOS EPERM): not an object.
            if path.is_file():
                raise
            return
        _fsync_dir(path.parent)
        self._remove_empty_folders(path.parent)

    def sweep(self) -> int:
        """Removes temporary files left by crashed writers, and empty folders.

        Safe while others write: a writer whose temporary file vanishes writes again.

        Returns:
            The number of temporary files removed.
        """
        removed = 0
        for dirpath, _, filenames in os.walk(self.root, topdown=False):
            folder = pathlib.Path(dirpath)
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    _unlink_quietly(folder / name)
                    removed += 1
            if folder != self.root:
                self._remove_empty_folders(folder)
        return removed

    def _path(self, key: str) -> pathlib.Path:
        check_key(key)
        return self.root.joinpath(*key.split("/"))

    def _not_found(self, key: str) -> NotFound:
        return NotFound(f"no object {key!r} in {self.describe()}")

    def _conflict(self, key: str, why: str) -> FailedPrecondition:
        return FailedPrecondition(f"cannot put {key!r} in {self.describe()}: {why}")

    def _make_folders(self, key: str, folder: pathlib.Path) -> None:
        """Creates the missing folders down to `folder`, flushing each new entry to disk."""
        missing = []
        while not folder.is_dir() and folder != self.root:
            missing.append(folder)
            folder = folder.parent
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                if not folder.is_dir():
                    name = folder.relative_to(self.root).as_posix()
                    raise self._conflict(key, f"{name!r} is an object, not a folder") from None
                continue
            _fsync_dir(folder.parent)

    def _put_once(self, key: str, path: pathlib.Path, data: bytes) -> bool:
        """One attempt of `put_if_absent`: temporary file, link, flush of the folder."""
        self._make_folders(key, path.parent)
        temp = _write_temp(path.parent, data)
        try:
            created = self._link(key, temp, path)
        finally:
            _unlink_quietly(temp)
        if created:
            _fsync_dir(path.parent)
        return created

    def _link(self, key: str, temp: pathlib.Path, path: pathlib.Path) -> bool:
        """Links the written temporary file to the object's path; False if the key is taken."""
        try:
            os.link(temp, path)
        except FileExistsError:
            if path.is_dir():
                raise self._conflict(key, "it is a folder of other keys") from None
            return False
        return True

    def _remove_empty_folders(self, folder: pathlib.Path) -> None:
        """Removes `folder` and its parents below the root while they are empty."""
        while folder != self.root:
            try:
                folder.rmdir()
            except OSError:  # not empty, or already gone
                return
            _fsync_dir(folder.parent)
            folder = folder.parent


class MemoryStorage(Storage):
    """Objects in a dict, with the semantics of `LocalStorage`; thread-safe. For unit tests."""

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        return f"memory storage {id(self):#x}"

    def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        check_data(data)
        with self._lock:
            if key in self._objects:
                return False
            self._check_no_conflict(key)
            self._objects[key] = bytes(data)
            return True

    def get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._objects[key]
            except KeyError:
                raise NotFound(f"no object {key!r} in {self.describe()}") from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_key(key)
        check_range(start, end)
        return self.get(key)[start:end]

    def list(self, prefix: str = "") -> builtins.list[str]:
        with self._lock:
            return sorted(k for k in self._objects if k.startswith(prefix))

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)

    def _check_no_conflict(self, key: str) -> None:
        """Refuses what a file system cannot hold: "a/b" beside "a". Called under the lock."""
        parts = key.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in self._objects:
                raise FailedPrecondition(f"cannot put {key!r} in {self.describe()}: {folder!r} is an object, not a folder")
        if any(k.startswith(key + "/") for k in self._objects):
            raise FailedPrecondition(f"cannot put {key!r} in {self.describe()}: it is a folder of other keys")


def check_key(key: str) -> None:
    """Enforces the key rules.

    A key is at most MAX_KEY_CHARS characters of '/'-separated segments; each segment is 1 to
    MAX_SEGMENT_CHARS characters of [A-Za-z0-9._=-] and does not start with '.' (so no '.' or
    '..' segments, and no clash with temporary files).

    Raises:
        InvalidArgument: Naming the key and the rule it breaks.
    """
    problem = _key_problem(key)
    if problem:
        raise InvalidArgument(f"bad storage key {key!r}: {problem}")


def _key_problem(key: object) -> str | None:
    if not isinstance(key, str):
        return f"must be a str, not {type(key).__name__}"
    if not key:
        return "must not be empty"
    if len(key) > MAX_KEY_CHARS:
        return f"must be at most {MAX_KEY_CHARS} characters, has {len(key)}"
    for segment in key.split("/"):
        if not segment:
            return "must not start or end with '/' or contain '//' (empty segment)"
        if len(segment) > MAX_SEGMENT_CHARS:
            return f"each segment must be at most {MAX_SEGMENT_CHARS} characters"
        if not _SEGMENT.fullmatch(segment):
            return f"segment {segment!r} has a character outside [A-Za-z0-9._=-]"
        if segment.startswith("."):
            return f"segment {segment!r} starts with '.'"
    return None


def is_key(key: str) -> bool:
    """Whether `key` follows the key rules (see `check_key`)."""
    return _key_problem(key) is None


def check_data(data: bytes) -> None:
    """Refuses object data that is not bytes-like (bytes, bytearray, memoryview).

    Raises:
        TypeError: Naming the type given.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"object data must be bytes, not {type(data).__name__}")


def check_range(start: int, end: int) -> None:
    """Refuses a byte range [start, end) with start < 0 or end < start.

    Raises:
        ValueError: Naming the bound.
    """
    if start < 0:
        raise ValueError(f"range start must be >= 0, got {start}")
    if end < start:
        raise ValueError(f"range end must be >= start, got [{start}, {end})")


def _write_temp(folder: pathlib.Path, data: bytes) -> pathlib.Path:
    """Writes `data` to a new temporary file in `folder` and flushes it to disk."""
    temp = folder / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(temp)
        raise
    return temp


def _fsync_dir(folder: pathlib.Path) -> None:
    """Flushes a directory's entries to disk, so that a created or removed name survives a crash.

    A directory that is gone (removed by a concurrent sweep) has nothing left to flush.
    """
    try:
        fd = os.open(folder, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: pathlib.Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
