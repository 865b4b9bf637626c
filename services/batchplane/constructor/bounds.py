"""Bounds on what a constructor accepts: every field a trainer sends, and every number a peer
(the planner, a loader) answers with, is checked before it is acted on or allocated from. Pure:
no grpc, no I/O; the servicer, `responses` and the pipeline call it.

From the trainer (each refusal is the trainer's request's error; nothing else is touched):

- GetBatch: a rank in the mesh (INVALID_ARGUMENT; one not served here is refused by the
  pipeline), a step in [0, MAX_STEP], a `resume` map of at most MAX_RESUME_KEYS entries with
  names of at most MAX_RESUME_KEY_CHARS and values of at most MAX_RESUME_VALUE_CHARS characters
  (INVALID_ARGUMENT). `wait_ms` is cut to `core.rpc.MAX_WAIT_MS` by the servicer. Once its ranks
  have started, a step past the furthest step any of them asked for plus one is
  FAILED_PRECONDITION (`progress.BuildProgress.ask`): a trainer moves one step at a time, and
  one that resumes from a checkpoint resumes at a step this data plane has reached.
- GetBatch's shared-memory fields: at most MAX_RELEASED_SLABS `released_slabs`, each a slab the
  request's session holds (INVALID_ARGUMENT; `check_released_slabs`). An `shm_session` the
  constructor does not know is no error: that batch goes over gRPC.
- MarkCheckpoint: a rank in the mesh and a step in [0, MAX_STEP] (INVALID_ARGUMENT); with journal
  delivery a rank served here (INVALID_ARGUMENT) that was handed a step, at a step from the
  one it (re)started at to one past the last one it was handed (FAILED_PRECONDITION;
  `checkpoint_marks`).
- Report: a step in [0, MAX_STEP] and losses only of the job's sources (so at most one per
  source), each a finite number >= 0 (INVALID_ARGUMENT); a step no rank here has been built
  is FAILED_PRECONDITION, one before the oldest step the planner's ledger keeps is not
  accepted (`progress.BuildProgress.reportable`).

From peers, a malformed answer is a `MalformedResponse`: an Unavailable, so the step is built
again from a fresh plan (the build loop's retry), counted in
batchplane_constructor_malformed_responses_total{peer} and logged with the peer's address; it
never ends the build thread or the process.

- A loader's FetchSamples stream: the header first, announcing at most
  `fetch_payload_limit(samples, tokens)` bytes, the most the Arrow payload of the samples asked
  for can take with the lengths the plan gives them, checked before the buffer is allocated;
  then exactly the samples asked for with their planned lengths (`responses.receive_samples`).
  A fetch of several steps (`constructors.fetch_steps`): `following_served` in [0, following
  steps asked for], one record batch per step served, each exactly that step's samples; the
  sizes are bounded as above by the samples of the steps served.
  With declared payload columns the announced size is bounded by the columns' declared shapes
  (token and sample columns, from the planned lengths) and, for everything together, by
  `fetch_bytes_cap`: the job's `loaders.buffer_bytes` plus the IPC stream's own bytes. A loader
  never sends more: it refuses (RESOURCE_EXHAUSTED) a fetch whose samples take more than
  `loaders.buffer_bytes`, so a larger announcement is malformed (a blob's rows are bounded by
  nothing else the plan says).
- The planner's GetPlan answer: the step asked for, an `oldest_step` in [0, step], per bucket
  arrays of one length n (at most one step's samples), microbatch offsets from 0 rising to n (at
  most max(n, microbatches) microbatches), `fetchers` in [1, constructors], per-sample `copies`
  (when given) of length n in [1, constructors], and lengths >= 0 (`check_plan_step`,
  `check_bucket`). Each secondary graph's part (`check_subplan_part`): an axis of the mesh and a
  bucket one of this constructor's ranks consumes (each (graph, bucket) once), arrays of one
  length n (at most one step's samples), lengths >= 0, a `metadata` name that is no other
  tensor's, no sample listed twice in the graph's parts; a part that delivers `columns` names
  each once, each a declared payload column of kind "sample" or "blob", with `loaders` of
  length n indexing `loader_addresses` and `copies` of length n in [1, constructors].
  The plans of following steps that come with it (`check_following`): fewer than the steps
  asked for, each the constructor's next step after the one before it, none the end of data
  and none with following plans of its own; each then checked as a plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from batchplane.core.errors import InvalidArgument, Unavailable

#: The largest step a request may name (steps are counted from 0; far below any overflow).
MAX_STEP = 2**62
#: Entries of a GetBatch request's `resume` map (a checkpoint's settings fingerprints).
MAX_RESUME_KEYS = 32
#: Characters of a `resume` name.
MAX_RESUME_KEY_CHARS = 64
#: Characters of a `resume` value.
MAX_RESUME_VALUE_CHARS = 256
#: Slab ids one GetBatch request may release (a client releases about one per step it took).
MAX_RELEASED_SLABS = 64
#: Characters of a GetBatch request's `shm_session` (128 bits in hex).
MAX_SESSION_CHARS = 32
#: Bytes of an Arrow IPC stream besides its buffers: the schema and record batch messages,
#: padding and the end-of-stream marker (a few hundred bytes in practice).
FETCH_OVERHEAD_BYTES = 64 << 10
#: Payload bytes one sample may take besides its tokens: source, seq, list offset, validity bits
#: and alignment (16 in practice).
FETCH_SAMPLE_BYTES = 64
#: Bytes of one token in a fetched payload (int32).
TOKEN_BYTES = 4
#: Bytes one declared column may take in a payload besides its values: its buffers' padding and
#: metadata, and per sample a list offset and validity bit (rounded up generously).
COLUMN_OVERHEAD_BYTES = 1024
COLUMN_SAMPLE_BYTES = 16
#: The axes a secondary graph's part may name (`batchplane.core.mesh.DISTRIBUTION_AXES`).
PART_AXES = ("DP", "CP", "WORLD")
#: Kinds of payload columns a secondary graph may deliver (a token column travels with its sequences).
DELIVERABLE_KINDS = ("sample", "blob")


class MalformedResponse(Unavailable):
    """A peer answered what the contract does not allow.

    Args:
        peer: The peer's part, "planner" or "loader" (the metric's label).
        address: Where it answered from.
        problem: What is wrong.
    """

    def __init__(self, peer: str, address: str, problem: str) -> None:
        super().__init__(f"{peer} at {address} sent a malformed response: {problem}")
        self.peer = peer
        self.address = address


def fetch_payload_limit(*, samples: int, tokens: int) -> int:
    """The most bytes a FetchSamples payload of `samples` samples holding `tokens` tokens (their
    planned lengths) may take."""
    return FETCH_OVERHEAD_BYTES + FETCH_SAMPLE_BYTES * samples + TOKEN_BYTES * tokens


def fetch_bytes_cap(*, buffer_bytes: int, samples: int, columns: int) -> int:
    """The most bytes any FetchSamples payload of `samples` samples with `columns` declared
    columns may take: the loader's budget `loaders.buffer_bytes` (it refuses a fetch whose
    samples take more) plus the IPC stream's own bytes (schema, padding, offsets, validity)."""
    return (
        buffer_bytes
        + FETCH_OVERHEAD_BYTES
        + columns * COLUMN_OVERHEAD_BYTES
        + samples * (FETCH_SAMPLE_BYTES + columns * COLUMN_SAMPLE_BYTES)
    )


def check_fetch_header(payload_bytes: int, num_samples: int, *, samples: int, tokens: int, peer: str, address: str) -> None:
    """Checks a FetchHeader for `samples` samples of `tokens` planned tokens before its payload
    is allocated.

    Raises:
        MalformedResponse: a negative size, more than `fetch_payload_limit`, or another count of samples.
    """
    limit = fetch_payload_limit(samples=samples, tokens=tokens)
    if not 0 <= payload_bytes <= limit:
        raise MalformedResponse(
            peer, address, f"payload_bytes {payload_bytes} outside [0, {limit}] for {samples} samples of {tokens} tokens"
        )
    if num_samples != samples:
        raise MalformedResponse(peer, address, f"num_samples {num_samples} for {samples} samples asked for")


def check_plan_step(*, asked: int, step: int, oldest_step: int, peer: str, address: str) -> None:
    """Checks the step numbers of a GetPlan answer to a request for step `asked`.

    Raises:
        MalformedResponse: another step, or an oldest step outside [0, step].
    """
    if step != asked:
        raise MalformedResponse(peer, address, f"the plan of step {step} for step {asked}")
    if not 0 <= oldest_step <= step:
        raise MalformedResponse(peer, address, f"oldest_step {oldest_step} outside [0, {step}]")


def check_following(
    *, asked: int, steps: Sequence[int], stride: int, max_steps: int, ends: Sequence[bool], nested: Sequence[int], address: str
) -> None:
    """Checks the plans of following steps that a GetPlan answer to a request for step `asked`
    (of at most `max_steps` steps' plans) carries: their `steps`, whether each says the end of
    data (`ends`) and how many following plans each carries itself (`nested`).

    Raises:
        MalformedResponse: more than `max_steps` - 1 of them, a step other than the next one
            (`stride` apart), an end of data, or plans nested in one.
    """
    if len(steps) > max_steps - 1:
        raise MalformedResponse("planner", address, f"{len(steps)} following plans for at most {max_steps - 1} asked for")
    for i, (step, end, inner) in enumerate(zip(steps, ends, nested)):
        if step != asked + (i + 1) * stride:
            raise MalformedResponse("planner", address, f"following plan {i} is of step {step}, not {asked + (i + 1) * stride}")
        if end or inner:
            raise MalformedResponse("planner", address, f"following plan {i} (step {step}) says the end of data or carries plans itself")


def check_bucket(
    *,
    bucket: int,
    sizes: Mapping[str, int],
    offsets: np.ndarray,
    lengths: np.ndarray,
    fetchers: int,
    constructors: int,
    max_samples: int,
    microbatches: int,
    peer: str,
    address: str,
    copies: np.ndarray | None = None,
) -> None:
    """Checks one RankPlan's numbers.

    Args:
        bucket: The bucket it plans.
        sizes: Entries of each per-sample array by field name; all must be equal.
        offsets: int64 [m + 1], its microbatch offsets.
        lengths: int32 [n], its samples' lengths.
        fetchers: How many constructors fetch its samples.
        constructors: Constructors in the job.
        max_samples: Samples one step plans (`batch.global_batch_size`).
        microbatches: Microbatches a rank has per step at least (`batch.microbatches`).
        copies: int32 [n], per sample how many constructors fetch it (RankPlan.copies), or None.
    Raises:
        MalformedResponse: arrays of other lengths, more than one step's samples, offsets that
            do not rise from 0 to n or make too many microbatches, fetchers or copies outside
            [1, constructors], or a negative length.
    """
    where = f"bucket {bucket}"
    counts = set(sizes.values())
    if len(counts) > 1:
        raise MalformedResponse(peer, address, f"{where}: per-sample arrays of different lengths {dict(sizes)}")
    n = counts.pop() if counts else 0
    if n > max_samples:
        raise MalformedResponse(peer, address, f"{where}: {n} samples, more than one step's {max_samples}")
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) < 0):
        raise MalformedResponse(peer, address, f"{where}: microbatch offsets must rise from 0 to {n}")
    if len(offsets) - 1 > max(n, microbatches):
        raise MalformedResponse(peer, address, f"{where}: {len(offsets) - 1} microbatches for {n} samples")
    if not 1 <= fetchers <= constructors:
        raise MalformedResponse(peer, address, f"{where}: fetchers {fetchers} outside [1, {constructors}]")
    if len(lengths) and lengths.min() < 0:
        raise MalformedResponse(peer, address, f"{where}: a negative sample length")
    if copies is not None:
        _check_copies(copies, n=n, constructors=constructors, where=where, peer=peer, address=address)


def _check_copies(copies: np.ndarray, *, n: int, constructors: int, where: str, peer: str, address: str) -> None:
    if len(copies) != n:
        raise MalformedResponse(peer, address, f"{where}: copies of {len(copies)} entries for {n} samples")
    if n and not 1 <= copies.min() <= copies.max() <= constructors:
        raise MalformedResponse(peer, address, f"{where}: copies outside [1, {constructors}]")


def check_subplan_part(
    *,
    name: str,
    axis: str,
    bucket: int,
    metadata: str,
    sizes: Mapping[str, int],
    lengths: np.ndarray,
    columns: Sequence[str],
    kinds: Mapping[str, str],
    loaders: np.ndarray | None,
    copies: np.ndarray | None,
    loader_count: int,
    constructors: int,
    max_samples: int,
    consumed: bool,
    peer: str,
    address: str,
) -> None:
    """Checks one SubPlanPart's numbers (a secondary graph's samples for one bucket).

    Args:
        sizes: Entries of each per-sample array (samples, values) by field name.
        lengths: int32 [n], its samples' planned lengths.
        columns: The payload columns it delivers (SubPlanPart.columns).
        kinds: The job's declared payload columns, name -> kind.
        loaders: int32 [n], each sample's loader in `loader_addresses` (None when absent).
        copies: int32 [n], constructors fetching each sample (None when absent).
        loader_count: Entries of the response's `loader_addresses`.
        consumed: Whether one of this constructor's ranks consumes (axis, bucket).
    Raises:
        MalformedResponse: an unknown axis, a bucket no rank here consumes, arrays of other
            lengths, more than one step's samples, a negative length, a metadata name that is a
            tensor's (sample_*, a delivered column's), a column named twice, undeclared or of
            kind "token", or (with columns) loaders or copies missing, of another length, or
            out of range.
    """
    where = f"subplan {name[:64]!r} bucket {bucket}"
    if axis not in PART_AXES:
        raise MalformedResponse(peer, address, f"{where}: axis {axis[:16]!r} is none of {', '.join(PART_AXES)}")
    if not consumed:
        raise MalformedResponse(peer, address, f"{where}: no rank of this constructor consumes bucket {bucket} of axis {axis}")
    counts = set(sizes.values())
    if len(counts) > 1:
        raise MalformedResponse(peer, address, f"{where}: per-sample arrays of different lengths {dict(sizes)}")
    n = counts.pop() if counts else 0
    if n > max_samples:
        raise MalformedResponse(peer, address, f"{where}: {n} samples, more than one step's {max_samples}")
    if len(lengths) and lengths.min() < 0:
        raise MalformedResponse(peer, address, f"{where}: a negative sample length")
    if len(set(columns)) != len(columns):
        raise MalformedResponse(peer, address, f"{where}: a column is named twice in its columns")
    for column in columns:
        if kinds.get(column) not in DELIVERABLE_KINDS:
            what = "is not a declared payload column" if column not in kinds else f"is a {kinds[column]} column"
            raise MalformedResponse(peer, address, f"{where}: column {column[:64]!r} {what}; a part delivers sample or blob columns")
    taken = {t for c in columns for t in (c, c + "_offsets")}
    if not metadata or metadata.startswith("sample_") or metadata in taken:
        raise MalformedResponse(peer, address, f"{where}: metadata name {metadata[:64]!r} is another tensor's")
    if not columns:
        return
    if loaders is None or copies is None:
        raise MalformedResponse(peer, address, f"{where}: delivers columns without loaders and copies per sample")
    if len(loaders) != n:
        raise MalformedResponse(peer, address, f"{where}: loaders of {len(loaders)} entries for {n} samples")
    if n and not 0 <= loaders.min() <= loaders.max() < loader_count:
        raise MalformedResponse(peer, address, f"{where}: loaders outside its {loader_count} loader addresses")
    _check_copies(copies, n=n, constructors=constructors, where=where, peer=peer, address=address)


def check_unique_samples(source: np.ndarray, seq: np.ndarray, *, where: str, peer: str, address: str) -> None:
    """Raises MalformedResponse when a (source, seq) occurs twice in `where`."""
    if len(seq) < 2:
        return
    order = np.lexsort((seq, source))
    s, q = source[order], seq[order]
    same = (s[1:] == s[:-1]) & (q[1:] == q[:-1])
    if same.any():
        i = int(np.flatnonzero(same)[0])
        raise MalformedResponse(peer, address, f"{where}: sample (source {int(s[i])}, seq {int(q[i])}) is listed twice")


def check_batch_request(*, rank: int, step: int, world: int, resume: Mapping[str, str], max_steps: int = 0, batch_steps: int = 1) -> None:
    """Checks a GetBatch request's fields.

    Raises:
        InvalidArgument: a rank outside the mesh of `world` ranks, a step outside
            [0, MAX_STEP], a `resume` map beyond its bounds, or `max_steps` outside
            [0, batch_steps] (the steps one call may carry here, `JobSettings.batch_steps`).
    """
    if not 0 <= rank < world:
        raise InvalidArgument(f"rank {rank} is outside the job's mesh of {world} ranks")
    if not 0 <= step <= MAX_STEP:
        raise InvalidArgument(f"step must be in [0, {MAX_STEP}], got {step}")
    if not 0 <= max_steps <= batch_steps:
        raise InvalidArgument(f"max_steps must be in [0, {batch_steps}] (constructors.batch_steps), got {max_steps}")
    if len(resume) > MAX_RESUME_KEYS:
        raise InvalidArgument(f"resume: at most {MAX_RESUME_KEYS} fingerprints, got {len(resume)}")
    for name, value in resume.items():
        if len(name) > MAX_RESUME_KEY_CHARS or len(value) > MAX_RESUME_VALUE_CHARS:
            raise InvalidArgument(
                f"resume: names of at most {MAX_RESUME_KEY_CHARS} and values of at most {MAX_RESUME_VALUE_CHARS} characters, "
                f"got {name[:MAX_RESUME_KEY_CHARS]!r}"
            )


def check_checkpoint_request(*, rank: int, step: int, world: int) -> None:
    """Checks a MarkCheckpoint request's fields (whether the rank is served here and was handed
    the step is the servicer's to check: `checkpoint_marks.CheckpointMarks.checkpointed`).

    Raises:
        InvalidArgument: a rank outside the mesh of `world` ranks, or a step outside
            [0, MAX_STEP].
    """
    if not 0 <= rank < world:
        raise InvalidArgument(f"rank {rank} is outside the job's mesh of {world} ranks")
    if not 0 <= step <= MAX_STEP:
        raise InvalidArgument(f"a checkpoint's step must be in [0, {MAX_STEP}], got {step}")


def check_report(*, step: int, losses: Mapping[str, float], sources: Sequence[str]) -> None:
    """Checks a Report's fields against the job.

    Raises:
        InvalidArgument: a step outside [0, MAX_STEP], a name that is no source of the job, or
            a loss that is not a finite number >= 0.
    """
    if not 0 <= step <= MAX_STEP:
        raise InvalidArgument(f"report: step must be in [0, {MAX_STEP}], got {step}")
    unknown = sorted(set(losses) - set(sources))
    if unknown:
        raise InvalidArgument(
            f"report of step {step}: {unknown[0][:64]!r} names no source; sources are {', '.join(sources)} ({len(unknown)} unknown names)"
        )
    for name, loss in losses.items():
        if not (math.isfinite(loss) and loss >= 0):
            raise InvalidArgument(f"report of step {step}: the loss of source {name!r} must be a finite number >= 0, got {loss!r}")


def check_released_slabs(released: Sequence[int], *, session: str, holds: Callable[[int], bool] | None) -> None:
    """Checks a GetBatch request's shared-memory fields.

    Args:
        released: Its `released_slabs`.
        session: Its `shm_session`.
        holds: Whether the request's session holds a slab; None when the session is unknown
            (then the ids are not checked against it: a constructor that restarted knows none).
    Raises:
        InvalidArgument: a session id past MAX_SESSION_CHARS, more than MAX_RELEASED_SLABS ids,
            or an id the session does not hold (or repeated).
    """
    if len(session) > MAX_SESSION_CHARS:
        raise InvalidArgument(f"shm_session: at most {MAX_SESSION_CHARS} characters, got {len(session)}")
    if len(released) > MAX_RELEASED_SLABS:
        raise InvalidArgument(f"released_slabs: at most {MAX_RELEASED_SLABS} ids, got {len(released)}")
    if holds is None:
        return
    if len(set(released)) != len(released):
        raise InvalidArgument("released_slabs: an id is repeated")
    for slab in released:
        if not holds(slab):
            raise InvalidArgument(f"released_slabs: slab {slab} is not held by session {session[:MAX_SESSION_CHARS]!r}")
