"""Lineage queries over ledger records: what each rank trained on at a step, which steps saw a
sample, and the realized mixture over a range of steps. Pure; no I/O (`batchplane ledger` reads
the records through `journal.LedgerReader`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Sighting:
    """One delivery of a sample: the step, the bucket (DP rank, or DP x CP consumer) and the
    microbatch it trained in, and the epoch (pass over its source)."""

    step: int
    bucket: int
    microbatch: int
    epoch: int


def is_thinned(record: Mapping[str, Any]) -> bool:
    """True for a record of a thinned segment: it has no per-rank sample lists."""
    return "ranks" not in record


def step_table(record: Mapping[str, Any], sources: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (bucket, microbatch) of a step: its samples as "source:row" (with "@epoch"
    past the first pass) and their count; none for a thinned record."""
    rows = []
    for bucket, microbatches in enumerate(record.get("ranks", ())):
        for m, samples in enumerate(microbatches):
            names = [f"{sources[k]}:{row}" + (f"@{epoch}" if epoch else "") for k, row, epoch in samples]
            rows.append({"bucket": bucket, "microbatch": m, "samples": len(samples), "ids": names})
    return rows


def find(records: Iterable[Mapping[str, Any]], source: int, row: int) -> tuple[list[Sighting], list[int]]:
    """Every delivery of sample `row` of source index `source`, in step order, and the steps
    that cannot tell (thinned records)."""
    seen: list[Sighting] = []
    thinned: list[int] = []
    for record in records:
        if is_thinned(record):
            thinned.append(record["step"])
        for bucket, microbatches in enumerate(record.get("ranks", ())):
            for m, samples in enumerate(microbatches):
                seen.extend(Sighting(record["step"], bucket, m, e) for k, r, e in samples if k == source and r == row)
    return seen, thinned


def substitutions(records: Iterable[Mapping[str, Any]], source: str, row: int) -> list[dict[str, Any]]:
    """The substitutions a sample took part in (`planner.substitute`), in step order: each
    {"step", "source", "bad": [row, epoch], "by": [row, epoch] or None, "reason"} where it is
    the bad sample or the one that stood in for it."""
    out = []
    for record in records:
        for entry in record.get("substituted", ()):
            if entry["source"] == source and (entry["bad"][0] == row or (entry["by"] is not None and entry["by"][0] == row)):
                out.append({"step": record["step"], **entry})
    return out


def realized_mixture(records: Iterable[Mapping[str, Any]], sources: Sequence[str]) -> dict[str, Any]:
    """Per source over the records: target share (the mean of the steps' shares), realized share
    of samples and of tokens, and drift (realized - target share of samples). "samples" counts
    what the mixture allocated to the steps, bad rows included; "delivered" the samples the ranks
    were handed (substitutes included), "bad" the bad rows consumed (left out, or stood in for by
    a substitute).

    Returns:
        {"steps", "first", "last", "samples", "delivered", "bad", "tokens", "sources": [{"source",
        "target", "samples", "delivered", "tokens", "sample_share", "token_share", "drift"}]};
        "delivered" is None where a record is thinned (ledger.keep_detail_steps: its samples per
        rank are not kept).
    """
    k = len(sources)
    samples, delivered, tokens, target = [0] * k, [0] * k, [0] * k, [0.0] * k
    steps, first, last, bad, detailed = 0, None, None, 0, True
    for record in records:
        steps += 1
        first = record["step"] if first is None else first
        last = record["step"]
        bad += record.get("bad", 0)
        detailed = detailed and "ranks" in record
        for sample in (s for bucket in record.get("ranks", ()) for mb in bucket for s in mb):
            delivered[sample[0]] += 1
        for i, name in enumerate(sources):
            samples[i] += step_samples(record, name)
            tokens[i] += record["tokens"].get(name, 0)
            target[i] += record["shares"][i]
    total, total_tokens = sum(samples) or 1, sum(tokens) or 1
    rows = [
        {
            "source": name,
            "target": target[i] / max(steps, 1),
            "samples": samples[i],
            "delivered": delivered[i] if detailed else None,
            "tokens": tokens[i],
            "sample_share": samples[i] / total,
            "token_share": tokens[i] / total_tokens,
            "drift": samples[i] / total - target[i] / max(steps, 1),
        }
        for i, name in enumerate(sources)
    ]
    return {
        "steps": steps,
        "first": first,
        "last": last,
        "samples": sum(samples),
        "delivered": sum(delivered) if detailed else None,
        "bad": bad,
        "tokens": sum(tokens),
        "sources": rows,
    }


def step_samples(record: Mapping[str, Any], source: str) -> int:
    """Samples (bad ones included) a step consumed of `source`: those of its "samples" intervals
    when it belongs to a planning window (its samples may come from anywhere in the window),
    else what the mixture allocated to it ("take")."""
    if "samples" in record:
        return sum(hi - lo for lo, hi in record["samples"].get(source, ()))
    return record["take"].get(source, [0, 0])[1]


def parse_sample(text: str, sources: Sequence[str]) -> tuple[int, int]:
    """ "SOURCE:INDEX" as (source index, row).

    Raises:
        ValueError: not of that form, an unknown source, or a negative index; names the text.
    """
    name, sep, index = text.rpartition(":")
    if not sep or not name:
        raise ValueError(f"{text!r}: expected SOURCE:INDEX, e.g. {sources[0] if sources else 'web'}:123")
    if name not in sources:
        raise ValueError(f"{text!r}: no source {name!r}; sources are {', '.join(sources)}")
    if not index.isdigit():
        raise ValueError(f"{text!r}: INDEX must be a row number >= 0")
    return list(sources).index(name), int(index)
