"""Job configuration: typed, frozen settings loaded once from YAML and validated at the edge.

Every field has a default and a documented unit. Loading fails with a `ConfigError` that names
the field path and the bad value, e.g. ``mixture.weights.web: must be >= 0, got -1``. Nothing
here does I/O beyond reading the one configuration file; source files are opened by loaders.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import ipaddress
import json
import math
import pathlib
import re
import types
import typing
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from batchplane.core.errors import ConfigError
from batchplane.core.methods import BALANCE_METHODS
from batchplane.core.payload import PayloadColumn, check_columns

COST_KINDS = ("quadratic", "linear")
#: Loader groups of a job that sets neither loaders.count nor loaders.groups, at most: one per
#: source below it. Measured on a 2-core machine with 64 sources: one loader process per source
#: (74 processes, 8.8 GiB) delivered 383 samples/s, 8 groups over 10x that.
DEFAULT_LOADER_GROUPS = 8
CP_SLICING = ("zigzag", "contiguous")
LENGTH_POLICIES = ("split", "truncate", "reject")
#: What a resume does about a source whose files changed (`sources[].on_change`).
ON_CHANGE = ("refuse", "restart")
PULLING_RANKS = ("all", "megatron")
#: The most steps one fetch may take (`constructors.fetch_steps`).
MAX_FETCH_STEPS = 16
#: The most steps one GetBatch call may carry (`constructors.batch_steps`), and its default.
MAX_BATCH_STEPS = 64
DEFAULT_BATCH_STEPS = 8
#: URL schemes of `ledger.location`: object stores with conditional writes, and file://.
LEDGER_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "file")
TOKEN_DTYPES = ("int32", "int64")
MiB = 1 << 20
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class SourceSettings:
    """One data source: a Parquet file, a directory of them, or a glob."""

    #: Unique name; metrics, ledgers and batch metadata use it.
    name: str
    #: A .parquet file, a directory (all *.parquet below it) or a glob; relative paths are
    #: resolved against the configuration file's directory.
    path: str
    #: Column holding each sample's token ids (a list of integers), read by the default transform.
    token_column: str = "input_ids"
    #: Import path "package.module:callable" of a batch transform (pyarrow.RecordBatch ->
    #: pyarrow.RecordBatch with an `input_ids` list column); None uses `token_column` as it is.
    transform: str | None = None
    #: Keyword arguments passed to the transform on every call.
    transform_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Columns to read; None reads all. The default transform reads only `token_column`.
    columns: tuple[str, ...] | None = None
    #: Passes over this source within one job epoch (an integer >= 1; fractions are not
    #: supported): 2 upsamples a small source so it lasts twice as long at its weight, each row
    #: delivered twice per epoch, once per pass, every pass in its own shuffled order. Its
    #: stream holds `epochs * repeat` passes; pass p is job epoch p // repeat.
    repeat: int = 1
    #: What a resume on a run folder whose ledger recorded this source does when the source's
    #: files changed since (files added or gone, other rows, sizes or modification times):
    #: "refuse" (the planner refuses to start, naming the source and what differs) or
    #: "restart" (the change is declared: the source's data starts over from its beginning at
    #: the resume step, as a source the job never read, and later resumes compare with the new
    #: files). Not part of the data fingerprint: declaring a change changes no setting that
    #: decides which sample a position is.
    on_change: str = "refuse"


@dataclasses.dataclass(frozen=True)
class MixtureSettings:
    """Per-source sampling weights: static, or following a schedule."""

    #: Weight per source name; missing sources get weight 1. Weights are normalized over the
    #: sources that still have data, so only ratios matter; 0 leaves a source unread.
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    #: How the weights change over the steps: {kind: static | staged | curriculum | callable |
    #: adaptive, granularity: step | microbatch, ...}; None: `weights` at every step. Checked by
    #: the planner (`batchplane.planner.strategy.load_schedule`), which names the bad field.
    schedule: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class LedgerSettings:
    """The durable ledger of what every step consumed (`<run_dir>/ledger/` unless `location`)."""

    #: Where the ledger lies: an object store URL ("s3://bucket/prefix", "gs://bucket/prefix",
    #: "az://container/prefix"; credentials and endpoint from the standard environment, e.g.
    #: AWS_* for S3) or a local folder (relative to the configuration file). The store must
    #: honour conditional writes (If-None-Match); the planner proves it at start-up. None:
    #: `<run_dir>/ledger`.
    location: str | None = None
    #: Keep each rank's sample lists (what `batchplane ledger show/find` read) for steps less
    #: than this many behind the slowest rank; older segments keep per-source seq ranges,
    #: tokens, shares and cursors only (about 80 bytes a step with 4 sources). None keeps all.
    keep_detail_steps: int | None = None
    #: Also plan steps with the other built-in partition methods and report their per-rank cost
    #: spread beside the configured method's (GetStatus, `batchplane status`, the demo): the
    #: first 32 steps and every 8th after, each planned again per method (planning time).
    compare_methods: bool = False


DELIVERIES = ("stream", "journal")
#: The least `journal.min_age_s`: `batchplane.journal.reclaim.MIN_AGE_FACTOR` (4) x the
#: manifest's `confirm_after_s` (30 s).
MIN_RECLAIM_AGE_S = 120.0
#: Commit-cadence policies of journal producers (`batchplane.journal.policy.POLICIES`).
JOURNAL_POLICIES = ("naive", "fixed10", "fixed100", "incr", "aimd", "dac")


@dataclasses.dataclass(frozen=True)
class JournalSettings:
    """Journal delivery (`batch.delivery: journal`, BatchWeave): a producer builds every step of
    the whole mesh and commits it as an immutable object to the journal through versioned
    manifests (`batchplane.journal`); each pod's constructor reads only its ranks' slices from
    it. Training then outlives the producer by as many steps as are committed ahead, and any
    retained checkpoint replays byte-identical batches."""

    #: Where the journal lies: an object store URL ("s3://bucket/prefix", as `ledger.location`)
    #: or a local folder (relative to the configuration file). None: `<run_dir>/journal`.
    location: str | None = None
    #: When a producer commits what it built: "dac" (Decentralized Adaptive Commit: the
    #: smallest gap meeting a conflict and a duty budget), or "naive", "fixed10", "fixed100",
    #: "incr", "aimd" (the paper's baselines).
    policy: str = "dac"
    #: Producers, each building every rank's batch of its share of the steps (producer i the
    #: steps s with s % producers == i) and committing them without coordination.
    producers: int = 1
    #: How many steps the producer may run ahead of the lowest live checkpoint mark (storage
    #: stays bounded when checkpoints stall). Must exceed the checkpoint interval plus the
    #: consumers' read-ahead, or producer and trainers wait on each other.
    max_lag_steps: int = 1024
    #: Steps each constructor reads ahead of its slowest rank.
    prefetch_steps: int = 2
    #: The producer (producer 0 of several) deletes, every `RECLAIM_EVERY_S` seconds, the steps
    #: below the lowest live mark of the journal's manifest (each pod's latest checkpoint, or its
    #: ranks' start before they all checkpointed: `Client.checkpointed`) and manifest versions
    #: no kept one needs (`batchplane.journal.reclaim`); false keeps everything.
    reclaim: bool = True
    #: Nothing younger is reclaimed, in seconds; at least `MIN_RECLAIM_AGE_S` (4 x the
    #: manifest's 30 s confirm window, so a deleted manifest version is never taken for one not
    #: written yet).
    min_age_s: float = 600.0


BAD_SAMPLE_POLICIES = ("substitute", "skip", "fail")


@dataclasses.dataclass(frozen=True)
class BadSampleSettings:
    """What a step does about a bad sample among those the mixture allocated to it (a row group
    that cannot be read, a failed transform, an empty or rejected token list)."""

    #: "substitute": the next good sample of the same source stands in for it, so the step keeps
    #: its number of samples and the source its share (the ledger names both); "skip": the step
    #: trains without it; "fail": substitute, but stop the job with FAILED_PRECONDITION once a
    #: planning window holds more than `max_per_window` bad samples.
    policy: str = "substitute"
    #: Policy "fail": bad samples a planning window tolerates (substituted) before the job fails.
    max_per_window: int = 0


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """Shape of every step's batch."""

    #: Samples per step over all data-parallel ranks.
    global_batch_size: int = 32
    #: Microbatches per rank per step (gradient accumulation steps).
    microbatches: int = 1
    #: Token id written into padding positions of input_ids.
    pad_id: int = 0
    #: Label of positions that carry no loss (padding, each sample's last token).
    ignore_id: int = -100
    #: dtype of input_ids, labels and position_ids.
    token_dtype: str = "int64"
    #: Pack each microbatch's samples into rows of at most `pack_length` tokens (with
    #: cu_seqlens, segment_ids and position ids restarting per sample) instead of padding each
    #: sample to the longest.
    packing: bool = False
    #: Longest packed row in tokens; None: `balance.max_tokens` when set, else the longest
    #: microbatch (one row per microbatch).
    pack_length: int | None = None
    #: Longest sample delivered, in tokens (after the source's transform); a longer one follows
    #: `length_policy`. None: `pack_length` when packing with one, else no limit.
    max_length: int | None = None
    #: What happens to a sample longer than `max_length`: "split" into consecutive chunks of at
    #: most max_length tokens, each its own sequence (own positions, no label across chunks;
    #: nothing is lost), "truncate" to its first max_length tokens, or "reject" (skipped as a
    #: bad sample: counted, logged with file and row, never delivered).
    length_policy: str = "split"
    #: Bad samples: substituted (default), skipped, or fatal past a bound.
    bad_samples: BadSampleSettings = dataclasses.field(default_factory=BadSampleSettings)
    #: Columns every sample carries besides input_ids (`batchplane.core.payload`): each a
    #: name, kind ("token", "sample" or "blob"), dtype, shape of one element and fill value,
    #: e.g. {name: pixel_values, kind: blob, dtype: uint8, shape: [1176]}. Transforms return
    #: them; the constructor lays each kind out by its rule; the client yields them.
    payload: tuple[PayloadColumn, ...] = ()
    #: How batches reach the trainers: "stream" (constructors build each step for their pod's
    #: ranks as they ask) or "journal" (a producer commits every step to the journal, `journal`;
    #: constructors read their ranks' slices from it).
    delivery: str = "stream"


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """The trainer's device mesh (its ClientPlaceTree): pp * dp * cp * tp ranks."""

    #: Data-parallel replicas.
    dp: int = 1
    #: Context-parallel ranks per replica: each gets a slice of every sequence.
    cp: int = 1
    #: Tensor-parallel ranks per context slice: all get identical tensors.
    tp: int = 1
    #: Pipeline stages: the first gets the inputs, the last the labels.
    pp: int = 1
    #: Rank order, fastest-varying axis first; Megatron-LM's by default.
    order: str = "tp-cp-dp-pp"


@dataclasses.dataclass(frozen=True)
class CostSettings:
    """Per-sample compute cost as a function of its length l in tokens."""

    #: "quadratic" (linear * l + quadratic * l**2), "linear" (l), or an import path
    #: "package.module:callable" taking an int64 numpy array of lengths and returning costs.
    kind: str = "quadratic"
    #: Coefficient of l for kind "quadratic".
    linear: float = 0.0
    #: Coefficient of l**2 for kind "quadratic".
    quadratic: float = 1.0


@dataclasses.dataclass(frozen=True)
class BalanceSettings:
    """How a step's samples are spread over ranks and microbatches."""

    #: "karmarkar_karp", "greedy" (longest processing time first), "round_robin" (none), or
    #: "token_budget": microbatches of variable size under `max_tokens` (or `max_cost`), the
    #: same number on every rank of a step.
    method: str = "karmarkar_karp"
    #: Token budget of one microbatch for "token_budget": padded tokens (samples x longest),
    #: or real tokens when `batch.packing` is on.
    max_tokens: int | None = None
    #: Cost budget of one microbatch for "token_budget", instead of `max_tokens`.
    max_cost: float | None = None
    #: "token_budget": steps planned together (`batchplane.planner.window`): the samples of
    #: window_steps consecutive steps are grouped by length at once, which pads less and needs
    #: fewer microbatches; window_steps * global_batch_size must not exceed
    #: `loaders.read_ahead_samples`. None: as many steps as hold about 4096 samples, within the
    #: read-ahead (1 under an adaptive mixture, which sets each step's weights from the reports
    #: of the steps before).
    window_steps: int | None = None
    #: The cost model balanced.
    cost: CostSettings = dataclasses.field(default_factory=CostSettings)


@dataclasses.dataclass(frozen=True)
class ShuffleSettings:
    """Order of each source's samples within an epoch."""

    #: Shuffle rows (seeded); False keeps file order, for debugging.
    enabled: bool = True
    #: Row groups shuffled together; larger mixes better and buffers more.
    window_row_groups: int = 4


@dataclasses.dataclass(frozen=True)
class FailoverSettings:
    """How the planner decides that a loader replica with a shadow has failed."""

    #: Seconds between health probes of a replica whose connection is down or that failed its
    #: last probe or request (one whose connection stays up and that answers is probed once a
    #: `planner.failover.CONFIRM_S`).
    probe_interval_s: float = 0.1
    #: Consecutive failed observations (health probes or summary requests) that declare a
    #: replica failed and promote its shadow: a dead replica is replaced within about
    #: failures * probe_interval_s.
    failures: int = 3


@dataclasses.dataclass(frozen=True)
class LoaderSettings:
    """Source loader processes."""

    #: Loader groups; source i is served by loader group i % count. None: one per source up to
    #: DEFAULT_LOADER_GROUPS, so a job of many sources shares processes (each holds its sources'
    #: file state once), or one per entry of `groups`.
    count: int | None = None
    #: Loader groups by source name, e.g. [[web, books], [code]]: group g serves the sources of
    #: entry g (every source in exactly one). The Helm chart writes it from sourceGroups. Each
    #: group runs as one or more replicas (processes) that share its windows.
    groups: tuple[tuple[str, ...], ...] | None = None
    #: Samples a loader reads ahead of the planner's cursor, per source.
    read_ahead_samples: int = 4096
    #: Soft cap on a loader's buffered payload bytes; read-ahead pauses above it (samples the
    #: planner is waiting for are always read), and above it a window a fetch needs is read for
    #: that fetch alone and not kept. Also the largest payload one fetch may take (a
    #: constructor's share of one step; more is RESOURCE_EXHAUSTED).
    buffer_bytes: int = 512 * MiB
    #: Sample order.
    shuffle: ShuffleSettings = dataclasses.field(default_factory=ShuffleSettings)
    #: Run a shadow (hot standby) beside every loader: it reads the same windows and takes over
    #: within `failover` when its loader fails, so constructors hardly wait; it costs a second
    #: loader's memory and reading. Without it, a failed loader is restarted and reads again what
    #: constructors may still fetch.
    shadow: bool = False
    #: Failure detection for loaders with a shadow.
    failover: FailoverSettings = dataclasses.field(default_factory=FailoverSettings)


@dataclasses.dataclass(frozen=True)
class ConstructorSettings:
    """Constructor processes (sidecars of the trainer pods)."""

    #: Ranks (GPUs of one trainer pod) per constructor; constructor i serves global ranks
    #: [i*n, (i+1)*n).
    ranks_per_constructor: int = 1
    #: Steps built ahead of the slowest rank it serves.
    prefetch_steps: int = 2
    #: Steps whose samples one call to a loader fetches: the step being built and up to
    #: fetch_steps - 1 following ones the planner has planned already (their plans come with
    #: its plan). It saves the calls' fixed cost (on 2 cores with 64-sample steps, 8 against one
    #: step per call: 1.35x the samples/s at 0.77x the CPU per sample). It costs memory: the samples of
    #: those steps, kept from their fetch until they are built (a loader serves at most
    #: loaders.buffer_bytes per call), and the planner plans twice as many steps ahead.
    #: 1: one step per call.
    fetch_steps: int = 8
    #: Steps one GetBatch call from a trainer may carry (`GetBatchRequest.max_steps`; the client
    #: asks for fewer while batches are large): the asked step's batch and the following ones as
    #: they are built, so that small batches share a call's fixed cost (about 1 ms of CPU on
    #: each side in Python gRPC; on 2 cores with 64-sample steps, 8 against one: the samples/s of
    #: a colocated DataLoader instead of 0.8x it). The constructor then builds up to
    #: prefetch_steps past the last step a call carried, and the planner plans batch_steps - 1
    #: steps further ahead. None: 8, or 1 under an adaptive mixture (its steps are planned from
    #: the training reports of the steps before them) and with journal delivery (its consumer
    #: serves one step per call). 1: one step per call.
    batch_steps: int | None = None
    #: How a sequence is cut over context-parallel ranks: "zigzag" (2*cp chunks, rank i gets
    #: chunks i and 2*cp-1-i: balanced causal attention) or "contiguous".
    cp_slicing: str = "zigzag"
    #: Tensors the middle pipeline stages receive (by default none; e.g. ["position_ids"]).
    pp_middle_tensors: tuple[str, ...] = ()
    #: Which ranks ask for batches: "all", or "megatron": only tensor-parallel rank 0 of the
    #: first and last pipeline stages (Megatron-LM's get_batch; it broadcasts to the others). A
    #: constructor waits only for the ranks that ask; the others may still ask and are served.
    pulling_ranks: str = "all"
    #: Shared memory (bytes) for handing batches to the trainers of the pod without a copy:
    #: reusable memfd slabs whose file descriptors pass over a Unix socket beside the trainer's
    #: gRPC socket. A batch that does not fit falls back to the gRPC stream; 0 turns it off.
    shm_bytes: int = 1 << 30


@dataclasses.dataclass(frozen=True)
class NetworkSettings:
    """Where services listen and how they talk."""

    #: Interface every service binds (gRPC and metrics).
    host: str = "127.0.0.1"
    #: Mutual TLS between the parts, each allowed only its own calls (core.authz), and local
    #: credentials on the constructor's socket for the trainer. `off` turns all of it off: the
    #: parts then talk plaintext and any process that reaches a port can read training data,
    #: register as a loader or ask for another rank's batches (every process says so at start).
    tls: bool = True
    #: Says `tls: off` is meant on a `host` other machines reach (a non-loopback address): refused
    #: without it, as plaintext there lets anyone who reaches a port act as any part.
    insecure: bool = False
    #: Largest gRPC message accepted or sent; bulk data is chunked well below it.
    max_message_bytes: int = 4 * MiB
    #: Deadline of one service-to-service call, and of a wait for data.
    rpc_timeout_s: float = 30.0
    #: How often loaders and constructors register again with the planner (idempotent): a
    #: restarted planner knows where every one stands within it.
    heartbeat_s: float = 0.5


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """The whole job: the root settings object."""

    #: The job's name.
    job: str
    #: Sources, in a fixed order; a sample's source index refers to it.
    sources: tuple[SourceSettings, ...]
    #: Seed of every random choice (shuffle order); the plan sequence is a function of the
    #: configuration and this seed.
    seed: int = 0
    #: Passes over every source: a positive integer (finite: every sample that many times, then
    #: end of data) or "infinite" (reshuffled repeats, never ends).
    epochs: int | None = 1
    mixture: MixtureSettings = dataclasses.field(default_factory=MixtureSettings)
    batch: BatchSettings = dataclasses.field(default_factory=BatchSettings)
    mesh: MeshSettings = dataclasses.field(default_factory=MeshSettings)
    balance: BalanceSettings = dataclasses.field(default_factory=BalanceSettings)
    loaders: LoaderSettings = dataclasses.field(default_factory=LoaderSettings)
    constructors: ConstructorSettings = dataclasses.field(default_factory=ConstructorSettings)
    network: NetworkSettings = dataclasses.field(default_factory=NetworkSettings)
    ledger: LedgerSettings = dataclasses.field(default_factory=LedgerSettings)
    journal: JournalSettings = dataclasses.field(default_factory=JournalSettings)
    #: Folder for logs, endpoints and the ledger; relative to the configuration file.
    run_dir: str = ".batchplane/run"
    #: A strategy file (Python, defining `strategy(mesh)` with DGraph primitives; relative to
    #: the configuration file). None: mix, distribute over DP, cost and balance as `balance`
    #: says.
    strategy: str | None = None
    #: sha256 of the strategy file, part of the fingerprint. Set by the loader.
    strategy_digest: str = dataclasses.field(default="", metadata={"internal": True})
    #: Folder of the configuration file; relative paths are resolved against it. Set by the
    #: loader, not read from YAML.
    base_dir: str = dataclasses.field(default=".", metadata={"internal": True})

    # ---- derived values -------------------------------------------------------------------

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    def passes(self, source: int) -> int | None:
        """Passes over source `source` in the whole job: `epochs` x its `repeat`; None when the
        job is endless."""
        return None if self.epochs is None else self.epochs * self.sources[source].repeat

    def stream_end(self, source: int, num_rows: int | None) -> int | None:
        """The seq where source `source`'s stream ends (its passes x `num_rows`); None when the job
        is endless or the row count is not known yet."""
        passes = self.passes(source)
        return None if passes is None or num_rows is None else passes * num_rows

    @property
    def weights(self) -> tuple[float, ...]:
        """Configured weight of each source, in source order (not normalized)."""
        return tuple(float(self.mixture.weights.get(s.name, 1.0)) for s in self.sources)

    @property
    def loader_count(self) -> int:
        """Loader groups."""
        if self.loaders.groups is not None:
            return len(self.loaders.groups)
        return self.loaders.count if self.loaders.count is not None else min(len(self.sources), DEFAULT_LOADER_GROUPS)

    def loader_of(self, source: int) -> int:
        """Index of the loader group serving source `source`."""
        if self.loaders.groups is not None:
            name = self.sources[source].name
            return next(g for g, names in enumerate(self.loaders.groups) if name in names)
        return source % self.loader_count

    def loader_sources(self, loader_index: int) -> tuple[int, ...]:
        """Indices of the sources loader `loader_index` serves."""
        return tuple(i for i in range(len(self.sources)) if self.loader_of(i) == loader_index)

    @property
    def max_length(self) -> int | None:
        """The longest sample delivered (`batch.max_length`, else `batch.pack_length` when
        packing), or None for no limit."""
        b = self.batch
        if b.max_length is not None:
            return b.max_length
        return b.pack_length if b.packing else None

    @property
    def world(self) -> int:
        """Ranks in the mesh: pp * dp * cp * tp."""
        m = self.mesh
        return m.pp * m.dp * m.cp * m.tp

    @property
    def constructor_count(self) -> int:
        """Constructors that fetch and build the planned steps, as the planner counts them: one
        per pod (`pod_count`), or with journal delivery the producers, each for the whole mesh."""
        return self.journal.producers if self.batch.delivery == "journal" else self.pod_count

    def constructor_ranks(self, constructor_index: int) -> tuple[int, ...]:
        """Global ranks constructor `constructor_index` builds for (see `constructor_count`)."""
        return tuple(range(self.world)) if self.batch.delivery == "journal" else self.pod_ranks(constructor_index)

    @property
    def build_stride(self) -> int:
        """Constructor i builds the steps s with s % build_stride == i % build_stride: every step
        (1) when streaming; its share of them with journal delivery (`journal.producers`)."""
        return self.journal.producers if self.batch.delivery == "journal" else 1

    @property
    def batch_steps(self) -> int:
        """Steps one GetBatch call may carry: `constructors.batch_steps`, by default
        `DEFAULT_BATCH_STEPS`, or 1 under an adaptive mixture or with journal delivery (whose
        consumer serves one step per call)."""
        if self.constructors.batch_steps is not None:
            return self.constructors.batch_steps
        adaptive = (self.mixture.schedule or {}).get("kind") == "adaptive"
        return 1 if adaptive or self.batch.delivery == "journal" else DEFAULT_BATCH_STEPS

    @property
    def fetch_layout(self) -> list[tuple[int, ...]]:
        """The ranks of each constructor that fetches a given step's samples: every pod's
        constructor when streaming; with journal delivery the step's one producer (whose ranks
        are the whole mesh)."""
        if self.batch.delivery == "journal":
            return [tuple(range(self.world))]
        return [self.pod_ranks(c) for c in range(self.pod_count)]

    @property
    def pod_count(self) -> int:
        """Trainer pods, each with a constructor sidecar that hands its ranks their batches."""
        return math.ceil(self.world / self.constructors.ranks_per_constructor)

    def pod_ranks(self, pod: int) -> tuple[int, ...]:
        """Global ranks of trainer pod `pod` (its sidecar serves them): [pod*n, (pod+1)*n)."""
        n = self.constructors.ranks_per_constructor
        return tuple(range(pod * n, min((pod + 1) * n, self.world)))

    def resolve(self, path: str) -> pathlib.Path:
        """`path` made absolute against the configuration file's folder."""
        p = pathlib.Path(path).expanduser()
        return p if p.is_absolute() else pathlib.Path(self.base_dir) / p

    def locate(self, location: str) -> str:
        """A source or ledger location as the part that opens it reads it: a URL
        ("s3://bucket/prefix", "gs://...", any "scheme://...") unchanged, a local path made
        absolute against the configuration file's folder."""
        return location if is_url(location) else str(self.resolve(location))

    @property
    def fingerprints(self) -> dict[str, str]:
        """Hashes of the groups of settings that determine the plan sequence, by what a resume
        may change (source paths are left out on purpose: moving a dataset keeps the job; the
        files a source's loader finds are compared with those the ledger recorded when a job
        resumes, see `sources[].on_change`):

        - "data": the sources, their transforms and repeats, the seed, epochs and shuffle, i.e. which sample
          each position of each source's stream is. A resume cannot honour a change;
        - "mixture": the per-source weights and their schedule;
        - "topology": the mesh and how it is delivered to (CP slicing, PP tensors);
        - "batching": batch shape, balancing, the strategy file, and the loaders' read-ahead
          (it bounds the default planning window).
        A resume across a change of the last three re-plans from the ledger's cursors.
        `FINGERPRINT_GROUPS` lists every setting by its group.
        """
        groups: dict[str, dict[str, Any]] = {
            "data": {
                # `repeat` only when set, so the fingerprints of jobs without it stay as they were.
                "sources": [
                    [s.name, s.token_column, s.transform, dict(s.transform_args), s.columns, *([s.repeat] if s.repeat != 1 else [])]
                    for s in self.sources
                ],
                "seed": self.seed,
                "epochs": self.epochs,
                "shuffle": dataclasses.asdict(self.loaders.shuffle),
            },
            "mixture": {"weights": self.weights, "schedule": self.mixture.schedule},
            "topology": {
                "mesh": dataclasses.asdict(self.mesh),
                "delivery": [self.constructors.cp_slicing, list(self.constructors.pp_middle_tensors)],
            },
            "batching": {
                "batch": _batch_fingerprint(self.batch),
                "balance": dataclasses.asdict(self.balance),
                "strategy": self.strategy_digest,
            },
        }
        if self.loaders.read_ahead_samples != LoaderSettings.read_ahead_samples:
            # Only when set, so the fingerprints of jobs without it stay as they were.
            groups["batching"]["read_ahead_samples"] = self.loaders.read_ahead_samples
        return {name: _hash(value) for name, value in groups.items()}

    @property
    def fingerprint(self) -> str:
        """Hash of every setting that determines the plan sequence (all of `fingerprints`)."""
        return _hash(self.fingerprints)


#: Every setting of a job (dotted path; "sources[]." for each source's) by the
#: resume-fingerprint group `JobSettings.fingerprints` hashes it in. "none": settings that change
#: how the job runs, never which samples a step gets (`sources[].path` too: moving a dataset
#: keeps the job; the files found there are compared on a resume, `sources[].on_change`). A test checks that every field is in exactly one group and that changing it
#: changes exactly its group's fingerprint.
FINGERPRINT_GROUPS: Mapping[str, tuple[str, ...]] = {
    "data": (
        "sources[].name",
        "sources[].token_column",
        "sources[].transform",
        "sources[].transform_args",
        "sources[].columns",
        "sources[].repeat",
        "seed",
        "epochs",
        "loaders.shuffle.enabled",
        "loaders.shuffle.window_row_groups",
    ),
    "mixture": ("mixture.weights", "mixture.schedule"),
    "topology": ("mesh.dp", "mesh.cp", "mesh.tp", "mesh.pp", "mesh.order", "constructors.cp_slicing", "constructors.pp_middle_tensors"),
    "batching": (
        "batch.global_batch_size",
        "batch.microbatches",
        "batch.pad_id",
        "batch.ignore_id",
        "batch.token_dtype",
        "batch.packing",
        "batch.pack_length",
        "batch.max_length",
        "batch.length_policy",
        "batch.bad_samples.policy",
        "batch.bad_samples.max_per_window",
        "batch.payload",
        "balance.method",
        "balance.max_tokens",
        "balance.max_cost",
        "balance.window_steps",
        "balance.cost.kind",
        "balance.cost.linear",
        "balance.cost.quadratic",
        "strategy",
        "loaders.read_ahead_samples",
    ),
    "none": (
        "job",
        "sources[].path",
        "sources[].on_change",
        "run_dir",
        "loaders.count",
        "loaders.groups",
        "loaders.buffer_bytes",
        "loaders.shadow",
        "loaders.failover.probe_interval_s",
        "loaders.failover.failures",
        "constructors.ranks_per_constructor",
        "constructors.prefetch_steps",
        "constructors.fetch_steps",
        "constructors.batch_steps",
        "constructors.pulling_ranks",
        "constructors.shm_bytes",
        "network.host",
        "network.tls",
        "network.insecure",
        "network.max_message_bytes",
        "network.rpc_timeout_s",
        "network.heartbeat_s",
        "ledger.location",
        "ledger.keep_detail_steps",
        "ledger.compare_methods",
        "batch.delivery",
        "journal.location",
        "journal.policy",
        "journal.producers",
        "journal.max_lag_steps",
        "journal.prefetch_steps",
        "journal.reclaim",
        "journal.min_age_s",
    ),
}


def _batch_fingerprint(batch: BatchSettings) -> dict[str, Any]:
    """The batch settings as hashed: `payload` only when declared, so the fingerprints of jobs
    without it stay as they were; never `delivery` (how steps travel, not what they hold)."""
    out = dataclasses.asdict(batch)
    del out["delivery"]
    if not batch.payload:
        del out["payload"]
    return out


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- loading --------------------------------------------------------------------------------


def load_job(path: str | pathlib.Path) -> JobSettings:
    """Reads and validates a job configuration file.

    Raises:
        ConfigError: the file is missing or not YAML, or a field is unknown or invalid; the
            message names the field and the value.
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), "cannot read configuration file", exc.strerror) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "not valid YAML", str(exc).replace("\n", " ")) from exc
    return job_from_mapping(data, base_dir=path.resolve().parent)


#: The head of a URL, "scheme://" (group 1: the scheme as written).
URL_HEAD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(location: str) -> str | None:
    """The URL scheme of `location`, lower-cased ("s3" for "S3://b/k"); None for a local path
    (a Windows drive letter "C:/x" has no "//")."""
    m = URL_HEAD.match(location)
    return m.group(1).lower() if m else None


def is_url(location: str) -> bool:
    """True for "scheme://..." (s3://, gs://, hdfs://, file://, ...); False for a local path."""
    return url_scheme(location) is not None


def job_from_mapping(data: Any, *, base_dir: str | pathlib.Path = ".") -> JobSettings:
    """Builds validated settings from a parsed YAML document (a mapping).

    Raises:
        ConfigError: as `load_job`.
    """
    if not isinstance(data, Mapping):
        raise ConfigError("(top level)", "must be a mapping of settings", data)
    data = dict(data)
    if "epochs" in data:
        if data["epochs"] is None:
            raise ConfigError("epochs", "must be a positive integer or 'infinite'", None)
        if data["epochs"] == "infinite":
            data["epochs"] = None
    _check_repeats(data.get("sources"))
    job = dataclasses.replace(_build(JobSettings, data, ""), base_dir=str(base_dir))
    _validate(job)
    if job.strategy is not None:
        job = dataclasses.replace(job, strategy_digest=_digest(job.resolve(job.strategy)))
    return job


def _check_repeats(sources: Any) -> None:
    """`sources[i].repeat` as written: an integer >= 1 (1.5, "2" or 0 named with one message)."""
    for i, source in enumerate(sources if isinstance(sources, (list, tuple)) else ()):
        value = source.get("repeat", 1) if isinstance(source, Mapping) else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"sources[{i}].repeat", "must be an integer >= 1", value)


def _digest(path: pathlib.Path) -> str:
    """sha256 of the strategy file; ConfigError (field "strategy") when it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError("strategy", f"cannot read strategy file {str(path)!r}: {exc.strerror}", str(path)) from exc


def _build(cls: type, data: Any, path: str) -> Any:
    """Builds dataclass `cls` from mapping `data`, checking names and types field by field."""
    if not isinstance(data, Mapping):
        raise ConfigError(path or "(top level)", "must be a mapping", data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    public = [n for n, f in fields.items() if not f.metadata.get("internal")]
    for key in data:
        if key not in fields or fields[key].metadata.get("internal"):
            near = difflib.get_close_matches(str(key), public, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; known fields: {', '.join(public)}"
            raise ConfigError(_join(path, str(key)), "unknown field" + hint, data[key])
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "is required", None)
    return cls(**kwargs)


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _build(hint, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, "must be a list", value)
        return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict) or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(path, "must be a mapping", value)
        value_hint = args[1] if args else Any
        return {str(k): _convert(value_hint, v, _join(path, str(k))) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, "must be true or false", value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, "must be an integer", value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, "must be a number", value)
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(path, "must be a finite number", value) from None
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, "must be a string", value)
        return value
    raise TypeError(f"unsupported settings type {hint!r} at {path}")  # a bug, not bad input


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _validate(job: JobSettings) -> None:
    """Semantic checks, section by section (`SECTION_CHECKS`); raises ConfigError naming the
    first bad field."""
    for check in SECTION_CHECKS:
        check(job)


def _check_top_level(job: JobSettings) -> None:
    """`job`, `epochs`, `seed` and `strategy`."""
    if not job.job.strip():
        raise ConfigError("job", "must not be empty", job.job)
    if job.epochs is not None and job.epochs < 1:
        raise ConfigError("epochs", "must be a positive integer or 'infinite'", job.epochs)
    if not 0 <= job.seed < 2**63:
        raise ConfigError("seed", "must be in [0, 2**63)", job.seed)
    if job.strategy is not None and not job.strategy.endswith(".py"):
        raise ConfigError("strategy", "must name a Python file (*.py)", job.strategy)


def _check_sources(job: JobSettings) -> None:
    """`sources`: at least one, unique names, a path each, repeats and transform paths."""
    if not job.sources:
        raise ConfigError("sources", "must list at least one source", [])
    seen: dict[str, int] = {}
    for i, s in enumerate(job.sources):
        if not _SOURCE_NAME.fullmatch(s.name):
            raise ConfigError(f"sources[{i}].name", "must be letters, digits, _ - . (not starting with - or .)", s.name)
        if s.name in seen:
            raise ConfigError(f"sources[{i}].name", f"duplicates sources[{seen[s.name]}].name", s.name)
        seen[s.name] = i
        if not s.path:
            raise ConfigError(f"sources[{i}].path", "must not be empty", s.path)
        if s.repeat < 1:
            raise ConfigError(f"sources[{i}].repeat", "must be an integer >= 1", s.repeat)
        if s.transform is not None and ":" not in s.transform:
            raise ConfigError(f"sources[{i}].transform", "must be an import path 'module:callable'", s.transform)
        if s.on_change not in ON_CHANGE:
            raise ConfigError(f"sources[{i}].on_change", f"must be one of {ON_CHANGE}", s.on_change)


def _check_mixture(job: JobSettings) -> None:
    """`mixture.weights`: known sources, finite and >= 0, not all 0 (`mixture.schedule` is
    checked by the planner, which builds it)."""
    names = job.source_names
    for name, w in job.mixture.weights.items():
        if name not in names:
            raise ConfigError(f"mixture.weights.{name}", f"names no source; sources are {', '.join(names)}", w)
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"mixture.weights.{name}", "must be a finite number >= 0", w)
    if sum(job.weights) <= 0:
        raise ConfigError("mixture.weights", "must give at least one source a weight > 0", dict(job.mixture.weights))


def _check_mesh(job: JobSettings) -> None:
    """`mesh`: positive sizes, an order naming every axis once."""
    for axis in ("dp", "cp", "tp", "pp"):
        _positive(f"mesh.{axis}", getattr(job.mesh, axis))
    axes = [part.strip() for part in job.mesh.order.split("-")]
    if sorted(axes) != sorted(["tp", "cp", "dp", "pp"]):
        raise ConfigError("mesh.order", "must name tp, cp, dp and pp once each, fastest first, e.g. 'tp-cp-dp-pp'", job.mesh.order)


def _check_batch(job: JobSettings) -> None:
    """`batch`: the payload, sizes (no empty microbatch over `mesh.dp`), lengths, token ids and
    the bad-sample policy."""
    batch = job.batch
    for field, message, value in check_columns(batch.payload):
        raise ConfigError(f"batch.payload{field}", message, value)
    _positive("batch.microbatches", batch.microbatches)
    _positive("batch.global_batch_size", batch.global_batch_size)
    if batch.pack_length is not None:
        _positive("batch.pack_length", batch.pack_length)
    if batch.max_length is not None:
        _positive("batch.max_length", batch.max_length)
    if batch.length_policy not in LENGTH_POLICIES:
        raise ConfigError("batch.length_policy", f"must be one of {LENGTH_POLICIES}", batch.length_policy)
    per_step = job.mesh.dp * batch.microbatches
    if batch.global_batch_size < per_step:
        raise ConfigError(
            "batch.global_batch_size",
            f"must be >= mesh.dp * batch.microbatches = {per_step}, so no microbatch is empty",
            batch.global_batch_size,
        )
    if batch.token_dtype not in TOKEN_DTYPES:
        raise ConfigError("batch.token_dtype", f"must be one of {TOKEN_DTYPES}", batch.token_dtype)
    bits = 31 if batch.token_dtype == "int32" else 63
    for name in ("pad_id", "ignore_id"):
        value = getattr(batch, name)
        if not -(2**bits) <= value < 2**bits:
            raise ConfigError(f"batch.{name}", f"must fit batch.token_dtype ({batch.token_dtype})", value)
    if batch.bad_samples.policy not in BAD_SAMPLE_POLICIES:
        raise ConfigError("batch.bad_samples.policy", f"must be one of {BAD_SAMPLE_POLICIES}", batch.bad_samples.policy)
    if isinstance(batch.bad_samples.max_per_window, bool) or batch.bad_samples.max_per_window < 0:
        raise ConfigError("batch.bad_samples.max_per_window", "must be an integer >= 0", batch.bad_samples.max_per_window)


def _check_balance(job: JobSettings) -> None:
    """`balance`: a method of `BALANCE_METHODS`, its budgets, the window (within
    `loaders.read_ahead_samples`) and the cost model."""
    balance = job.balance
    if balance.method not in BALANCE_METHODS:
        raise ConfigError("balance.method", f"must be one of {BALANCE_METHODS}", balance.method)
    budgets = {"balance.max_tokens": balance.max_tokens, "balance.max_cost": balance.max_cost}
    if balance.max_tokens is not None:
        _positive("balance.max_tokens", balance.max_tokens)
    if balance.max_cost is not None and not (math.isfinite(balance.max_cost) and balance.max_cost > 0):
        raise ConfigError("balance.max_cost", "must be a finite number > 0", balance.max_cost)
    if balance.method == "token_budget" and sum(v is not None for v in budgets.values()) != 1:
        raise ConfigError(
            "balance.max_tokens", "method 'token_budget' needs exactly one of balance.max_tokens and balance.max_cost", budgets
        )
    window = balance.window_steps
    if window is not None:
        _positive("balance.window_steps", window)
        if window * job.batch.global_batch_size > job.loaders.read_ahead_samples:
            raise ConfigError(
                "balance.window_steps",
                f"window_steps * batch.global_batch_size = {window * job.batch.global_batch_size} samples must not exceed "
                f"loaders.read_ahead_samples = {job.loaders.read_ahead_samples}: the planner needs a whole window's summaries",
                window,
            )
        if window > 1 and job.strategy is None and balance.method != "token_budget":
            raise ConfigError(
                "balance.window_steps", f"windows of several steps apply to method 'token_budget', not {balance.method!r}", window
            )
    cost = balance.cost
    if not cost.kind.strip():
        raise ConfigError("balance.cost.kind", f"must be one of {COST_KINDS}, a model name or 'module:callable'", cost.kind)
    for name in ("linear", "quadratic"):
        v = getattr(cost, name)
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"balance.cost.{name}", "must be a finite number >= 0", v)
    if cost.kind == "quadratic" and cost.linear == 0 and cost.quadratic == 0:
        raise ConfigError("balance.cost", "linear and quadratic must not both be 0", dataclasses.asdict(cost))


def _check_loaders(job: JobSettings) -> None:
    """`loaders`: groups placing every source once, or a count; read-ahead, buffer, shuffle
    and failover."""
    loaders = job.loaders
    names = job.source_names
    if loaders.groups is not None:
        if loaders.count is not None:
            raise ConfigError("loaders.count", "cannot be combined with loaders.groups (the groups give the count)", loaders.count)
        placed: dict[str, int] = {}
        for g, group in enumerate(loaders.groups):
            if not group:
                raise ConfigError(f"loaders.groups[{g}]", "must name at least one source", list(group))
            for name in group:
                if name not in names:
                    raise ConfigError(f"loaders.groups[{g}]", f"{name!r} names no source; sources are {', '.join(names)}", list(group))
                if name in placed:
                    raise ConfigError(f"loaders.groups[{g}]", f"{name!r} is already in loaders.groups[{placed[name]}]", list(group))
                placed[name] = g
        missing = [name for name in names if name not in placed]
        if missing:
            raise ConfigError(
                "loaders.groups", f"must place every source in a group; missing: {', '.join(missing)}", [list(n) for n in loaders.groups]
            )
    if loaders.count is not None:
        _positive("loaders.count", loaders.count)
        if loaders.count > len(job.sources):
            raise ConfigError("loaders.count", f"must be <= the number of sources ({len(job.sources)})", loaders.count)
    _positive("loaders.read_ahead_samples", loaders.read_ahead_samples)
    _positive("loaders.buffer_bytes", loaders.buffer_bytes)
    _positive("loaders.shuffle.window_row_groups", loaders.shuffle.window_row_groups)
    if not (math.isfinite(loaders.failover.probe_interval_s) and loaders.failover.probe_interval_s > 0):
        raise ConfigError("loaders.failover.probe_interval_s", "must be a finite number > 0", loaders.failover.probe_interval_s)
    _positive("loaders.failover.failures", loaders.failover.failures)


def _check_constructors(job: JobSettings) -> None:
    """`constructors`: CP slicing, pulling ranks, ranks, prefetch, fetch steps and shared memory."""
    constructors = job.constructors
    if constructors.cp_slicing not in CP_SLICING:
        raise ConfigError("constructors.cp_slicing", f"must be one of {CP_SLICING}", constructors.cp_slicing)
    if constructors.pulling_ranks not in PULLING_RANKS:
        raise ConfigError("constructors.pulling_ranks", f"must be one of {PULLING_RANKS}", constructors.pulling_ranks)
    _positive("constructors.ranks_per_constructor", constructors.ranks_per_constructor)
    _positive("constructors.prefetch_steps", constructors.prefetch_steps)
    if not 1 <= constructors.fetch_steps <= MAX_FETCH_STEPS:
        raise ConfigError("constructors.fetch_steps", f"must be in [1, {MAX_FETCH_STEPS}]", constructors.fetch_steps)
    if constructors.batch_steps is not None and not 1 <= constructors.batch_steps <= MAX_BATCH_STEPS:
        raise ConfigError("constructors.batch_steps", f"must be in [1, {MAX_BATCH_STEPS}] (or null)", constructors.batch_steps)
    if constructors.shm_bytes < 0:
        raise ConfigError("constructors.shm_bytes", "must be >= 0 (0 turns shared memory off)", constructors.shm_bytes)


def _check_ledger(job: JobSettings) -> None:
    """`ledger`: how much detail is kept, and where it lies."""
    if job.ledger.keep_detail_steps is not None and job.ledger.keep_detail_steps < 0:
        raise ConfigError("ledger.keep_detail_steps", "must be >= 0 or null (keep everything)", job.ledger.keep_detail_steps)
    if job.ledger.location is not None:
        _check_ledger_location(job.ledger.location)


def _check_journal(job: JobSettings) -> None:
    """`batch.delivery` and `journal`: the policy, bounds, and what journal delivery cannot do."""
    if job.batch.delivery not in DELIVERIES:
        raise ConfigError("batch.delivery", f"must be one of {DELIVERIES}", job.batch.delivery)
    journal = job.journal
    if journal.policy not in JOURNAL_POLICIES:
        raise ConfigError("journal.policy", f"must be one of {JOURNAL_POLICIES}", journal.policy)
    _positive("journal.producers", journal.producers)
    _positive("journal.max_lag_steps", journal.max_lag_steps)
    _positive("journal.prefetch_steps", journal.prefetch_steps)
    if not isinstance(journal.reclaim, bool):
        raise ConfigError("journal.reclaim", "must be true or false", journal.reclaim)
    if (
        isinstance(journal.min_age_s, bool)
        or not isinstance(journal.min_age_s, (int, float))
        or not MIN_RECLAIM_AGE_S <= journal.min_age_s < math.inf
    ):
        raise ConfigError(
            "journal.min_age_s",
            f"must be a finite number of seconds >= {MIN_RECLAIM_AGE_S:g} (4 x the manifest's 30 s confirm window)",
            journal.min_age_s,
        )
    if journal.max_lag_steps <= journal.prefetch_steps:
        raise ConfigError("journal.max_lag_steps", f"must exceed journal.prefetch_steps ({journal.prefetch_steps})", journal.max_lag_steps)
    if journal.location is not None:
        _check_ledger_location(journal.location, field="journal.location")
    if job.batch.delivery == "journal" and (job.mixture.schedule or {}).get("kind") == "adaptive":
        raise ConfigError(
            "batch.delivery",
            "journal delivery cannot serve an adaptive mixture (its weights follow the training losses, "
            "which a producer running ahead has not seen): use stream delivery",
            job.batch.delivery,
        )


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or "localhost"."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_network(job: JobSettings) -> None:
    """`network`: plaintext only on loopback unless said to be meant, message size and time limits."""
    network = job.network
    if not network.tls and not network.insecure and not is_loopback(network.host):
        raise ConfigError(
            "network.host",
            "is an address other machines reach while network.tls is off: anyone who reaches a port could read training data "
            "and act as any part. Turn TLS on, bind a loopback address, or set network.insecure: true to say plaintext is "
            "meant there (a network nothing else can reach)",
            network.host,
        )
    if network.max_message_bytes < 2 * MiB:
        raise ConfigError("network.max_message_bytes", "must be >= 2 MiB (bulk data travels in 1 MiB chunks)", network.max_message_bytes)
    if not (math.isfinite(network.rpc_timeout_s) and network.rpc_timeout_s > 0):
        raise ConfigError("network.rpc_timeout_s", "must be a finite number > 0", network.rpc_timeout_s)
    if not (math.isfinite(network.heartbeat_s) and network.heartbeat_s > 0):
        raise ConfigError("network.heartbeat_s", "must be a finite number > 0", network.heartbeat_s)


#: The checks `_validate` runs, one per section, in this order (the first bad field is named).
SECTION_CHECKS: tuple[Callable[[JobSettings], None], ...] = (
    _check_top_level,
    _check_sources,
    _check_mixture,
    _check_mesh,
    _check_batch,
    _check_balance,
    _check_loaders,
    _check_constructors,
    _check_ledger,
    _check_journal,
    _check_network,
)


def _check_ledger_location(location: str, *, field: str = "ledger.location") -> None:
    """`ledger.location` (or `field`, e.g. journal.location): a local path, or a URL of a store
    that can hold it, with a bucket (or container) for an object store and a path for file://."""
    if not location.strip():
        raise ConfigError(field, "must not be empty (leave it out for the default under run_dir)", location)
    if not is_url(location):
        return
    parts = urllib.parse.urlsplit(location)
    scheme = parts.scheme.lower()
    if scheme not in LEDGER_SCHEMES:
        raise ConfigError(field, f"must be a local folder or a URL with a scheme of {LEDGER_SCHEMES}", location)
    if scheme == "file":
        if not parts.path.strip("/"):
            raise ConfigError(field, "must name a folder after file://, e.g. file:///data/ledger", location)
    elif not parts.netloc:
        raise ConfigError(field, f"must name a bucket or container, e.g. {scheme}://bucket/prefix", location)


def _positive(path: str, value: int) -> None:
    if value < 1:
        raise ConfigError(path, "must be >= 1", value)
