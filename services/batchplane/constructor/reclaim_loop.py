"""The journal's reclaimer in the producer process (`journal.reclaim`): a thread that runs
`batchplane.journal.reclaim.Reclaimer.run_once` every `RECLAIM_EVERY_S` seconds, outside the
producer's critical path. A failed round (the storage, a lost race) is logged and the next
round tries again; rounds are idempotent. What may be deleted is `journal.retention`'s rule:
committed steps below the lowest live mark of the manifest (every mark counts: checkpoint
marks, start holds and progress marks, so the floor is never above a checkpoint's), at least
`journal.min_age_s` old. Decides nothing itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from batchplane.core.storage import Storage
from batchplane.journal.reclaim import ReclaimReport, Reclaimer
from batchplane.journal.retention import RetentionPolicy

log = logging.getLogger(__name__)

#: Seconds between rounds.
RECLAIM_EVERY_S = 30.0


class ReclaimLoop:
    """Runs the reclaimer periodically (see the module docstring).

    Args:
        storage: The journal.
        prefix: Its folder.
        min_age_s: Nothing younger is deleted, in seconds (`journal.min_age_s`).
        every_s: Seconds between rounds (the first runs one interval after `start`).
        make_reclaimer: Builds the reclaimer (tests inject one); None: a `Reclaimer` of
            `storage` with `min_age_s`. Called in the loop's thread, again after a failure.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        prefix: str = "",
        min_age_s: float,
        every_s: float = RECLAIM_EVERY_S,
        make_reclaimer: Callable[[], Reclaimer] | None = None,
    ) -> None:
        self._storage = storage
        self._prefix = prefix
        self._min_age_s = min_age_s
        self.every_s = every_s
        self._make = make_reclaimer or self._reclaimer
        self._reclaimer_now: Reclaimer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Rounds that completed, and those that failed.
        self.rounds = 0
        self.failures = 0
        #: The last completed round's report.
        self.last: ReclaimReport | None = None

    def start(self) -> ReclaimLoop:
        """Starts the thread."""
        self._thread = threading.Thread(target=self._run, name="journal-reclaim", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the loop (a round in progress finishes first, up to `timeout_s`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def run_once(self) -> ReclaimReport | None:
        """One round; None if it failed (logged)."""
        try:
            if self._reclaimer_now is None:
                self._reclaimer_now = self._make()
            report = self._reclaimer_now.run_once()
        except Exception as exc:  # noqa: BLE001 - reclaiming is never in the critical path: next round
            self.failures += 1
            self._reclaimer_now = None
            log.warning("journal reclaimer: round failed (%s); trying again in %.0f s", exc, self.every_s)
            return None
        self.rounds += 1
        self.last = report
        return report

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.run_once()

    def _reclaimer(self) -> Reclaimer:
        return Reclaimer(self._storage, prefix=self._prefix, policy=RetentionPolicy(min_age_s=self._min_age_s))
