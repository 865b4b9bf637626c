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
- The planner's GetPlan answer: the step asked for, an `oldest_step` in [0, step], per bucket
  arrays of one length n (at most one step's samples), microbatch offsets from 0 rising to n (at
  most max(n, microbatches) microbatches), `fetchers` in [1, constructors] and lengths >= 0
  (`check_plan_step`, `check_bucket`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

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
#: Bytes of an Arrow IPC stream besides its buffers: the schema and record batch messages,
#: padding and the end-of-stream marker (a few hundred bytes in practice).
FETCH_OVERHEAD_BYTES = 64 << 10
#: Payload bytes one sample may take besides its tokens: source, seq, list offset, validity bits
#: and alignment (16 in practice).
FETCH_SAMPLE_BYTES = 64
#: Bytes of one token in a fetched payload (int32).
TOKEN_BYTES = 4


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
    Raises:
        MalformedResponse: arrays of other lengths, more than one step's samples, offsets that
            do not rise from 0 to n or make too many microbatches, fetchers outside
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


def check_batch_request(*, rank: int, step: int, world: int, resume: Mapping[str, str]) -> None:
    """Checks a GetBatch request's fields.

    Raises:
        InvalidArgument: a rank outside the mesh of `world` ranks, a step outside
            [0, MAX_STEP], or a `resume` map beyond its bounds.
    """
    if not 0 <= rank < world:
        raise InvalidArgument(f"rank {rank} is outside the job's mesh of {world} ranks")
    if not 0 <= step <= MAX_STEP:
        raise InvalidArgument(f"step must be in [0, {MAX_STEP}], got {step}")
    if len(resume) > MAX_RESUME_KEYS:
        raise InvalidArgument(f"resume: at most {MAX_RESUME_KEYS} fingerprints, got {len(resume)}")
    for name, value in resume.items():
        if len(name) > MAX_RESUME_KEY_CHARS or len(value) > MAX_RESUME_VALUE_CHARS:
            raise InvalidArgument(
                f"resume: names of at most {MAX_RESUME_KEY_CHARS} and values of at most {MAX_RESUME_VALUE_CHARS} characters, "
                f"got {name[:MAX_RESUME_KEY_CHARS]!r}"
            )


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
            f"report of step {step}: {unknown[0][:64]!r} names no source; sources are {', '.join(sources)} "
            f"({len(unknown)} unknown names)"
        )
    for name, loss in losses.items():
        if not (math.isfinite(loss) and loss >= 0):
            raise InvalidArgument(f"report of step {step}: the loss of source {name!r} must be a finite number >= 0, got {loss!r}")
