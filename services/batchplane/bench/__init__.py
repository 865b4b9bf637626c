"""Benchmarks: `batchplane bench NAME [--json]`.

Each benchmark is a module of this package with:

- `HELP`: one line for `batchplane bench --help`;
- `add_arguments(parser)`: its own flags;
- `run(args, progress) -> dict`: runs it and returns one JSON-serializable object holding a
  list `records` (one dict per measured configuration) beside whatever describes the run.
  `progress(message)` reports progress on long work (printed to stderr, never to stdout).

Pure of services: benchmarks drive the planning and delivery logic in process; no sockets. The
exceptions are `chaos`, which measures failures of the services themselves, `transport`, which
measures what mutual TLS costs them, and `delivery`, which measures the bytes path into the
trainer's tensors (a constructor server in a child process, a plain gRPC stream) and a job
against colocated DataLoader processes, and `vlm`, which runs a vision-language job against
colocated DataLoader processes decoding the same JPEGs: they run processes and sockets on this
machine.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
from collections.abc import Sequence
from types import ModuleType

#: Benchmark name -> module under batchplane.bench.
BENCHMARKS = {
    "balance": "batchplane.bench.balance",
    "token-budget": "batchplane.bench.token_budget",
    "plan-latency": "batchplane.bench.plan_latency",
    "mixture": "batchplane.bench.mixture",
    "ledger": "batchplane.bench.ledger",
    "chaos": "batchplane.bench.chaos",
    "transport": "batchplane.bench.transport",
    "delivery": "batchplane.bench.delivery",
    "vlm": "batchplane.bench.vlm",
    "journal": "batchplane.bench.journal",
}


def load(name: str) -> ModuleType:
    """The module of benchmark `name`.

    Raises:
        KeyError: no such benchmark.
    """
    return importlib.import_module(BENCHMARKS[name])


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def working_folder(text: str) -> pathlib.Path:
    """An argparse type: a folder for a benchmark's temporary files, made (with its parents)
    where it is missing."""
    folder = pathlib.Path(text)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder {text!r}: {exc.strerror}") from None
    return folder


def add_mesh_arguments(parser: argparse.ArgumentParser, *, dp: Sequence[int], pp: int, contexts: Sequence[int]) -> None:
    """Adds the flags the mesh benchmarks share: --seed, --dp (repeatable), --tp, --pp, --cp and
    --context (repeatable), with these defaults."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    parser.add_argument(
        "--dp",
        action="append",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"data-parallel size (repeatable; default {', '.join(map(str, dp))})",
    )
    parser.add_argument("--tp", type=positive_int, default=4, help="tensor-parallel size (default 4)")
    parser.add_argument("--pp", type=positive_int, default=pp, help=f"pipeline-parallel size (default {pp})")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel size (default 1)")
    parser.add_argument(
        "--context",
        action="append",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help=f"maximum sequence length (repeatable; default {', '.join(map(str, contexts))})",
    )
