"""`python -m batchplane.planner -c job.yaml`: the job's planner."""

import sys

from batchplane.core.process import run_service
from batchplane.planner.server import start_planner


def main(argv: list[str] | None = None) -> int:
    return run_service("planner", argv, start_planner)


if __name__ == "__main__":
    sys.exit(main())
