"""Which loaders and constructors have joined the job, and whether they fit it. Pure
bookkeeping; no I/O, no grpc.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from batchplane.core.config import JobSettings
from batchplane.core.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class SourceFacts:
    """What a loader reported about a source it opened."""

    name: str
    num_rows: int


class Membership:
    """Registered loaders and constructors of one job.

    Args:
        job: The job's settings.
    """

    def __init__(self, job: JobSettings) -> None:
        self._job = job
        self._lock = threading.Lock()
        self._loader_address: dict[int, str] = {}
        self._num_rows: dict[int, int] = {}
        self._constructor_ranks: dict[int, tuple[int, ...]] = {}

    def register_loader(self, index: int, address: str, sources: Sequence[SourceFacts]) -> None:
        """Records loader `index`; a loader registering again replaces its address.

        Raises:
            InvalidArgument: an index outside the job, sources other than the configuration
                assigns it, an empty source, or a source whose row count changed.
        """
        job = self._job
        if not 0 <= index < job.loader_count:
            raise InvalidArgument(f"loader_index {index} is outside [0, {job.loader_count}) (loaders.count)")
        expected = [job.sources[k].name for k in job.loader_sources(index)]
        got = [s.name for s in sources]
        if got != expected:
            raise InvalidArgument(f"loader {index} must serve sources {expected}, it reported {got}")
        with self._lock:
            for k, facts in zip(job.loader_sources(index), sources):
                if facts.num_rows <= 0:
                    raise InvalidArgument(f"source {facts.name!r} has no rows")
                known = self._num_rows.get(k)
                if known is not None and known != facts.num_rows:
                    raise InvalidArgument(
                        f"source {facts.name!r} had {known} rows and now has {facts.num_rows}: "
                        "its files changed under a running job"
                    )
            for k, facts in zip(job.loader_sources(index), sources):
                self._num_rows[k] = facts.num_rows
            self._loader_address[index] = address

    def register_constructor(self, index: int, address: str, ranks: Sequence[int]) -> None:
        """Records constructor `index` serving `ranks`; registering again replaces its address.

        Raises:
            InvalidArgument: an index outside the configuration, or ranks other than those the
                configuration assigns the index (`constructors.ranks_per_constructor`
                consecutive global ranks): loaders count fetches by that layout.
        """
        job = self._job
        if not 0 <= index < job.constructor_count:
            raise InvalidArgument(f"constructor_index {index} is outside [0, {job.constructor_count}) for a mesh of {job.world} ranks")
        expected = job.constructor_ranks(index)
        if tuple(ranks) != expected:
            raise InvalidArgument(
                f"constructor {index} must serve ranks {list(expected)} (constructors.ranks_per_constructor = "
                f"{job.constructors.ranks_per_constructor} of {job.world} ranks), not {list(ranks)}"
            )
        with self._lock:
            self._constructor_ranks[index] = tuple(ranks)

    def constructor_ranks(self, index: int) -> tuple[int, ...] | None:
        """The ranks of constructor `index`, or None if it has not registered."""
        with self._lock:
            return self._constructor_ranks.get(index)

    def loader_of(self, source: int) -> str | None:
        """Address of the loader serving `source`, or None before it registered."""
        with self._lock:
            return self._loader_address.get(self._job.loader_of(source))

    def num_rows(self, source: int) -> int | None:
        with self._lock:
            return self._num_rows.get(source)

    @property
    def ready(self) -> bool:
        """True once every source has a registered loader."""
        with self._lock:
            return len(self._num_rows) == len(self._job.sources)

    def missing_loaders(self) -> list[int]:
        """Indices of loaders that have not registered."""
        with self._lock:
            return [i for i in range(self._job.loader_count) if i not in self._loader_address]
