"""The rules of training reports for adaptive mixing (`planner.bounds`): what a report may hold
(`check_report_request`), whether one is taken against the one that stands on the ledger
(`report_taken`, after `report_refusal`), and when the configured delay makes planning wait for
reports (`report_delay_warning`). `PlanBook.report` checks, writes durably, and applies what these
say; tests/unit/test_planner_request_bounds.py drives it through the servicer. Pure."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings, strategies as st

from batchplane.core.errors import InvalidArgument
from batchplane.planner.adaptive import AdaptiveRule
from batchplane.planner.bounds import ReportRefusal, check_report_request, report_delay_warning, report_refusal, report_taken

RULE = AdaptiveRule(source_names=("a", "b"), initial=(1.0, 1.0), delay_steps=4)
LOSS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**6))
LOSSES = st.dictionaries(st.sampled_from(["a", "b", "x"]), LOSS, max_size=3)


def _fine(losses: dict) -> bool:
    return all(n in RULE.source_names and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for n, v in losses.items())


@settings(max_examples=300, deadline=None)
@given(step=st.integers(-(10**6), 10**15), losses=LOSSES)
def test_a_report_is_refused_for_a_negative_step_an_unknown_source_or_a_bad_loss_and_else_read_as_floats(step: int, losses: dict) -> None:
    if step >= 0 and _fine(losses):
        checked = check_report_request(step, losses, rule=RULE)
        assert checked == losses and all(type(v) is float for v in checked.values())
        return
    with pytest.raises(InvalidArgument) as raised:
        check_report_request(step, losses, rule=RULE)
    assert str(raised.value).startswith("report: step must be >= 0" if step < 0 else f"report of step {step}: ")


@pytest.mark.parametrize(
    ("step", "losses", "message"),
    [
        (-1, {"a": 1.0}, "report: step must be >= 0, got -1"),
        (3, {"x": 1.0}, "report of step 3: 'x' names no source; sources are a, b, got 1.0"),
        (3, {"b": -0.5}, "report of step 3: the loss of source 'b' must be a finite number >= 0, got -0.5"),
        (3, {"a": float("nan")}, "report of step 3: the loss of source 'a' must be a finite number >= 0, got nan"),
    ],
)
def test_a_refused_report_names_the_field_and_the_value(step: int, losses: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{re.escape(message)}$"):
        check_report_request(step, losses, rule=RULE)


REFUSALS = st.one_of(st.none(), st.builds(ReportRefusal, st.sampled_from(["past", "not planned yet"]), st.booleans()))


@settings(max_examples=300, deadline=None)
@given(step=st.integers(0, 100), losses=st.dictionaries(st.sampled_from("ab"), st.floats(0, 9)), refusal=REFUSALS, stored=st.integers(0, 2))
def test_a_report_is_taken_when_it_is_the_one_that_stands_and_not_refused_or_a_retry_of_an_applied_one(
    step: int, losses: dict, refusal: ReportRefusal | None, stored: int
) -> None:
    """stored: 0, no report on the ledger; 1, this one; 2, one with other losses."""
    standing = [None, {"losses": dict(losses)}, {"losses": {**losses, "c": 1.0}}][stored]
    taken, reason = report_taken(step, losses, refusal=refusal, stored=standing)
    assert taken == (stored == 1 and (refusal is None or refusal.applied))
    assert (reason == "") == taken
    if refusal is not None and not taken:
        assert reason == refusal.reason
    if refusal is None and not taken:
        assert reason == f"step {step} was already reported with other losses; the first report stands"


@settings(max_examples=300, deadline=None)
@given(
    step=st.integers(0, 50),
    start=st.integers(0, 20),
    applied_through=st.integers(-1, 40),
    ahead=st.integers(1, 10),
    first=st.floats(0, 9),
    again=st.floats(0, 9),
)
def test_at_most_one_report_stands_per_step_and_only_a_planned_step_not_yet_past_takes_one(
    step: int, start: int, applied_through: int, ahead: int, first: float, again: float
) -> None:
    """A run of the report rules as `PlanBook.report` runs them over a ledger (a step's first
    report stands): the first report of a step is taken exactly when the step is planned and
    not past; a second one is taken only when it repeats the one that stands."""
    handed_below = max(start, applied_through + 1) + ahead
    ledger: dict[int, dict] = {}

    def report(losses: dict) -> bool:
        checked = check_report_request(step, losses, rule=RULE)
        refusal = report_refusal(step, start=start, applied_through=applied_through, handed_below=handed_below)
        if refusal is None:
            stored = ledger.setdefault(step, {"losses": checked})
        else:
            stored = ledger.get(step) if refusal.applied else None
        return report_taken(step, checked, refusal=refusal, stored=stored)[0]

    open_ = start <= step < handed_below and step > applied_through
    assert report({"a": first}) == open_
    assert report({"a": again}) == (open_ and again == first)
    assert len(ledger) == (1 if open_ else 0)


@pytest.mark.parametrize(("delay", "prefetch"), [(1, 2), (3, 2), (4, 2), (8, 2), (3, 1), (2, 1)])
def test_a_delay_shorter_than_the_planning_window_is_warned_of(delay: int, prefetch: int) -> None:
    rule = AdaptiveRule(source_names=("a",), initial=(1.0,), delay_steps=delay)
    warning = report_delay_warning(rule, prefetch_steps=prefetch)
    if delay >= prefetch + 2:
        assert warning is None
    else:
        assert warning == (
            f"mixture.schedule.adaptive.delay_steps = {delay} is less than constructors.prefetch_steps + 2 = {prefetch + 2}: "
            "planning will wait for training reports and the trainer for its batches"
        )
    assert report_delay_warning(None, prefetch_steps=prefetch) is None
