"""Benchmarks: `batchplane bench NAME [--json]`.

Each benchmark is a module of this package with:

- `HELP`: one line for `batchplane bench --help`;
- `add_arguments(parser)`: its own flags;
- `run(args, progress) -> dict`: runs it and returns one JSON-serializable object holding a
  list `records` (one dict per measured configuration) beside whatever describes the run.
  `progress(message)` reports progress on long work (printed to stderr, never to stdout).

Pure of services: benchmarks drive the planning and delivery logic in process; no sockets.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Benchmark name -> module under batchplane.bench.
BENCHMARKS = {
    "balance": "batchplane.bench.balance",
    "token-budget": "batchplane.bench.token_budget",
    "plan-latency": "batchplane.bench.plan_latency",
}


def load(name: str) -> ModuleType:
    """The module of benchmark `name`.

    Raises:
        KeyError: no such benchmark.
    """
    return importlib.import_module(BENCHMARKS[name])
