"""The constructor's calls to its loaders: a step's samples (with those of following steps,
`constructors.fetch_steps`) fetched in parallel from the loader replicas that hold them, one
call per loader, and releases at loaders that served earlier steps (which ones, and when one
is let go: the pure `releases.LoaderReleases`, driven here under a lock).

What every loader sends is checked against the plan's digests (`integrity.check_digests`)
before it is used: a replica that sends altered samples fails the fetch, is counted and logged,
and is reported to the planner with every plan asked for (`altered`) until a plan no longer
names it (the planner fenced it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
import numpy as np
import pyarrow as pa

from batchplane.constructor.build import Fetched
from batchplane.constructor.integrity import AlteredSamples, check_digests
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.releases import LoaderReleases
from batchplane.constructor.responses import Wanted, fetched_samples, receive_samples
from batchplane.constructor.subbatch import FetchGroup
from batchplane.core.config import JobSettings
from batchplane.core.errors import FailedPrecondition, Unavailable
from batchplane.core.rpc import call_with_retry, reraise
from batchplane.v1 import common_pb2, loader_pb2, loader_pb2_grpc, planner_pb2
from batchplane.wire import encode_array

log = logging.getLogger(__name__)

#: How long a fetch retries an unreachable loader before the step is built again from a fresh
#: plan, which names the loader's shadow once the planner has promoted it.
FETCH_RETRY_S = 0.25
#: Loader replicas reported for altered samples at once (`GetPlanRequest.altered` takes 8).
MAX_ALTERED = 8


@dataclasses.dataclass(frozen=True)
class StepFetch:
    """One step's samples to fetch.

    Attributes:
        step: The step.
        group: Its samples (`build.to_fetch`), whose `holders` index `addresses`.
        addresses: The plan's loader addresses.
    """

    step: int
    group: FetchGroup
    addresses: Sequence[str]


@dataclasses.dataclass(frozen=True)
class _Part:
    """One step's samples at one loader ([n] each)."""

    step: int
    sources: np.ndarray
    seqs: np.ndarray
    copies: np.ndarray
    lengths: np.ndarray
    digests: np.ndarray | None = None

    @classmethod
    def of(cls, step: int, group: FetchGroup, mask: np.ndarray) -> _Part:
        digests = None if group.digest is None else group.digest[mask]
        return cls(step, group.source[mask], group.seq[mask], group.copies[mask], group.length[mask], digests)

    @classmethod
    def none(cls, step: int) -> _Part:
        """No samples of `step` (a call that leads with a step the loader holds none of)."""
        empty = np.zeros(0, np.int32)
        return cls(step, empty, np.zeros(0, np.int64), empty, empty)

    def sample_set(self) -> common_pb2.SampleSet:
        return common_pb2.SampleSet(source=encode_array(self.sources), seq=encode_array(self.seqs))

    def copies_array(self) -> common_pb2.Array | None:
        return encode_array(self.copies) if np.any(self.copies != 1) else None


def _by_loader(wanted: StepFetch) -> list[tuple[str, np.ndarray]]:
    """The loaders holding samples of `wanted`, each with the mask of its samples.

    Raises:
        FailedPrecondition: holders outside the plan's loader addresses.
        Unavailable: a loader without an address.
    """
    holders, addresses = wanted.group.holders, wanted.addresses
    if not len(holders):
        return []
    if not 0 <= holders.min() <= holders.max() < len(addresses):
        raise FailedPrecondition(f"the plan of step {wanted.step} names loaders outside its {len(addresses)} loader addresses")
    out = []
    for i in np.unique(holders):
        address = addresses[int(i)]
        mask = holders == i
        if not address:
            raise Unavailable(
                f"the plan of step {wanted.step} has no address for a loader of sources {sorted(set(wanted.group.source[mask].tolist()))}"
            )
        out.append((address, mask))
    return out


class Fetcher:
    """Fetches from and releases at one constructor's loaders.

    Args:
        job: The job's settings.
        index: The constructor's index.
        metrics: The constructor's metrics.
        connect: Opens a channel to (address, "loader").
        delivered: Every step below it was handed to all of the constructor's pulling ranks
            (what a loader may release).
        stopped: Whether the constructor is stopping (retries end).
    """

    def __init__(
        self,
        job: JobSettings,
        *,
        index: int,
        metrics: ConstructorMetrics,
        connect: Callable[[str, str], grpc.Channel],
        delivered: Callable[[], int],
        stopped: Callable[[], bool],
    ) -> None:
        self._job = job
        self._index = index
        self._metrics = metrics
        self._connect = connect
        self._delivered = delivered
        self._stopped = stopped
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()  # the channels and the releases
        self._releases = LoaderReleases()
        self._altered: dict[str, planner_pb2.AlteredSamples] = {}  # address -> what it sent, until a plan no longer names it
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="fetch")

    def fetch(self, steps: Sequence[StepFetch]) -> dict[int, Fetched]:
        """The samples of `steps` (the step being built, then following ones in rising order),
        fetched in parallel with one call per loader for all of them; loaders that served
        earlier steps but none of these are released (nothing to fetch: nothing is called).

        Every call leads with the first step (with no samples where that loader holds none of
        them): a loader serves it and a prefix of the rest (`FetchHeader.following_served`), so
        the first step is always served, and a following step is returned only when every
        loader that holds its samples served it (the others are fetched again later).

        Returns:
            Fetched samples by step: the first step's, and those of the following steps served.
        Raises:
            FailedPrecondition: holders outside a plan's loader addresses; a loader that does
                not hold what the plan says it does.
            Unavailable: a loader without an address or out of reach; retry from a fresh plan.
            AlteredSamples: a loader sent samples other than the plan's digests; retry from a
                fresh plan.
        """
        first = steps[0].step
        with self._lock:  # a replica the plans no longer name was fenced: no need to report it again
            named = {a for wanted in steps for a in wanted.addresses}
            self._altered = {a: report for a, report in self._altered.items() if a in named}
        parts: dict[str, list[_Part]] = {}
        for wanted in steps:
            for address, mask in _by_loader(wanted):
                parts.setdefault(address, []).append(_Part.of(wanted.step, wanted.group, mask))
        for address, mine in parts.items():
            if mine[0].step != first:
                mine.insert(0, _Part.none(first))
        if not parts:
            return {wanted.step: fetched_samples([], self._job.batch.payload) for wanted in steps}
        begin = time.perf_counter()
        jobs = {address: self._pool.submit(self._fetch_from, address, mine) for address, mine in parts.items()}
        with self._lock:
            release = self._releases.fetching({address: mine[-1].step for address, mine in parts.items()})
        for address in release:
            self._pool.submit(self._release_at, address, first)
        tables: dict[int, list[pa.Table]] = {wanted.step: [] for wanted in steps}
        missing = set()
        for address, job in jobs.items():
            served = job.result()
            for part, table in zip(parts[address], served):
                tables[part.step].append(table)
            missing.update(part.step for part in parts[address][len(served) :])  # fetched again later
        fetched = {step: fetched_samples(got, self._job.batch.payload) for step, got in tables.items() if step not in missing}
        self._metrics.fetch_latency.observe(time.perf_counter() - begin)
        self._metrics.fetch_steps.observe(len(fetched))
        return fetched

    def altered(self) -> list[planner_pb2.AlteredSamples]:
        """The loader replicas that sent altered samples and that the plans still name: what the
        next plan request reports (`GetPlanRequest.altered`)."""
        with self._lock:
            return list(self._altered.values())

    def _found_altered(self, exc: AlteredSamples) -> None:
        """Counts, logs (once per replica) and keeps for the planner the altered samples a loader sent."""
        source, seq = int(exc.sources[0]), int(exc.seqs[0])
        group = self._job.loader_of(source)
        self._metrics.digest_mismatches.labels(str(group), exc.address).inc(len(exc.seqs))
        report = planner_pb2.AlteredSamples(loader_address=exc.address, source=source, seq=seq, step=exc.step, count=len(exc.seqs))
        with self._lock:
            new = exc.address not in self._altered
            self._altered.pop(exc.address, None)
            self._altered[exc.address] = report
            while len(self._altered) > MAX_ALTERED:
                self._altered.pop(next(iter(self._altered)))
        if new:
            log.error(
                "loader replica at %s (group %d) sent %d sample(s) of step %d whose content differs from the plan's digests, first: "
                "source %r position %d; none is built into a batch; reporting it to the planner to fence it, fetching again",
                exc.address,
                group,
                len(exc.seqs),
                exc.step,
                self._job.source_names[source],
                seq,
            )

    def release_everywhere(self, step: int) -> None:
        """Every loader that served the constructor frees what it holds for it (the end of
        data: every rank was handed every step)."""
        with self._lock:
            held = self._releases.held()
        for address in held:
            self._pool.submit(self._release_at, address, step)

    def _release_at(self, address: str, step: int) -> None:
        """Tells a loader that served earlier steps what the constructor's ranks were handed
        (a fetch of nothing)."""
        below = self._delivered()
        request = loader_pb2.FetchSamplesRequest(
            constructor_index=self._index,
            step=step,
            samples=common_pb2.SampleSet(source=encode_array(np.zeros(0, np.int32)), seq=encode_array(np.zeros(0, np.int64))),
            release_below_step=below,
        )
        try:
            for _ in self._loader(address).FetchSamples(request, timeout=min(self._job.network.rpc_timeout_s, 5.0)):
                pass
            ok = True
        except grpc.RpcError as exc:
            log.debug("release at loader %s, which served earlier steps: %s", address, exc.code().name)
            ok = False
        with self._lock:
            self._releases.released(address, below=below, ok=ok)

    def _loader(self, address: str) -> loader_pb2_grpc.LoaderStub:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = self._connect(address, "loader")
        return loader_pb2_grpc.LoaderStub(channel)

    def _fetch_from(self, address: str, parts: Sequence[_Part]) -> list[pa.Table]:
        """One call to the loader at `address` for the samples of `parts` (one per step, the
        first step's first); returns a table per step it served, a prefix of `parts`."""
        lead, rest = parts[0], parts[1:]
        request = loader_pb2.FetchSamplesRequest(
            constructor_index=self._index,
            step=lead.step,
            samples=lead.sample_set(),
            # only what every rank was handed: a restarted constructor fetches the rest again
            release_below_step=self._delivered(),
            copies=lead.copies_array(),
            following=[loader_pb2.StepSamples(step=p.step, samples=p.sample_set(), copies=p.copies_array()) for p in rest],
        )
        stub = self._loader(address)
        wanted = [Wanted(p.sources, p.seqs, p.lengths, p.digests) for p in parts]
        columns = self._job.batch.payload

        def attempt() -> list[pa.Table]:
            stream = stub.FetchSamples(request, timeout=self._job.network.rpc_timeout_s)
            tables, nbytes = receive_samples(
                stream, address=address, wanted=wanted, columns=columns, max_bytes=self._job.loaders.buffer_bytes
            )
            self._metrics.received_bytes.inc(nbytes)
            self._metrics.samples_received.inc(sum(t.num_rows for t in tables))
            for part, table, want in zip(parts, tables, wanted):
                check_digests(table, want, step=part.step, address=address, columns=columns)
            return tables

        try:
            return call_with_retry(
                attempt,
                what=f"FetchSamples(step {lead.step}) from loader at {address}",
                deadline_s=min(self._job.network.rpc_timeout_s, FETCH_RETRY_S),
                should_stop=self._stopped,
            )
        except AlteredSamples as exc:
            self._found_altered(exc)
            raise
        except grpc.RpcError as exc:
            error = reraise(exc, f"loader at {address}")
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                # The loader does not hold what the plan says it does: retrying cannot help.
                raise FailedPrecondition(str(error)) from exc
            raise error from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
