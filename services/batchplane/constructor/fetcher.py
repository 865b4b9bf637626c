"""The constructor's calls to its loaders: a step's samples fetched in parallel from the loader
replicas that hold them, and releases at loaders that served earlier steps (which ones, and
when one is let go: the pure `releases.LoaderReleases`, driven here under a lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import numpy as np
import pyarrow as pa

from batchplane.constructor.build import Fetched
from batchplane.constructor.metrics import ConstructorMetrics
from batchplane.constructor.releases import LoaderReleases
from batchplane.constructor.responses import fetched_samples, receive_samples
from batchplane.constructor.subbatch import FetchGroup
from batchplane.core.config import JobSettings
from batchplane.core.errors import FailedPrecondition, Unavailable
from batchplane.core.rpc import call_with_retry, reraise
from batchplane.v1 import common_pb2, loader_pb2, loader_pb2_grpc
from batchplane.wire import encode_array

log = logging.getLogger(__name__)

#: How long a fetch retries an unreachable loader before the step is built again from a fresh
#: plan, which names the loader's shadow once the planner has promoted it.
FETCH_RETRY_S = 0.25


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
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="fetch")

    def fetch(self, step: int, group: FetchGroup, addresses: list[str]) -> Fetched:
        """The samples of `group` (its `holders` index `addresses`, the plan's loader addresses),
        fetched in parallel; loaders that served earlier steps but not this one are released
        (nothing to fetch: nothing is called, nothing released).

        Raises:
            FailedPrecondition: holders outside `addresses`; a loader that does not hold what
                the plan says it does.
            Unavailable: a loader without an address or out of reach; retry from a fresh plan.
        """
        holders = group.holders
        if not len(holders):
            return fetched_samples([], self._job.batch.payload)
        if not 0 <= holders.min() <= holders.max() < len(addresses):
            raise FailedPrecondition(f"the plan of step {step} names loaders outside its {len(addresses)} loader addresses")
        by_loader: dict[str, np.ndarray] = {}
        for i in np.unique(holders):
            address = addresses[int(i)]
            if not address:
                raise Unavailable(
                    f"the plan of step {step} has no address for a loader of sources {sorted(set(group.source[holders == i].tolist()))}"
                )
            by_loader[address] = holders == i
        begin = time.perf_counter()
        jobs = {
            address: self._pool.submit(self._fetch_from, address, step, group.source[m], group.seq[m], group.copies[m], group.length[m])
            for address, m in by_loader.items()
        }
        with self._lock:
            release = self._releases.fetching(jobs, step)
        for address in release:
            self._pool.submit(self._release_at, address, step)
        fetched = fetched_samples([job.result() for job in jobs.values()], self._job.batch.payload)
        self._metrics.fetch_latency.observe(time.perf_counter() - begin)
        return fetched

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

    def _fetch_from(
        self, address: str, step: int, sources: np.ndarray, seqs: np.ndarray, copies: np.ndarray, lengths: np.ndarray
    ) -> pa.Table:
        request = loader_pb2.FetchSamplesRequest(
            constructor_index=self._index,
            step=step,
            samples=common_pb2.SampleSet(source=encode_array(sources), seq=encode_array(seqs)),
            # only what every rank was handed: a restarted constructor fetches the rest again
            release_below_step=self._delivered(),
            copies=encode_array(copies) if np.any(copies != 1) else None,
        )
        stub = self._loader(address)

        def attempt() -> pa.Table:
            stream = stub.FetchSamples(request, timeout=self._job.network.rpc_timeout_s)
            table, nbytes = receive_samples(
                stream,
                address=address,
                sources=sources,
                seqs=seqs,
                lengths=lengths,
                columns=self._job.batch.payload,
                max_bytes=self._job.loaders.buffer_bytes,
            )
            self._metrics.received_bytes.inc(nbytes)
            self._metrics.samples_received.inc(table.num_rows)
            return table

        try:
            return call_with_retry(
                attempt,
                what=f"FetchSamples(step {step}) from loader at {address}",
                deadline_s=min(self._job.network.rpc_timeout_s, FETCH_RETRY_S),
                should_stop=self._stopped,
            )
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
