"""The container image's entrypoint: `PART [ARGS...]` runs one part of the data plane.

    planner -c job.yaml ...       the job's planner       (python -m batchplane.planner)
    loader -c job.yaml --index I  one source loader       (python -m batchplane.loader)
    constructor -c job.yaml ...   one constructor sidecar (python -m batchplane.constructor)
    operator ...                  the Kubernetes operator (python -m batchplane.operator)
    up | profile | partition | ledger | bench ...   any `batchplane` command

One image serves every part; the chart picks the part with the container's args.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

#: Part name -> module whose `main(argv)` runs it.
PARTS = {
    "planner": "batchplane.planner.__main__",
    "loader": "batchplane.loader.__main__",
    "constructor": "batchplane.constructor.__main__",
    "operator": "batchplane.operator.__main__",
}

USAGE = "usage: PART [ARGS...], PART one of " + ", ".join(PARTS) + ", or a batchplane command (batchplane --help)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 0 if args else 2
    part, rest = args[0], args[1:]
    if part in PARTS:
        try:
            module = importlib.import_module(PARTS[part])
        except ModuleNotFoundError as exc:
            if exc.name != PARTS[part] and not PARTS[part].startswith(f"{exc.name}."):
                raise
            print(f"this image has no {part!r}: {exc}", file=sys.stderr)
            return 2
        return module.main(rest)
    from batchplane.cli import main as cli

    return cli(args)


if __name__ == "__main__":
    sys.exit(main())
