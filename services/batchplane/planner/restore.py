"""Where a plan sequence continues from, read from the durable ledger (see `journal`): the
mixture's state before a step (the record of the step before, or a fast-forward where the ledger
lacks it), the adaptive mixing state with the training reports stored since, all of it assembled
for a start or a rewind (`restore_start`), the floor a restarted planner resumes at, and the
oldest step a rewind can re-plan. Reads the ledger; decides nothing about requests (that is
`progress`) and holds no state (that is `book.PlanBook`, which applies what `restore_start`
returns under its lock).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from batchplane.core.config import JobSettings
from batchplane.core.errors import FailedPrecondition
from batchplane.planner.adaptive import AdaptiveRule, AdaptiveState, state_from_json as adaptive_from_json
from batchplane.planner.journal import LedgerReader, LedgerWriter
from batchplane.planner.ledger import Ledger, state_from_json
from batchplane.planner.mixture import Mixture, MixtureState
from batchplane.planner.window import Resume, resume_inside

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Restored:
    """The mixture's state before a step.

    Attributes:
        state: The state.
        changed: Groups of settings ("mixture", "topology", "batching") that changed since the
            ledger's generation that planned the step before.
        record: That step's record; None at step 0 or after a fast-forward.
    """

    state: MixtureState
    changed: tuple[str, ...] = ()
    record: dict | None = None


def restore_mixture(
    step: int, *, job: JobSettings, mixture: Mixture, reader: LedgerReader, resume: Mapping[str, str], adaptive: bool
) -> Restored:
    """The mixture state before `step`: from the ledger's record of step - 1, else by
    fast-forwarding from the start (exact only if the mixture did not change).

    Args:
        resume: The settings fingerprints of the checkpoint a trainer resumes from (empty: none).
        adaptive: The mixture adapts to training reports (it cannot be fast-forwarded).
    Raises:
        FailedPrecondition: the ledger's sources or data settings differ from the job's, or the
            state cannot be made exact without the record (an adaptive mixture, a mixture change).
    """
    initial = MixtureState.initial(len(job.sources))
    if step == 0:
        return Restored(initial)
    where = reader.storage.describe()
    record = reader.record(step - 1)
    if record is not None:
        before = reader.owner(step - 1)
        if list(before.sources) != list(job.source_names):
            raise FailedPrecondition(
                f"cannot resume at step {step}: the ledger's sources {list(before.sources)} are not this job's {list(job.source_names)}"
            )
        changed = tuple(name for name, value in job.fingerprints.items() if before.fingerprints.get(name) != value)
        if "data" in changed:
            raise FailedPrecondition(
                f"cannot resume at step {step}: the data settings (sources, transforms, seed, epochs or shuffle) changed since "
                f"generation {before.gen} of the ledger at {where} planned it, so its positions name other samples"
            )
        log.info(
            "job resumes at step %d from the ledger's record of step %d (generation %d)%s",
            step,
            step - 1,
            before.gen,
            f"; changed since: {', '.join(changed)}, re-planned from its cursors" if changed else "",
        )
        return Restored(state_from_json(record["after"]), changed, record)
    if adaptive:
        raise FailedPrecondition(
            f"cannot resume an adaptive mixture at step {step}: the ledger at {where} has no record of step {step - 1}, and the "
            f"weights depend on the training reports it holds; resume with the original run folder's ledger"
        )
    if resume.get("mixture", job.fingerprints["mixture"]) != job.fingerprints["mixture"]:
        raise FailedPrecondition(
            f"cannot resume at step {step} across a mixture change: the ledger at {where} has no record of step {step - 1} "
            f"to restore the sources' positions from; resume with the original run folder's ledger"
        )
    begin = time.perf_counter()
    state = mixture.fast_forward(initial, step)
    log.info("job resumes at step %d without a ledger record: fast-forwarded the mixture in %.3f s", step, time.perf_counter() - begin)
    return Restored(state)


@dataclasses.dataclass(frozen=True)
class AdaptiveRestored:
    """The adaptive mixing state before a step.

    Attributes:
        state: The rule's state.
        applied_through: The last step whose report it holds.
        reports: The reports of the steps after that and before the step (None: never stored,
            counted as missing).
    """

    state: AdaptiveState
    applied_through: int
    reports: dict[int, dict | None]


def restore_adaptive(step: int, *, rule: AdaptiveRule, reader: LedgerReader, changed: tuple[str, ...]) -> AdaptiveRestored:
    """The adaptive mixing state before `step`: from the ledger's record of step - 1 with the
    reports stored since (those never stored count as missing), else the rule's start (also
    when the mixture changed since: only this run's reports count)."""
    record = reader.record(step - 1) if step else None
    saved = record.get("adaptive") if record is not None else None
    if saved is None or "mixture" in changed:
        if step:
            log.info("adaptive mixing starts afresh at step %d from its initial weights", step)
        return AdaptiveRestored(AdaptiveState.initial(rule), step - 1, {})
    applied_through = saved["applied_through"]
    reports: dict[int, dict | None] = {}
    for t in range(applied_through + 1, step):
        stored = reader.report(t)
        reports[t] = None if stored is None else stored["losses"]
    missing = [t for t, losses in reports.items() if losses is None]
    if missing:
        log.warning(
            "adaptive mixing: steps %s before the resume step %d were never reported; their reports count as missing", missing, step
        )
    return AdaptiveRestored(adaptive_from_json(saved["state"]), applied_through, reports)


@dataclasses.dataclass(frozen=True)
class StartPoint:
    """Where planning continues from to reach a step, at a start or a rewind.

    Attributes:
        state: The mixture state to plan from: the state before the step, or before the
            planning window the step lies inside.
        inside: The window the step lies inside and how planning goes on in it
            (`window.resume_inside`); None when the step starts a window.
        changed: Groups of settings that changed since the ledger's generation that planned
            the step before (`Restored.changed`).
        adaptive: The adaptive mixing state before the step; None when the mixture does not
            adapt.
    """

    state: MixtureState
    inside: Resume | None
    changed: tuple[str, ...]
    adaptive: AdaptiveRestored | None


def restore_start(
    step: int,
    *,
    job: JobSettings,
    mixture: Mixture,
    reader: LedgerReader,
    resume: Mapping[str, str],
    rule: AdaptiveRule | None,
    ledger: Ledger,
) -> StartPoint:
    """Where planning continues from to reach `step` (a job's start, a restarted planner's or a
    rewind): the mixture's state (`restore_mixture`), whether `step` lies inside a planning
    window, and the adaptive mixing state (`restore_adaptive`). Continues `ledger`'s consumption
    from the ledger's record of step - 1 (`Ledger.restore`), or from the cursors of a
    fast-forward (`Ledger.assume_consumed`).

    Args:
        step: The step planning must reach.
        job: The job's settings.
        mixture: The job's mixture allocator.
        reader: The durable ledger.
        resume: The settings fingerprints of the checkpoint a trainer resumes from (empty:
            none; a rewind has none).
        rule: The mixture's adaptive rule; None: the mixture does not adapt.
        ledger: This run's in-memory ledger, with nothing recorded yet.
    Returns:
        The state to plan from, the window `step` lies inside, what changed and the adaptive
        state.
    Raises:
        FailedPrecondition: as `restore_mixture`.
    """
    restored = restore_mixture(step, job=job, mixture=mixture, reader=reader, resume=resume, adaptive=rule is not None)
    if restored.record is not None:
        ledger.restore(restored.record)
    elif step:
        ledger.assume_consumed(restored.state.cursors)
    inside = resume_inside(restored.record, step, changed=bool(restored.changed), source_names=job.source_names)
    if inside is not None:
        w = inside.window
        how = "its rest planned as a new window (settings changed)" if w.leftover else "planned again as it was"
        log.info("step %d lies inside the planning window of steps %d..%d: %s", step, w.first, w.first + w.steps - 1, how)
    adaptive = None if rule is None else restore_adaptive(step, rule=rule, reader=reader, changed=restored.changed)
    state = restored.state if inside is None else inside.window.before
    return StartPoint(state, inside, restored.changed, adaptive)


def delivered_floor(reader: LedgerReader) -> int | None:
    """For a planner restarted mid-run: every rank had been handed every step below this, as the
    ledger's latest record says; None when it does not say."""
    last = reader.last_step()
    record = reader.record(last) if last is not None else None
    return None if record is None or "delivered_below" not in record else int(record["delivered_below"])


def rewind_horizon(reader: LedgerReader, step: int, *, adaptive: bool) -> int:
    """The oldest step a rewind can re-plan: where the ledger's earliest generation starts (its
    state is that generation's restore or fast-forward; every later step has the record of the
    step before it), or `step` with an empty ledger. An adaptive mixture needs the record of the
    step before: not the start of a generation that fast-forwarded."""
    starts = {g.start_step for g in reader.generations} | {step}
    if adaptive:
        starts = {s + 1 if s > 0 and reader.record(s - 1) is None else s for s in starts}
    return min(starts)


def new_generation(
    reader: LedgerReader, step: int, *, job: JobSettings, source_facts: Mapping[str, tuple[int, str]] | None = None
) -> LedgerWriter:
    """Opens a new generation of the ledger that plans from `step` on; `source_facts`: what the
    loaders reported of each source (name -> (rows, row groups digest))."""
    return LedgerWriter(
        reader,
        start_step=step,
        fingerprints=job.fingerprints,
        sources=job.source_names,
        keep_detail_steps=job.ledger.keep_detail_steps,
        source_facts=source_facts,
    )


def expected_sources(reader: LedgerReader, *, job: JobSettings) -> dict[str, tuple[int, str]]:
    """What the job's sources were when the newest generation that recorded them started (name
    -> (rows, row groups digest)), for the sources this job still has; empty for a new ledger or
    one whose data settings differ. A restarted planner expects them of its loaders
    (`Membership.expect_sources`)."""
    for g in reversed(reader.generations):
        if g.source_facts:
            if g.fingerprints.get("data") != job.fingerprints["data"]:
                return {}  # another job's data: its sources say nothing of this one's
            return {name: (int(f[0]), str(f[1])) for name, f in g.source_facts.items() if name in job.source_names}
    return {}
