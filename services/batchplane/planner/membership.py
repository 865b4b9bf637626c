"""Which loaders and constructors have joined the job, whether they fit it, and how each
source's windows are routed over the replicas of its loader group (see `core.routing`). Pure
bookkeeping; no I/O, no grpc.

Replicas join and leave while the job runs. A change re-routes each of the group's sources from
its *frontier*, the first window the planner has not asked any replica about, so no window ever
changes owner once asked about (I1). A leaving replica learns where its windows end
(`deregister_loader`) and serves them until they are consumed.

A replica may have a *shadow*: a hot standby that reads the same windows (the planner mirrors the
replica's summary requests to it) but serves nothing. When the replica fails, `promote` makes the
shadow serve under the replica's id: plans name its address from then on. The failed replica,
restarted, registers again and becomes the new shadow.

A replica that fails without a shadow is *adopted* (`adopt`): since a loader reads any window it
is asked for, a live replica of its group serves the failed one's windows under its own address,
and windows from the frontier on are routed over the live replicas only. With none live, the next
replica to join adopts them (a cluster's replacement pod, which comes back under a new name). A
failed replica that registers again (a local restart, under its id) serves its windows again.

A replica that sent a constructor samples other than the plan's digests is *fenced* (`fence`):
adopted like a failed one, and never again routed to, promoted or let register under its id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from batchplane.core.config import JobSettings
from batchplane.core.errors import FailedPrecondition, InvalidArgument
from batchplane.core.order import SampleOrder
from batchplane.core.routing import Routing, last_owned, window_of, window_span
from batchplane.planner.source_changes import FileFacts, SourceRecord, compare_source


@dataclasses.dataclass(frozen=True)
class Joined:
    """What a loader's registration meant."""

    #: A process registered again under a new incarnation: it restarted (a failure survived).
    restarted: bool = False
    #: It serves as the shadow of its replica id (it reads, the planner routes nothing to it).
    shadow: bool = False
    #: The group's earlier replicas were dropped: they had reported other source facts than
    #: the job's ledger records, and this loader reported those (see `expect_sources`).
    displaced: bool = False


class SummaryTarget(NamedTuple):
    """Where the planner asks for a summary."""

    #: Address of the replica owning the window.
    address: str
    #: The window's end.
    window_end: int
    #: The source's routing.
    routing: Routing
    #: The owning replica: (loader group, replica id).
    owner: tuple[int, str]
    #: Address of the owner's shadow, which follows the same requests ("" for none).
    shadow: str = ""
    #: The source's rows (what a summary's rows must lie below).
    num_rows: int | None = None
    #: Where the source's stream ends (epochs x repeat x rows; None: it never ends).
    stream_end: int | None = None


@dataclasses.dataclass(frozen=True)
class SourceFacts:
    """What a loader reported about a source it opened."""

    name: str
    num_rows: int
    row_group_sizes: tuple[int, ...] = ()
    #: Its files (`SourceInfo.files`); empty from a loader that does not report them.
    files: tuple[FileFacts, ...] = ()

    @property
    def digest(self) -> str:
        """A digest of the row groups (what the ledger records of them)."""
        return row_groups_digest(self.row_group_sizes)

    @property
    def record(self) -> SourceRecord:
        """What identifies the source's data, as the ledger records it."""
        return SourceRecord(self.num_rows, self.digest, self.files or None)


def row_groups_digest(sizes: Sequence[int]) -> str:
    """A digest of a source's row group sizes: 16 hex digits."""
    return hashlib.sha256(",".join(str(int(n)) for n in sizes).encode()).hexdigest()[:16]


class Membership:
    """Registered loaders and constructors of one job.

    Args:
        job: The job's settings.
    """

    def __init__(self, job: JobSettings) -> None:
        self._job = job
        self._lock = threading.Lock()
        self._replicas: dict[int, dict[str, str]] = {}  # loader group -> replica id -> address
        self._num_rows: dict[int, int] = {}
        self._orders: dict[int, SampleOrder] = {}
        self._routing: dict[int, Routing] = {}
        self._frontier: dict[int, int] = {}  # source -> first window no replica was asked about
        self._departed: dict[tuple[int, str], str] = {}  # (group, replica) -> address, while it drains
        self._incarnations: dict[tuple[int, str, bool], str] = {}  # (group, replica, shadow) -> the process's incarnation
        self._shadows: dict[tuple[int, str], str] = {}  # (group, replica) -> its shadow's address
        self._promoted: set[tuple[int, str]] = set()  # replicas a shadow took over
        self._failed: dict[tuple[int, str], str | None] = {}  # (group, failed replica) -> its adopter (None: none yet)
        self._fenced: set[tuple[int, str]] = set()  # (group, replica) that sent altered samples: failed for good
        self._constructor_ranks: dict[int, tuple[int, ...]] = {}
        self._rejoined: dict[int, int] = {}
        self._files: dict[int, tuple[FileFacts, ...]] = {}  # source -> its files, as first reported
        self._expected: dict[str, SourceRecord] = {}  # source name -> what the ledger records of it
        self._committed = False  # the job started: the sources' facts are final

    def register_loader(
        self, index: int, address: str, sources: Sequence[SourceFacts], *, replica: str = "", incarnation: str = "", shadow_of: str = ""
    ) -> Joined:
        """Records replica `replica` of loader group `index` (default id: the index); a replica
        registering again replaces its address, a new one gets windows from the frontier on.
        `shadow_of`: it registers as the shadow of that replica id. A replica's process that
        comes back after its shadow took over becomes the shadow; a promoted shadow is the
        replica.

        A replica id that left the group (`deregister_loader`) joins again when its process
        restarted (a new incarnation): it is then a new replica of the group.

        Before the job starts, a loader whose facts are those the job's ledger records
        (`expect_sources`) displaces the group's replicas that reported other facts: whoever
        registered first does not decide them.

        Raises:
            InvalidArgument: an index outside the job, sources other than the configuration
                assigns it, an empty source, or a source whose row count or row groups differ
                from the group's other replicas' (its files changed under a running job).
            FailedPrecondition: the replica left the group and registers as the same process, or
                was fenced (`fence`).
        """
        replica = replica or str(index)
        job = self._job
        if not 0 <= index < job.loader_count:
            raise InvalidArgument(f"loader_index {index} is outside [0, {job.loader_count}) (loaders.count)")
        expected = [job.sources[k].name for k in job.loader_sources(index)]
        got = [s.name for s in sources]
        if got != expected:
            raise InvalidArgument(f"loader {index} must serve sources {expected}, it reported {got}")
        with self._lock:
            if (index, shadow_of or replica) in self._fenced:
                raise FailedPrecondition(f"replica {shadow_of or replica!r} of loader group {index} was fenced: it sent altered samples")
            displaced = self._vouched_over(index, sources)
            if displaced:
                self._forget_group(index)
            for k, facts in zip(job.loader_sources(index), sources):
                if facts.num_rows <= 0:
                    raise InvalidArgument(f"source {facts.name!r} has no rows")
                if any(n < 0 for n in facts.row_group_sizes):
                    raise InvalidArgument(f"source {facts.name!r}: row groups of a negative size")
                known = self._num_rows.get(k)
                if known is not None and known != facts.num_rows:
                    raise InvalidArgument(
                        f"source {facts.name!r} had {known} rows and now has {facts.num_rows}: its files changed under a running job"
                    )
                order = self._orders.get(k)
                if order is not None and tuple(order.row_group_sizes.tolist()) != tuple(facts.row_group_sizes):
                    raise InvalidArgument(
                        f"source {facts.name!r}: replica {replica!r} found other row groups than the group's other replicas"
                    )
                if sum(facts.row_group_sizes) != facts.num_rows:
                    raise InvalidArgument(
                        f"source {facts.name!r}: row groups of {sum(facts.row_group_sizes)} rows for {facts.num_rows} rows"
                    )
            for k, facts in zip(job.loader_sources(index), sources):
                self._num_rows[k] = facts.num_rows
                self._orders.setdefault(k, self._order(k, facts.row_group_sizes))
                if facts.files:
                    self._files.setdefault(k, facts.files)
            replica = shadow_of or replica
            if (index, replica) in self._departed:
                if shadow_of or self._incarnations.get((index, replica, False)) == incarnation:
                    raise FailedPrecondition(f"replica {replica!r} left loader group {index}; it joins again once restarted")
                del self._departed[(index, replica)]  # it restarted: it joins as a new replica
            replicas = self._replicas.setdefault(index, {})
            current = replicas.get(replica)
            shadow = current != address and (bool(shadow_of) or ((index, replica) in self._promoted and current is not None))
            if shadow:
                self._shadows[(index, replica)] = address
            else:
                replicas[replica] = address
                back = self._failed.pop((index, replica), False) is not False
                if current is None:  # a new replica adopts the failed ones nobody adopted
                    for key, adopter in self._failed.items():
                        if key[0] == index and adopter is None:
                            self._failed[key] = replica
                if current is None or back:
                    self._reroute(index)
            before = self._incarnations.get((index, replica, shadow))
            self._incarnations[(index, replica, shadow)] = incarnation
            return Joined(restarted=before is not None and before != incarnation, shadow=shadow, displaced=displaced)

    def _vouched_over(self, index: int, sources: Sequence[SourceFacts]) -> bool:
        """Whether a registration of group `index` reporting `sources` displaces the group's
        replicas: the job has not started, the ledger records the group's sources, these facts
        are the ones it records, and the group's replicas reported others (lock held)."""
        if self._committed:
            return False
        got = {f.name: f.record for f in sources}
        ks = self._job.loader_sources(index)
        names = [self._job.sources[k].name for k in ks]
        if not names or any(n not in self._expected or n not in got or _differs(n, self._expected[n], got[n]) for n in names):
            return False
        known = {self._job.sources[k].name: self._record(k) for k in ks if k in self._num_rows and k in self._orders}
        return any(_differs(name, self._expected[name], facts) for name, facts in known.items())

    def _record(self, k: int) -> SourceRecord:
        """What the group's replicas reported of source `k` (lock held)."""
        return SourceRecord(self._num_rows[k], row_groups_digest(self._orders[k].row_group_sizes.tolist()), self._files.get(k))

    def _forget_group(self, index: int) -> None:
        """Forgets group `index`'s replicas and what they reported (before the job starts: nothing
        was planned from them; lock held)."""
        for k in self._job.loader_sources(index):
            for table in (self._num_rows, self._orders, self._routing, self._frontier, self._files):
                table.pop(k, None)
        self._replicas.pop(index, None)
        for by_replica in (self._departed, self._shadows, self._failed):
            for key in [key for key in by_replica if key[0] == index]:
                del by_replica[key]
        self._promoted = {key for key in self._promoted if key[0] != index}
        self._incarnations = {key: v for key, v in self._incarnations.items() if key[0] != index}

    def promote(self, index: int, replica: str) -> str | None:
        """The shadow of replica `replica` of group `index` takes over: plans name its address
        from now on. Returns that address; None when the replica has no shadow."""
        with self._lock:
            address = self._shadows.pop((index, replica), None)
            if address is None:
                return None
            replicas = self._replicas.setdefault(index, {})
            new = replica not in replicas  # a lone shadow: its replica never registered again
            replicas[replica] = address
            self._failed.pop((index, replica), None)
            self._promoted.add((index, replica))
            if new:
                self._reroute(index)
            return address

    def adopt(self, index: int, replica: str) -> str | None:
        """Replica `replica` of group `index` failed and has no shadow: a live replica of the group
        serves its windows, including those it had adopted, and new windows go to the live ones.
        Returns the adopter's id; None when no replica is live (the next to join adopts them).
        A replica that left the group and fails while it drains is adopted the same way."""
        with self._lock:
            replicas = self._replicas.get(index, {})
            known = replica in replicas or (index, replica) in self._departed
            if not known or (index, replica) in self._failed:
                return None
            live = sorted(r for r in replicas if r != replica and (index, r) not in self._failed)
            adopter = live[0] if live else None
            for key, by in self._failed.items():
                if by == replica:
                    self._failed[key] = adopter
            self._failed[(index, replica)] = adopter
            self._reroute(index)
            return adopter

    def fence(self, index: int, address: str) -> tuple[str, str | None] | None:
        """The replica of group `index` serving at `address` sent a constructor altered samples:
        it is fenced for good and a live replica of the group serves its windows (as `adopt`).

        Returns:
            (its id, its adopter's id); None, with nothing done, when no replica of the group serves
            at `address` (fenced already, or unknown) or it is the group's last live one (its
            windows would wait for a replica that may never come: constructors go on refusing it).
        """
        with self._lock:
            live = [r for r in self._replicas.get(index, {}) if (index, r) not in self._failed]
            serving = [r for r in live if self._replicas[index][r] == address]
            serving += [r for (g, r), a in self._departed.items() if g == index and a == address and (g, r) not in self._failed]
            if not serving or not set(live) - {serving[0]}:
                return None
            self._fenced.add((index, serving[0]))
            self._shadows.pop((index, serving[0]), None)
        return serving[0], self.adopt(index, serving[0])

    def failed(self, index: int, replica: str) -> bool:
        """Whether replica `replica` of group `index` was declared failed and has not registered again."""
        with self._lock:
            return (index, replica) in self._failed

    def serving(self, index: int, replica: str) -> str:
        """The address serving replica `replica`'s windows ("" when none)."""
        with self._lock:
            return self._address(index, replica)

    def lone_shadows(self) -> list[tuple[int, str]]:
        """(group, replica) of shadows whose replica has not registered (with this planner)."""
        with self._lock:
            return [(g, r) for g, r in self._shadows if r not in self._replicas.get(g, {})]

    def watched(self) -> list[tuple[tuple[int, str], str]]:
        """((group, replica), its address) of every replica not known to have failed: what the
        planner probes."""
        with self._lock:
            live = [((g, r), a) for g, replicas in self._replicas.items() for r, a in replicas.items() if (g, r) not in self._failed]
            return live + [(key, a) for key, a in self._departed.items() if key not in self._failed]

    def _address(self, index: int, replica: str) -> str:
        """Where replica `replica`'s windows are served: its address, its adopter's, or (one that
        left) the leaver's while it drains; "" when unknown (lock held)."""
        adopter = self._failed.get((index, replica))
        serving = adopter if adopter is not None else replica
        return self._replicas.get(index, {}).get(serving) or self._departed.get((index, serving), "")

    def shadowed(self) -> list[tuple[tuple[int, str], str, str]]:
        """((group, replica), its address, its shadow's address) of every replica with a shadow."""
        with self._lock:
            return [((g, r), self._replicas[g][r], shadow) for (g, r), shadow in self._shadows.items() if r in self._replicas.get(g, {})]

    def restore_targets(self, index: int) -> list[tuple[int, int, Routing]]:
        """Per source of loader group `index` that has routes: (source, the first position of the
        first window no replica was asked about, the source's routing)."""
        with self._lock:
            return [
                (k, window_span(self._orders[k], self._frontier[k]).start, self._routing[k])
                for k in self._job.loader_sources(index)
                if k in self._routing
            ]

    def expect_sources(self, facts: Mapping[str, SourceRecord]) -> None:
        """The sources as the job ran with them (a restarted planner's ledger): name -> what
        identifies its data. Until the job starts, a loader reporting these facts displaces
        replicas that reported others: a false registration that came first cannot pin facts
        that lock the real loaders out."""
        with self._lock:
            self._expected = dict(facts)

    def reported_sources(self) -> dict[str, SourceRecord]:
        """The sources as their loaders reported them, name -> what identifies its data (in
        source order), without committing them (see `commit_sources`)."""
        with self._lock:
            return {self._job.sources[k].name: self._record(k) for k in sorted(self._num_rows)}

    def commit_sources(self) -> dict[str, SourceRecord]:
        """The job starts with the sources as its loaders reported them: from now on those
        facts are final (a loader reporting others is refused). Returns them, name -> what
        identifies its data, for the ledger to record."""
        with self._lock:
            self._committed = True
            return {self._job.sources[k].name: self._record(k) for k in sorted(self._num_rows)}

    def register_constructor(self, index: int, address: str, ranks: Sequence[int], *, next_step: int | None = None) -> None:
        """Records constructor `index` serving `ranks`; registering again replaces its address.

        Raises:
            InvalidArgument: an index outside the configuration, or ranks other than those the
                configuration assigns the index (`constructors.ranks_per_constructor`
                consecutive global ranks): loaders count fetches by that layout.
        `next_step`: the step it needs next, when it rejoins a restarted planner mid-job.
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
            if next_step is not None:
                self._rejoined[index] = next_step

    def rejoin_at(self, index: int, step: int) -> None:
        """Constructor `index`, restarted while the planner was down too, needs steps from `step`:
        it counts as rejoined there (unless it said so already)."""
        with self._lock:
            self._rejoined.setdefault(index, step)

    def rejoined(self) -> dict[int, int]:
        """Constructor -> the step it needs next, for constructors that registered again with
        this (restarted) planner while their trainers were mid-job."""
        with self._lock:
            return dict(self._rejoined)

    def constructor_ranks(self, index: int) -> tuple[int, ...] | None:
        """The ranks of constructor `index`, or None if it has not registered."""
        with self._lock:
            return self._constructor_ranks.get(index)

    def deregister_loader(self, index: int, replica: str) -> list[int]:
        """Routes no more windows to replica `replica` of group `index`.

        Returns:
            Per source of the group: the stream position below which its windows lie (it serves
            them until they are consumed, then may exit): the end of the last window it owns
            below the frontier (0: none). Not the frontier itself: a window between the two
            was routed to a replica that joined after this one was last asked, which this one
            may not know, and would wait for in vain.
        Raises:
            InvalidArgument: no such replica. FailedPrecondition: it is the group's last one.
        A replica that left is still watched: if it fails before its windows were consumed, a
        live replica of the group adopts them; restarted, it joins again (`register_loader`).
        """
        with self._lock:
            replicas = self._replicas.get(index, {})
            if replica not in replicas:  # the message names no replica: ids are not handed out
                raise InvalidArgument(f"loader {index} has no such replica")
            if len(replicas) == 1:
                raise FailedPrecondition(f"replica {replica!r} is the last of loader {index}: its sources would have no loader")
            self._departed[(index, replica)] = replicas.pop(replica)
            drain = []
            for k in self._job.loader_sources(index):
                routing, frontier = self._routing.get(k), self._frontier.get(k, 0)
                last = None if routing is None else last_owned(routing, replica, frontier)
                drain.append(0 if last is None else window_span(self._orders[k], last).end)
            self._reroute(index)
            return drain

    def _reroute(self, index: int) -> None:
        """Routes the group's windows from each source's frontier over its live replicas (lock
        held); with none live, the routes stay."""
        replicas = sorted(r for r in self._replicas[index] if (index, r) not in self._failed)
        if not replicas:
            return
        for k in self._job.loader_sources(index):
            routing = self._routing.get(k)
            frontier = self._frontier.setdefault(k, 0)
            self._routing[k] = Routing.of(replicas) if routing is None else routing.switch(frontier, replicas)

    def _order(self, source: int, row_group_sizes: Sequence[int]) -> SampleOrder:
        job = self._job
        return SampleOrder(
            row_group_sizes,
            seed=job.seed,
            source_name=job.sources[source].name,
            window_row_groups=job.loaders.shuffle.window_row_groups,
            shuffle=job.loaders.shuffle.enabled,
        )

    def summary_target(self, source: int, from_seq: int) -> SummaryTarget | None:
        """Where to ask for the summary of `source` from `from_seq` on (the replica owning its
        window, and its shadow); None before the group has a replica. Moves the source's
        frontier past that window."""
        with self._lock:
            routing = self._routing.get(source)
            if routing is None:
                return None
            span = window_of(self._orders[source], from_seq)
            self._frontier[source] = max(self._frontier[source], span.number + 1)
            index = self._job.loader_of(source)
            owner = routing.owner(span.number)
            address = self._address(index, owner)
            rows = self._num_rows.get(source)
            end = self._job.stream_end(source, rows)
            return SummaryTarget(address, span.end, routing, (index, owner), self._shadows.get((index, owner), ""), rows, end)

    def holders(self, source: int, seqs: Sequence[int]) -> list[str]:
        """The address of the replica holding each of `source`'s positions `seqs` (all asked
        about already, so their owners are fixed)."""
        with self._lock:
            order, routing = self._orders[source], self._routing[source]
            index = self._job.loader_of(source)
            out, span = [], None
            for seq in seqs:
                if span is None or not span.start <= seq < span.end:
                    span = window_of(order, int(seq))
                    address = self._address(index, routing.owner(span.number))
                out.append(address)
            return out

    def num_rows(self, source: int) -> int | None:
        with self._lock:
            return self._num_rows.get(source)

    @property
    def ready(self) -> bool:
        """True once every source has a registered loader."""
        with self._lock:
            return len(self._num_rows) == len(self._job.sources)

    def missing_loaders(self) -> list[int]:
        """Indices of loader groups without a replica."""
        with self._lock:
            return [i for i in range(self._job.loader_count) if not self._replicas.get(i)]

    def replicas(self, index: int) -> dict[str, str]:
        """Replica id -> address of loader group `index`."""
        with self._lock:
            return dict(self._replicas.get(index, {}))


def _differs(name: str, expected: SourceRecord, got: SourceRecord) -> bool:
    """Whether `got` differs from `expected` in anything both know of."""
    return compare_source(name, expected, got) is not None
