"""The arithmetic of `batch.max_length` and `batch.length_policy`: which samples are over the
limit, the lengths a loader delivers, the chunks a split sample is laid out as, and the tokens
that carry a loss. Pure numpy; no I/O, no pyarrow, no settings objects.

Every part of the data plane calls this one module, so that they agree token for token:
- the loader cuts (truncate) or rejects (reject) a sample longer than max_length right after
  the source's transform (`limited`, `over_limit`): the lengths it reports, and so the plan, the
  ledger and the loss weights, are the delivered ones;
- under split the sample keeps its full length L everywhere in the plan, and the constructor
  lays it out as ceil(L / max_length) consecutive chunks of at most max_length tokens (`chunks`),
  each its own sequence: positions restart at 0, and each chunk's last token has no label;
- the planner's `StepPlan.loss_tokens` and the constructor's per-microbatch loss tokens both
  count `loss_tokens`: L minus the number of sequences the sample is laid out as.

The functions take the lengths as the loader delivers them: under truncate and reject none
exceeds max_length, so only split makes more than one chunk of a sample; max_length None is no
limit (one chunk per sample, nothing cut).
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: The values of `batch.length_policy`.
POLICIES = ("split", "truncate", "reject")


def check_limit(*, max_length: int | None, policy: str) -> None:
    """Checks a limit and a policy.

    Raises:
        ValueError: an unknown policy or a max_length below 1.
    """
    if policy not in POLICIES:
        raise ValueError(f"length policy must be one of {POLICIES}, got {policy!r}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length!r}")


def splits(*, max_length: int | None, policy: str) -> bool:
    """Whether samples longer than `max_length` are split into chunks (policy "split" with a
    limit).

    Raises:
        ValueError: an unknown policy or max_length < 1.
    """
    check_limit(max_length=max_length, policy=policy)
    return max_length is not None and policy == "split"


def over_limit(lengths: np.ndarray, *, max_length: int | None) -> np.ndarray:
    """bool [n]: which samples are longer than `max_length` (none when it is None)."""
    lengths = np.asarray(lengths)
    if max_length is None:
        return np.zeros(lengths.shape, bool)
    return lengths > max_length


def limited(lengths: np.ndarray, *, max_length: int | None, policy: str) -> np.ndarray:
    """The lengths a loader delivers: truncate cuts a longer sample to max_length, reject makes
    it a bad sample (length 0), split keeps it whole.

    Args:
        lengths: Lengths after the source's transform (0 for a bad sample).
        max_length: The limit, or None for none.
        policy: "split", "truncate" or "reject".
    Returns:
        The delivered lengths, of the input's dtype.
    Raises:
        ValueError: an unknown policy or max_length < 1.
    """
    check_limit(max_length=max_length, policy=policy)
    lengths = np.asarray(lengths)
    if max_length is None or policy == "split":
        return lengths.copy()
    if policy == "truncate":
        return np.minimum(lengths, max_length).astype(lengths.dtype)
    return np.where(lengths > max_length, 0, lengths).astype(lengths.dtype)


def chunk_counts(lengths: np.ndarray, *, max_length: int | None = None, policy: str = "split") -> np.ndarray:
    """int64 [n]: how many sequences each sample is laid out as: ceil(L / max_length) when
    `splits`, else 1 (a sample of length 0 counts as one empty sequence).

    Raises:
        ValueError: an unknown policy or max_length < 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if not splits(max_length=max_length, policy=policy):
        return np.ones(lengths.shape, np.int64)
    return np.maximum(-(-lengths // max_length), 1)


def longest_chunks(lengths: np.ndarray, *, max_length: int | None = None, policy: str = "split") -> np.ndarray:
    """int64 [n]: the longest chunk of each sample, the width its rows need: min(L, max_length)
    when `splits`, else L.

    Raises:
        ValueError: an unknown policy or max_length < 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if not splits(max_length=max_length, policy=policy) or max_length is None:
        return lengths.copy()
    return np.minimum(lengths, max_length)


@dataclasses.dataclass(frozen=True)
class Chunks:
    """Samples cut into the sequences they are laid out as, in order: every sample's chunks
    are consecutive, and their tokens, concatenated, are the sample's.

    Attributes:
        lengths: int64 [C]: tokens of each chunk, at most max_length when splitting.
        sample: int64 [C]: the index of each chunk's sample, non-decreasing.
        start: int64 [C]: where each chunk starts in its sample.
        first: int64 [n]: the index of each sample's first chunk.
    """

    lengths: np.ndarray
    sample: np.ndarray
    start: np.ndarray
    first: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def chunks(lengths: np.ndarray, *, max_length: int | None = None, policy: str = "split") -> Chunks:
    """The chunks of samples of `lengths`: when `splits`, a sample of L tokens becomes
    ceil(L / max_length) chunks, all of max_length tokens but the last; otherwise each sample is
    one chunk of itself.

    Raises:
        ValueError: an unknown policy or max_length < 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = chunk_counts(lengths, max_length=max_length, policy=policy)
    first = np.cumsum(counts) - counts
    sample = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    if not splits(max_length=max_length, policy=policy) or max_length is None:
        return Chunks(lengths.copy(), sample, np.zeros(len(lengths), np.int64), first)
    start = (np.arange(len(sample), dtype=np.int64) - first[sample]) * max_length
    return Chunks(np.minimum(lengths[sample] - start, max_length), sample, start, first)


def chunk_lengths(length: int, *, max_length: int | None = None, policy: str = "split") -> list[int]:
    """The lengths of the chunks one sample of `length` tokens is laid out as (see `chunks`)."""
    return chunks(np.array([length]), max_length=max_length, policy=policy).lengths.tolist()


def loss_tokens(lengths: np.ndarray, *, max_length: int | None = None, policy: str = "split") -> int:
    """Tokens carrying a loss in samples of `lengths`: every token but the last of each of its
    chunks, L - ceil(L / max_length) for a split sample, L - 1 otherwise (0 for L = 0).

    Raises:
        ValueError: an unknown policy or max_length < 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = chunk_counts(lengths, max_length=max_length, policy=policy)
    return int(np.maximum(lengths - counts, 0).sum())
