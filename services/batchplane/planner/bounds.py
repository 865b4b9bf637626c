"""Bounds on what a peer may send the planner: the fields of every request, and every loader's
summary response, checked against what the job has planned or can plan, once, at the edge.
Pure: no grpc, no I/O, no clocks. The servicer, the plan book and the summary puller call it;
`progress.PlanProgress` applies the step window (`plan_lead`) to its own state.

Each bound and why it holds for every correct peer:

- **Steps ahead** (`plan_lead`). A constructor builds at most `constructors.prefetch_steps` steps
  past the last step its slowest rank's call was handed, which is at most `batch_steps - 1` past
  the step it asked for (a GetBatch call carries up to `JobSettings.batch_steps` steps; the
  window below is that much longer), and a rank asks for step s only once it was handed s - 1; the trainers of
  one job move in lockstep (every step ends in a collective), so the ranks of other constructors
  were handed every step up to one below it. One more step covers a hand-over the planner has not
  heard of yet (constructors tell it with their next plan request or heartbeat). So a correct
  constructor asks for steps at most `prefetch_steps + 2` past the step below which every rank
  was handed every step (`PlanProgress.consumed_below`). A request further ahead is not refused
  for good (a constructor whose peers' hand-overs are late is correct): it waits for the window
  to reach it, then gets UNAVAILABLE, and nothing is planned for it. The planner never plans past
  the window, so a request for step 10^15 costs nothing. With `constructors.fetch_steps` k > 1 a
  plan comes with those of the constructor's next k - 1 steps where they are planned already, and
  the planner plans the next k after them too, so that they are when the constructor asks next:
  the window is 2 (k - 1) steps longer, `prefetch_steps + 2k + batch_steps - 1` (the requests
  themselves stay within `prefetch_steps + batch_steps + 1`).
- **Delivered steps**. `delivered_below` and a rejoining constructor's `next_step` claim that
  ranks were handed steps: never more than the planner served (`PlanProgress` clamps them to its
  served frontier and planning cursor), never more than the step asked for (the servicer clamps
  `delivered_below`).
- **Steps per answer** (`check_max_steps`): a GetPlan asks for at most `constructors.fetch_steps`
  steps' plans, what the job lets a constructor fetch at once.
- **Names and addresses** (`check_name`, `check_address`): replica ids and incarnations are pod
  names or uuids (a Kubernetes name has at most 253 characters); an address is a DNS name (253)
  with a scheme and a port, or a Unix socket path (at most 107 bytes): 512 characters leave room.
  Printable characters only, so a log line stays one line.
- **Resume fingerprints** (`check_resume`): group names and 16-hex-digit digests; a checkpoint of
  any version fits in `MAX_RESUME_ENTRIES` entries of `MAX_FINGERPRINT_CHARS`. A checkpoint whose
  "data" fingerprint differs names other samples: refused (the client refuses it too).
- **Reports** (`check_report_request`, `report_refusal`, `report_taken`): a step >= 0 and a
  finite loss >= 0 per named source; only for a step that is planned and not yet past (see
  there), so the reports waiting to be applied are at most the steps between the last applied
  one and the planning cursor, and report files on the ledger as many; at most one per step.
- **Source files** (`check_source_files`): a loader reports each source's files once per
  registration; at most `MAX_SOURCE_FILES` per source (a registration must fit one message of
  `network.max_message_bytes`, 4 MiB by default, beside one row-group size per row group, and
  the ledger records them), names of at most `MAX_FILE_NAME_CHARS` printable characters (a
  path below the source's location: Linux's PATH_MAX; an object key has at most 1,024 bytes),
  each once; sizes and times >= 0 or -1 (not given), rows >= 0 adding up to the source's rows.
- **Summaries** (`check_summary`): a loader's answer must be what was asked: starting at the
  position asked, no more samples than asked, equal lengths, rows of the source, lengths >= 0,
  finite features, bad reasons as uint8 codes, one per sample or none (an older loader), a
  digest per sample, 0 exactly for the bad ones, and an end of stream only where the stream ends.
- **Altered samples** (`check_altered`): a constructor reports the loader replicas that sent it
  samples other than the plan's digests as it finds them, each before it asks for the step's
  plan again: a handful a request (`MAX_ALTERED_REPORTS`), each an address and a source of the job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from batchplane.core import bad
from batchplane.core.errors import InvalidArgument
from batchplane.core.schedule import ScheduleError
from batchplane.planner.adaptive import AdaptiveRule, check_report
from batchplane.planner.source_changes import FileFacts

#: Characters of a replica id, incarnation or shadow's replica id (a Kubernetes object name has
#: at most 253).
MAX_NAME_CHARS = 253
#: Characters of a part's address: a DNS name (253) with scheme and port, or "unix://" and a
#: Unix socket path (at most 107 bytes), with room to spare.
MAX_ADDRESS_CHARS = 512
#: Entries of a resume's fingerprint map (a job has four groups; later versions may add some).
MAX_RESUME_ENTRIES = 32
#: Characters of a fingerprint group name or digest (digests have 16 hex digits).
MAX_FINGERPRINT_CHARS = 128
#: Altered-samples reports of one GetPlan request (`GetPlanRequest.altered`).
MAX_ALTERED_REPORTS = 8
#: Files of one source a registration may report (see the module docstring).
MAX_SOURCE_FILES = 100_000
#: Characters of a source file's name (relative to the source's location): Linux's PATH_MAX.
MAX_FILE_NAME_CHARS = 4096


class MalformedSummary(ValueError):
    """A loader's summary response is not what was asked; the text says what is wrong."""


def plan_lead(prefetch_steps: int, fetch_steps: int = 1, batch_steps: int = 1) -> int:
    """How many steps past `consumed_below` a plan request may ask for, and the planner plan
    (see the module docstring): `prefetch_steps + 2 * fetch_steps + batch_steps - 1`.

    Args:
        prefetch_steps: `constructors.prefetch_steps`.
        fetch_steps: `constructors.fetch_steps`.
        batch_steps: Steps one GetBatch call may carry (`JobSettings.batch_steps`).
    """
    return prefetch_steps + 2 * fetch_steps + batch_steps - 1


def report_delay_warning(rule: AdaptiveRule | None, *, prefetch_steps: int, batch_steps: int = 1) -> str | None:
    """What to warn of an adaptive mixture whose reports come too late, or None. Step s is
    planned with the reports of the steps up to s - `delay_steps`, and constructors ask for steps
    up to `plan_lead(prefetch_steps, 1, batch_steps)` past the one their ranks train on: with a
    shorter delay, planning waits for reports of steps not trained yet, and the trainers for
    their batches.

    Args:
        rule: The mixture's adaptive rule (`delay_steps`); None: the mixture does not adapt.
        prefetch_steps: `constructors.prefetch_steps`.
        batch_steps: Steps one GetBatch call may carry (`JobSettings.batch_steps`).
    """
    lead = plan_lead(prefetch_steps, 1, batch_steps)
    if rule is None or rule.delay_steps >= lead:
        return None
    carried = " + constructors.batch_steps - 1" if batch_steps > 1 else ""
    return (
        f"mixture.schedule.adaptive.delay_steps = {rule.delay_steps} is less than constructors.prefetch_steps + 2{carried} = {lead}: "
        f"planning will wait for training reports and the trainer for its batches"
    )


def check_step(field: str, value: int) -> int:
    """`value` if it is a step (>= 0).

    Raises:
        InvalidArgument: a negative value (the message names the field).
    """
    if value < 0:
        raise InvalidArgument(f"{field} must be >= 0, got {value}")
    return value


def check_max_steps(value: int, fetch_steps: int) -> int:
    """How many steps' plans a GetPlan answer carries for `max_steps` = `value` (0 or 1: the
    step's own), at most the job's `constructors.fetch_steps`.

    Raises:
        InvalidArgument: a negative value, or more than `fetch_steps` (the message names the field).
    """
    if not 0 <= value <= fetch_steps:
        raise InvalidArgument(f"max_steps must be in [0, {fetch_steps}] (constructors.fetch_steps), got {value}")
    return max(value, 1)


def check_name(field: str, value: str) -> str:
    """`value` if it can be a replica id or an incarnation ("" allowed: the default).

    Raises:
        InvalidArgument: longer than MAX_NAME_CHARS or with characters that are not printable
            (the message names the field, not the value).
    """
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(f"{field} must have at most {MAX_NAME_CHARS} characters, got {len(value)}")
    if not value.isprintable():
        raise InvalidArgument(f"{field} must have printable characters only")
    return value


def check_address(field: str, value: str) -> str:
    """`value` if it can be a part's address.

    Raises:
        InvalidArgument: empty, longer than MAX_ADDRESS_CHARS, or with blanks or characters that
            are not printable.
    """
    if not value:
        raise InvalidArgument(f"{field} is required")
    if len(value) > MAX_ADDRESS_CHARS:
        raise InvalidArgument(f"{field} must have at most {MAX_ADDRESS_CHARS} characters, got {len(value)}")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise InvalidArgument(f"{field} must have printable characters and no blanks only")
    return value


def check_altered(reports: Sequence[Any], *, sources: int) -> None:
    """Checks a GetPlan request's reports of altered samples (`GetPlanRequest.altered`: objects
    with loader_address and source).

    Raises:
        InvalidArgument: more than MAX_ALTERED_REPORTS, an address that cannot be one, or a
            source outside the job's `sources` (the message names the field).
    """
    if len(reports) > MAX_ALTERED_REPORTS:
        raise InvalidArgument(f"altered has {len(reports)} entries, at most {MAX_ALTERED_REPORTS}")
    for i, report in enumerate(reports):
        check_address(f"altered[{i}].loader_address", report.loader_address)
        if not 0 <= report.source < sources:
            raise InvalidArgument(f"altered[{i}].source must be in [0, {sources}), got {report.source}")


def check_source_files(source: str, num_rows: int, files: Sequence[Any]) -> tuple[FileFacts, ...]:
    """The files a loader reports of source `source` (`SourceInfo.files`: objects with name,
    size_bytes, mtime_ns and rows), if they can be its files.

    Raises:
        InvalidArgument: more than MAX_SOURCE_FILES files; a name that is empty, longer than
            MAX_FILE_NAME_CHARS, not printable or given twice; a size or time below -1; rows
            below 0, or not adding up to `num_rows` (the message names the source, not the name).
    """
    if len(files) > MAX_SOURCE_FILES:
        raise InvalidArgument(f"source {source!r}: at most {MAX_SOURCE_FILES} files, got {len(files)}")
    out, seen = [], set()
    for i, f in enumerate(files):
        name = f.name
        if not name or len(name) > MAX_FILE_NAME_CHARS or not name.isprintable():
            raise InvalidArgument(f"source {source!r}: files[{i}].name must have 1 to {MAX_FILE_NAME_CHARS} printable characters")
        if name in seen:
            raise InvalidArgument(f"source {source!r}: files[{i}].name repeats an earlier file's")
        seen.add(name)
        if f.size_bytes < -1 or f.mtime_ns < -1:
            raise InvalidArgument(f"source {source!r}: files[{i}]: size_bytes and mtime_ns must be >= 0, or -1 (not given)")
        if f.rows < 0:
            raise InvalidArgument(f"source {source!r}: files[{i}].rows must be >= 0, got {f.rows}")
        out.append(FileFacts(name, int(f.size_bytes), int(f.mtime_ns), int(f.rows)))
    if out and sum(f.rows for f in out) != num_rows:
        raise InvalidArgument(f"source {source!r}: files of {sum(f.rows for f in out)} rows for {num_rows} rows")
    return tuple(out)


def check_resume(resume: Mapping[str, str], fingerprints: Mapping[str, str]) -> dict[str, str]:
    """The fingerprints of the checkpoint a plan request resumes from, if they can be.

    Args:
        resume: The request's `resume` map (empty: a fresh start).
        fingerprints: The job's settings fingerprints.
    Raises:
        InvalidArgument: more than MAX_RESUME_ENTRIES entries, a name or value longer than
            MAX_FINGERPRINT_CHARS, or a "data" fingerprint other than the job's (its positions
            name other samples).
    """
    if len(resume) > MAX_RESUME_ENTRIES:
        raise InvalidArgument(f"resume must have at most {MAX_RESUME_ENTRIES} entries, got {len(resume)}")
    for name, value in resume.items():
        if len(name) > MAX_FINGERPRINT_CHARS or len(value) > MAX_FINGERPRINT_CHARS:
            raise InvalidArgument(f"resume: names and fingerprints must have at most {MAX_FINGERPRINT_CHARS} characters")
    if "data" in resume and resume["data"] != fingerprints.get("data"):
        raise InvalidArgument(
            "resume: the checkpoint's data settings (sources, transforms, seed, epochs or shuffle) differ from the job's: "
            "its positions name other samples"
        )
    return dict(resume)


def check_report_request(step: int, losses: Mapping[str, float], *, rule: AdaptiveRule) -> dict[str, float]:
    """The losses of a training report of `step` (mean loss per source), as floats, if they can
    be.

    Args:
        rule: The mixture's adaptive rule (its sources).
    Raises:
        InvalidArgument: a negative step, a name that is no source, or a loss that is not a
            finite number >= 0.
    """
    if step < 0:
        raise InvalidArgument(f"report: step must be >= 0, got {step}")
    try:
        check_report(rule, losses)
    except ScheduleError as exc:
        raise InvalidArgument(f"report of step {step}: {exc.problem}, got {exc.value!r}") from exc
    return {name: float(loss) for name, loss in losses.items()}


class ReportRefusal(NamedTuple):
    """Why a training report is not taken."""

    reason: str
    #: The step's report was applied already: a retry of the report that was is still taken.
    applied: bool = False


def report_refusal(step: int, *, start: int, applied_through: int, handed_below: int) -> ReportRefusal | None:
    """Why the training report of `step` is not taken, or None when it is.

    A report is taken for a step that is planned and not yet past. *Planned*: below
    `handed_below`, the first step no rank can have been handed (a trainer reports a step it
    trained on). *Past*: its report was applied already (step <= applied_through: the steps
    planned since used it, or counted it missing), or the step precedes this run's start (its
    report belongs to an earlier run's ledger). At most one report per step stands: the first
    (the caller compares a repeated one with it).

    Args:
        start: The step this run of the job started at.
        applied_through: The last step whose report the adaptive state holds.
        handed_below: No rank can have been handed a step at or after it
            (`PlanProgress.handed_below`).
    """
    if step < start:
        return ReportRefusal(f"step {step} is before step {start}, where this run of the job started, so its report is not used")
    if step <= applied_through:
        return ReportRefusal(f"step {step} is past: the reports through step {applied_through} were applied already", applied=True)
    if step >= handed_below:
        return ReportRefusal(f"step {step} is not planned yet (steps below {handed_below} may be): a report is taken for a step trained on")
    return None


def report_taken(step: int, losses: Mapping[str, float], *, refusal: ReportRefusal | None, stored: Mapping | None) -> tuple[bool, str]:
    """Whether the training report of `step` with `losses` is taken, and why not: refused (see
    `report_refusal`) unless it retries the report that was applied, and not taken when the step
    was reported first with other losses (the first report stands).

    Args:
        refusal: `report_refusal` of the step.
        stored: The report that stands for the step on the ledger ({"losses": ...}): without a
            refusal, the one stored first (this one, or an earlier); with a refusal of an
            applied step, the one stored, if any. None: none.
    Returns:
        (taken, reason): the reason is "" when taken.
    """
    if refusal is not None:  # a retry of a report that was applied is still taken
        taken = refusal.applied and stored == {"losses": losses}
        return taken, "" if taken else refusal.reason
    if stored != {"losses": losses}:
        return False, f"step {step} was already reported with other losses; the first report stands"
    return True, ""


def check_summary(
    rows: np.ndarray,
    lengths: np.ndarray,
    features: Mapping[str, np.ndarray],
    *,
    start_seq: int,
    end_of_stream: bool,
    from_seq: int,
    max_samples: int,
    num_rows: int | None,
    stream_end: int | None,
    reasons: np.ndarray | None = None,
    digests: np.ndarray | None = None,
) -> None:
    """Checks a loader's summary response against its request (decoded arrays, no copy).

    Args:
        reasons: The bad samples' reason codes (`core.bad`; None or empty: not sent).
        digests: The samples' digests (`core.digest`; None: not sent, which only an answer of no
            samples may do): one per row, 0 exactly for the bad samples (length 0).
        from_seq: The position asked from; the answer must start there.
        max_samples: The most samples asked for.
        num_rows: The source's rows (None: unknown, rows are only checked >= 0).
        stream_end: Where the source's stream ends (epochs x repeat x rows; None: it never ends).
    Raises:
        MalformedSummary: the answer is not what was asked (the message says what).
    """
    n = len(rows)
    if start_seq != from_seq:
        raise MalformedSummary(f"starts at position {start_seq}, asked from {from_seq}")
    if n > max_samples:
        raise MalformedSummary(f"{n} samples, at most {max_samples} asked for")
    if len(lengths) != n:
        raise MalformedSummary(f"{len(lengths)} lengths for {n} rows")
    if reasons is not None:
        if reasons.dtype != bad.DTYPE or reasons.ndim != 1:
            raise MalformedSummary(f"bad reasons of dtype {reasons.dtype} and shape {reasons.shape}, not {np.dtype(bad.DTYPE)} [n]")
        if len(reasons) not in (0, n):
            raise MalformedSummary(f"{len(reasons)} bad reasons for {n} rows")
    if n and digests is None:
        raise MalformedSummary(f"no digests for {n} rows")
    if digests is not None and len(digests) != n:
        raise MalformedSummary(f"{len(digests)} digests for {n} rows")
    if digests is not None and n and np.any((digests == 0) != (lengths == 0)):
        raise MalformedSummary("digests of 0 for good samples or other than 0 for bad ones (length 0)")
    for name, values in features.items():
        if len(values) != n:
            raise MalformedSummary(f"feature {name[:MAX_FINGERPRINT_CHARS]!r}: {len(values)} values for {n} rows")
        if n and not np.all(np.isfinite(values)):
            raise MalformedSummary(f"feature {name[:MAX_FINGERPRINT_CHARS]!r}: values that are not finite")
    if n:
        if rows.min() < 0 or (num_rows is not None and rows.max() >= num_rows):
            raise MalformedSummary(f"rows outside [0, {num_rows if num_rows is not None else 'rows'})")
        if lengths.min() < 0:
            raise MalformedSummary("negative lengths")
    if stream_end is not None and start_seq + n > stream_end:
        raise MalformedSummary(f"positions up to {start_seq + n - 1}, past the stream's end at {stream_end}")
    if end_of_stream and (stream_end is None or start_seq + n != stream_end):
        where = "the stream never ends" if stream_end is None else f"the stream ends at {stream_end}"
        raise MalformedSummary(f"says the stream ends at {start_seq + n}, but {where}")
