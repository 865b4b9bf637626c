"""`python -m batchplane.constructor -c job.yaml --index I --planner HOST:PORT`: one constructor."""

import sys

from batchplane.constructor.server import start_constructor
from batchplane.core.process import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service("constructor", argv, start_constructor)


if __name__ == "__main__":
    sys.exit(main())
