"""What the trainer's thread waits for data: the time it spends blocked in the client's iterator,
whatever the calls and retries under it. The client sends the measure to its constructor (with
each GetBatch, and about once a second while a wait lasts), which exports it per rank."""

from __future__ import annotations

import threading
import time
import uuid

from batchplane.v1 import constructor_pb2

#: While the trainer waits, its client reports the wait this often (seconds).
NOTE_EVERY_S = 1.0


class WaitClock:
    """The trainer thread's waits for data: `begin` and `end` on the trainer's thread, `measure`
    on any (the fetch thread's requests carry it too)."""

    def __init__(self) -> None:
        self.client = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._total_s = 0.0  # finished waits
        self._since: float | None = None  # when the current wait began

    def begin(self) -> None:
        """The trainer asks for its next batch."""
        with self._lock:
            self._since = time.perf_counter()

    def end(self) -> float:
        """The trainer got its batch; returns how long it waited."""
        with self._lock:
            since, self._since = self._since, None
            waited = 0.0 if since is None else time.perf_counter() - since
            self._total_s += waited
        return waited

    @property
    def waiting(self) -> bool:
        return self._since is not None

    def measure(self) -> constructor_pb2.DataWait:
        """The waits so far, the current one included."""
        with self._lock:
            waiting = 0.0 if self._since is None else max(time.perf_counter() - self._since, 0.0)
            total = self._total_s + waiting
        return constructor_pb2.DataWait(client=self.client, total_s=total, waiting_s=waiting)
