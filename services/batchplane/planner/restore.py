"""Where a plan sequence continues from, read from the durable ledger (see `journal`): the
mixture's state before a step (the record of the step before, or a fast-forward where the ledger
lacks it), the adaptive mixing state with the training reports stored since, all of it assembled
for a start or a rewind (`restore_start`), whether the sources are still those the ledger
recorded (`check_sources`, comparing with `source_changes`), the floor a restarted planner
resumes at, the oldest step a rewind can re-plan, and the digests of the samples of the steps
planned again (`recorded_digests`). Reads the ledger; decides nothing about
requests (that is `progress`) and holds no state (that is `book.PlanBook`, which applies what
`restore_start` returns under its lock).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from batchplane.core.config import JobSettings
from batchplane.core.errors import FailedPrecondition
from batchplane.planner.adaptive import AdaptiveRule, AdaptiveState, state_from_json as adaptive_from_json
from batchplane.planner.digests import Identity, digests_of
from batchplane.planner.intervals import IntervalSet
from batchplane.planner.journal import Generation, LedgerReader, LedgerWriter
from batchplane.planner.ledger import Ledger, state_from_json
from batchplane.planner.mixture import Mixture, MixtureState
from batchplane.planner.source_changes import FileFacts, SourceRecord, StartDecision, compare_sources, decide, refusal
from batchplane.planner.window import Resume, Window, resume_inside

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
    restarted: Collection[str] = (),
) -> StartPoint:
    """Where planning continues from to reach `step` (a job's start, a restarted planner's or a
    rewind): the mixture's state (`restore_mixture`), whether `step` lies inside a planning
    window, and the adaptive mixing state (`restore_adaptive`). Continues `ledger`'s consumption
    from the ledger's record of step - 1 (`Ledger.restore`), or from the cursors of a
    fast-forward (`Ledger.assume_consumed`), except for the `restarted` sources: their data
    starts over from its beginning at `step`, as a source the job never read (cursor 0, nothing
    consumed; a planning window `step` lies inside is planned on without their samples).

    Args:
        step: The step planning must reach.
        job: The job's settings.
        mixture: The job's mixture allocator.
        reader: The durable ledger.
        resume: The settings fingerprints of the checkpoint a trainer resumes from (empty:
            none; a rewind has none).
        rule: The mixture's adaptive rule; None: the mixture does not adapt.
        ledger: This run's in-memory ledger, with nothing recorded yet.
        restarted: Names of changed sources that start over (`check_sources`).
    Returns:
        The state to plan from, the window `step` lies inside, what changed and the adaptive
        state.
    Raises:
        FailedPrecondition: as `restore_mixture`.
    """
    restored = restore_mixture(step, job=job, mixture=mixture, reader=reader, resume=resume, adaptive=rule is not None)
    anew = sorted(job.source_names.index(name) for name in restarted)
    if anew:
        restored = dataclasses.replace(restored, state=_started_over(restored.state, anew))
    if restored.record is not None:
        ledger.restore(restored.record)
        for k in anew:
            ledger.consumed[k] = IntervalSet.empty()
    elif step:
        ledger.assume_consumed(restored.state.cursors)
    inside = resume_inside(restored.record, step, changed=bool(restored.changed) or bool(anew), source_names=job.source_names)
    if inside is not None and anew:
        inside = Resume(_window_without(inside.window, anew), inside.step)
    if inside is not None:
        w = inside.window
        why = "settings changed" if restored.changed else "a source started over"
        how = f"its rest planned as a new window ({why})" if w.leftover else "planned again as it was"
        log.info("step %d lies inside the planning window of steps %d..%d: %s", step, w.first, w.first + w.steps - 1, how)
    adaptive = None if rule is None else restore_adaptive(step, rule=rule, reader=reader, changed=restored.changed)
    state = restored.state if inside is None else inside.window.before
    return StartPoint(state, inside, restored.changed, adaptive)


class Sources(Protocol):
    """The sources as the loaders report them (`membership.Membership`)."""

    def reported_sources(self) -> Mapping[str, SourceRecord]: ...

    def commit_sources(self) -> Mapping[str, SourceRecord]: ...


@dataclasses.dataclass(frozen=True)
class Reopened:
    """A start or a rewind: where planning continues from, the ledger's new generation it writes
    to, the changed sources that start over at its step (`check_sources`), and the digests the
    steps planned again are held to (`recorded_digests`)."""

    start: StartPoint
    writer: LedgerWriter
    restarted: tuple[str, ...]
    recorded: Mapping[Identity, int] = dataclasses.field(default_factory=dict)


def reopen(
    step: int,
    *,
    job: JobSettings,
    mixture: Mixture,
    reader: LedgerReader,
    resume: Mapping[str, str],
    rule: AdaptiveRule | None,
    ledger: Ledger,
    sources: Sources,
) -> Reopened:
    """Starts (or rewinds) the job at `step`: checks the sources against what the ledger recorded
    (`check_sources`: a changed source refuses, or starts over where the job declares it),
    restores where planning continues from (`restore_start`) and opens the ledger's new
    generation (`new_generation`, with the sources as the loaders reported them, now final).

    Raises:
        FailedPrecondition: a changed source the job does not declare, or as `restore_start`;
            nothing is written then.
    """
    try:
        restarted = tuple(c.source for c in check_sources(reader, step, job=job, reported=sources.reported_sources()).restarted)
    except FailedPrecondition as exc:
        log.error("%s", exc)
        raise
    start = restore_start(step, job=job, mixture=mixture, reader=reader, resume=resume, rule=rule, ledger=ledger, restarted=restarted)
    recorded = recorded_digests(reader, step, job=job, restarted=restarted)  # before the new generation folds the earlier ones
    writer = new_generation(reader, step, job=job, source_facts=sources.commit_sources(), restarted=restarted)
    return Reopened(start, writer, restarted, recorded)


#: The most samples whose recorded digests a start or a rewind holds the steps it plans again to
#: (`recorded_digests`): about 10 MB of the planner's memory, 256 steps of 256 samples ...
MAX_REPLAY_SAMPLES = 1 << 16
#: ... from at most this many steps' records (thinned ones hold none), read at the start.
MAX_REPLAY_STEPS = 1024


def recorded_digests(reader: LedgerReader, step: int, *, job: JobSettings, restarted: Collection[str] = ()) -> dict[Identity, int]:
    """The digests the ledger recorded of the samples of the steps from `step` on, which a
    start or a rewind at `step` plans again (`digests.held_to`), by sample identity: of the steps
    planned with the job's data settings, without the sources that start over (`restarted`),
    at most MAX_REPLAY_SAMPLES samples of MAX_REPLAY_STEPS steps (those nearest `step`; later
    ones are held to what the loaders summarize)."""
    out: dict[Identity, int] = {}
    for record in reader.records(step, step + MAX_REPLAY_STEPS - 1):
        owner = reader.owner(record["step"])
        if owner is None or owner.fingerprints.get("data") != job.fingerprints["data"]:
            continue
        found = digests_of(record, job.source_names, skip=restarted)
        if len(out) + len(found) > MAX_REPLAY_SAMPLES:
            log.info(
                "steps from %d on are planned again with the digests their loaders summarize (the ledger's of %d samples are held)",
                record["step"],
                len(out),
            )
            break
        out.update(found)
    return out


def _started_over(state: MixtureState, sources: Sequence[int]) -> MixtureState:
    """`state` with the cursors of `sources` back at their streams' beginning."""
    return dataclasses.replace(state, cursors=tuple(0 if k in sources else c for k, c in enumerate(state.cursors)))


def _window_without(window: Window, sources: Sequence[int]) -> Window:
    """The rest of a window cut short by a resume (`window.leftover`) without the samples of
    `sources`, which start over: their range is empty, and the window ends at their beginning."""
    skip = tuple(IntervalSet.empty() if k in sources else s for k, s in enumerate(window.skip))
    return dataclasses.replace(window, before=_started_over(window.before, sources), end=_started_over(window.end, sources), skip=skip)


def recorded_sources(reader: LedgerReader, step: int) -> tuple[Generation, dict[str, SourceRecord]] | None:
    """What the ledger recorded of the sources a start at `step` continues from: the generation
    whose record of step - 1 counts, and each source's facts as they stood in it (its rows and
    row groups as that generation, or the newest before it, recorded them; its files as the
    newest generation up to it that recorded them). None at step 0, without a record of step - 1
    (nothing of the ledger's consumption is carried), or when no generation recorded facts."""
    if step <= 0:
        return None
    owner = reader.owner(step - 1)
    if owner is None:
        return None
    facts = _facts_as_of(reader.generations, owner.gen)
    return (owner, facts) if facts else None


def _facts_as_of(generations: Sequence[Generation], gen: int) -> dict[str, SourceRecord]:
    """Each source's facts as they stood in generation `gen` (see `recorded_sources`)."""
    chain = [g for g in reversed(generations) if g.gen <= gen and g.source_facts]
    out: dict[str, SourceRecord] = {}
    for g in chain:
        for name, entry in g.source_facts.items():
            if name not in out:
                out[name] = SourceRecord.from_json(entry[:2])
    for name in out:
        files = _files_in(chain, name)
        if files is not None:
            out[name] = dataclasses.replace(out[name], files=files)
    return out


def _files_in(chain: Sequence[Generation], name: str) -> tuple[FileFacts, ...] | None:
    """Source `name`'s files as the first generation of `chain` (newest first) that recorded
    them has them; None when none did."""
    for g in chain:
        entry = (g.source_facts or {}).get(name)
        if entry is not None and len(entry) > 2:
            return SourceRecord.from_json(entry).files
    return None


def check_sources(reader: LedgerReader, step: int, *, job: JobSettings, reported: Mapping[str, SourceRecord]) -> StartDecision:
    """Whether a start at `step` may continue the ledger's consumption with the sources as their
    loaders report them: compares them with what the ledger recorded (`recorded_sources`,
    `source_changes.compare_sources`). A changed source restarts where the job declares it
    (`sources[].on_change: restart`), which is logged; any other refuses the start.

    Returns:
        The sources that restart (`StartDecision.restarted`); none when nothing changed, at step
        0, without a record of step - 1, or when the data settings changed since (which
        `restore_mixture` refuses on its own).
    Raises:
        FailedPrecondition: a changed source the job does not declare (the message names each
            source and what differs: `source_changes.refusal`).
    """
    found = recorded_sources(reader, step)
    if found is None:
        return StartDecision()
    owner, recorded = found
    if owner.fingerprints.get("data") != job.fingerprints["data"]:
        return StartDecision()
    decision = decide(compare_sources(recorded, reported), {s.name: s.on_change for s in job.sources})
    since = f"generation {owner.gen} of the ledger at {reader.storage.describe()}"
    if decision.refused:
        fields = {s.name: f"sources[{i}]" for i, s in enumerate(job.sources)}
        raise FailedPrecondition(refusal(decision.refused, step=step, since=since, fields=fields))
    for change in decision.restarted:
        log.warning(
            "source %r changed since %s recorded it (%s); sources[%d].on_change is restart: its data starts over from its "
            "beginning at step %d, nothing of what the job read of it before is carried",
            change.source,
            since,
            "; ".join(change.lines()),
            job.source_names.index(change.source),
            step,
        )
    return decision


def delivered_floor(reader: LedgerReader) -> int | None:
    """For a planner restarted mid-run: every rank had been handed every step below this, as the
    ledger's latest record says; None when it does not say."""
    last = reader.last_step()
    record = reader.record(last) if last is not None else None
    return None if record is None or "delivered_below" not in record else int(record["delivered_below"])


def rewind_horizon(reader: LedgerReader, step: int, *, adaptive: bool, restarted: bool = False) -> int:
    """The oldest step a rewind can re-plan: where the ledger's earliest generation starts (its
    state is that generation's restore or fast-forward; every later step has the record of the
    step before it), or `step` with an empty ledger. An adaptive mixture needs the record of the
    step before: not the start of a generation that fast-forwarded. Never before a step where a
    changed source started over (`restarted`: this start does, at `step`; or a generation of
    the ledger that still counts did): what came before it was planned from data that is gone."""
    if restarted:
        return step
    starts = {g.start_step for g in reader.generations} | {step}
    if adaptive:
        starts = {s + 1 if s > 0 and reader.record(s - 1) is None else s for s in starts}
    gens = reader.generations
    restarts = [
        g.start_step
        for g in gens
        if g.restarted and g.start_step <= step and not any(h.gen > g.gen and h.start_step <= g.start_step for h in gens)
    ]
    return max(min(starts), max(restarts, default=0))


def new_generation(
    reader: LedgerReader,
    step: int,
    *,
    job: JobSettings,
    source_facts: Mapping[str, SourceRecord] | None = None,
    restarted: Sequence[str] = (),
) -> LedgerWriter:
    """Opens a new generation of the ledger that plans from `step` on.

    Args:
        source_facts: What the loaders reported of each source. Its rows and row groups are
            recorded in every generation; its files where the generations before did not
            record these files (the first generation of a run folder, or one after the source
            changed), so heads stay small.
        restarted: Sources whose data starts over from its beginning at `step`.
    """
    recorded = _facts_as_of(reader.generations, reader.generations[-1].gen) if reader.generations else {}
    entries = None
    if source_facts:
        entries = {
            name: facts.to_json(with_files=recorded.get(name, SourceRecord(0, "")).files != facts.files)
            for name, facts in source_facts.items()
        }
    return LedgerWriter(
        reader,
        start_step=step,
        fingerprints=job.fingerprints,
        sources=job.source_names,
        keep_detail_steps=job.ledger.keep_detail_steps,
        source_facts=entries,
        restarted=restarted,
    )


def expected_sources(reader: LedgerReader, *, job: JobSettings) -> dict[str, SourceRecord]:
    """What the job's sources were when the newest generation that recorded them started (name
    -> what identifies its data), for the sources this job still has; empty for a new ledger or
    one whose data settings differ. A restarted planner expects them of its loaders
    (`Membership.expect_sources`)."""
    for g in reversed(reader.generations):
        if g.source_facts:
            if g.fingerprints.get("data") != job.fingerprints["data"]:
                return {}  # another job's data: its sources say nothing of this one's
            return {name: f for name, f in _facts_as_of(reader.generations, g.gen).items() if name in job.source_names}
    return {}
