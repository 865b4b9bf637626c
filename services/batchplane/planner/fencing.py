"""Fencing of the ledger's writers: one planner at a time writes a job's ledger. A second
planner opened on the same ledger (a new pod while the old one still runs, a second
`batchplane up` of the job) takes it over, and the first stops instead of writing beside it.

Every planner that opens the ledger for writing claims the next *writer epoch*: it creates
`epochs/<N+1>` (12 digits) with put_if_absent, where N is the newest epoch it lists, and tries
the number after when another planner won that one. Epochs are never deleted, and every claim
starts after an existing one, so they are numbered 1, 2, 3... without a gap: any claim newer
than epoch N means that `epochs/<N+1>` exists. So the check is one read of that one key: a GET
on an object store (a 404 while nobody claimed), an open() on local disk.

`FencedStorage` makes that check before every put of the ledger (a step's record, a training
report, a segment, a generation's head). Once the key exists, the put is refused with `Fenced`,
a FailedPrecondition that names both claims, and so is every later one, without asking again;
the planner's handler (`on_fenced`) logs it and ends the process.

The window it leaves: a claim that lands between a check and the put it guards lets that one
put through, into the older planner's own generation (nothing is overwritten: every key is
put once), and the plan it records may still be served. Its next put is refused. Deletes are
not checked (compaction deleting the step records it has just folded into a segment, whose put
was checked: the records stay in the segment). A fenced planner that plans nothing notices at
its next put. Without a clock or a lease, nothing closes the window further; it is the same
as the window between a plan's record and its serving, which a restarted planner already
handles.

No threads, clocks or sockets: I/O only through the `Storage` given.
"""

from __future__ import annotations

import builtins
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from batchplane.core.errors import FailedPrecondition, NotFound
from batchplane.core.storage import Storage

log = logging.getLogger(__name__)

#: Where the writer epochs lie in the ledger.
EPOCHS = "epochs/"
_EPOCH = re.compile(r"^epochs/(\d{12})$")


def epoch_key(epoch: int) -> str:
    """The key of writer epoch `epoch`."""
    return f"{EPOCHS}{epoch:012d}"


class Fenced(FailedPrecondition):
    """A newer planner claimed the ledger: this one must not write it any more.

    Attributes:
        epoch: This writer's epoch.
        newer: What the newer claim says of itself (its epoch object), or {}.
    """

    def __init__(self, message: str, *, epoch: int, newer: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.newer = dict(newer)


def claim_epoch(storage: Storage, *, owner: Mapping[str, Any]) -> int:
    """Claims the next writer epoch of the ledger on `storage`.

    Args:
        owner: Who claims (e.g. host and pid), stored in the epoch object for the message of
            the writer it fences.
    Returns:
        The epoch claimed: one more than the newest one listed, or more where other writers
        claimed those meanwhile.
    """
    listed = [int(m.group(1)) for key in storage.list(EPOCHS) if (m := _EPOCH.match(key))]
    epoch = max(listed, default=0) + 1
    while not storage.put_if_absent(epoch_key(epoch), json.dumps({"epoch": epoch, **owner}).encode()):
        log.info("writer epoch %d of %s was claimed by another planner; trying %d", epoch, storage.describe(), epoch + 1)
        epoch += 1
    return epoch


def check_epoch(storage: Storage, epoch: int) -> None:
    """Checks that no writer claimed the ledger after epoch `epoch` (one read).

    Raises:
        Fenced: `epochs/<epoch + 1>` exists.
    """
    try:
        data = storage.get(epoch_key(epoch + 1))
    except NotFound:
        return
    try:
        newer = json.loads(data)
    except ValueError:
        newer = {}
    if not isinstance(newer, dict):
        newer = {}
    who = ", ".join(f"{k} {v}" for k, v in newer.items() if k != "epoch")
    raise Fenced(
        f"this planner (writer epoch {epoch}) is fenced: another planner claimed the ledger at {storage.describe()} as writer "
        f"epoch {epoch + 1}{f' ({who})' if who else ''}; only one planner may write a job's ledger, so this one stops "
        "without writing",
        epoch=epoch,
        newer=newer,
    )


class FencedStorage(Storage):
    """The ledger's storage as writer epoch `epoch` sees it: every put checks the fence first
    (see the module docstring); reads, lists and deletes pass through.

    Args:
        storage: The ledger's storage.
        epoch: This writer's epoch (`claim_epoch`).
        on_fenced: Called with the `Fenced` error the first time a put is refused (the
            planner ends its process there); default: nothing (the put raises).
    """

    def __init__(self, storage: Storage, *, epoch: int, on_fenced: Callable[[Fenced], None] | None = None) -> None:
        self.storage = storage
        self.epoch = epoch
        self._on_fenced = on_fenced
        self._fenced: Fenced | None = None

    def check(self) -> None:
        """Raises `Fenced` if a newer writer claimed the ledger (asks the storage until then)."""
        if self._fenced is None:
            try:
                check_epoch(self.storage, self.epoch)
            except Fenced as exc:
                self._fenced = exc
                log.error("%s", exc)
                if self._on_fenced is not None:
                    self._on_fenced(exc)
        if self._fenced is not None:
            raise self._fenced

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.check()
        return self.storage.put_if_absent(key, data)

    def get(self, key: str) -> bytes:
        return self.storage.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.storage.get_range(key, start, end)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.storage.list(prefix)

    def delete(self, key: str) -> None:
        self.storage.delete(key)

    def describe(self) -> str:
        return self.storage.describe()
