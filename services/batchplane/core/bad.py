"""Why a sample is bad: the reasons a loader marks a sample as never deliverable (length 0), as
the codes the loaders' summaries carry (`GetSummaryResponse.bad_reason`) and the names metrics,
logs and the ledger use. Pure; no I/O."""

from __future__ import annotations

import numpy as np

#: Reason names by code. Code 0 is a good sample (or, for a sample of length 0, a loader that
#: did not say why: "unknown").
REASONS: tuple[str, ...] = ("unknown", "unreadable", "transform", "rejected", "empty", "too_long")
#: The row group cannot be read or decoded.
UNREADABLE = 1
#: The source's transform failed on the row group.
TRANSFORM = 2
#: The transform returned a null token list for the sample.
REJECTED = 3
#: The sample has no tokens.
EMPTY = 4
#: Longer than batch.max_length under batch.length_policy "reject".
TOO_LONG = 5
#: The dtype of a reason array.
DTYPE = np.uint8


def reason_name(code: int) -> str:
    """The name of a reason code; "unknown" for 0 and for a code this version does not know."""
    return REASONS[code] if 0 <= code < len(REASONS) else "unknown"
