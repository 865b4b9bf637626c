"""`python -m batchplane.loader -c job.yaml --index I --planner HOST:PORT`: one source loader."""

import sys

from batchplane.core.process import run_service
from batchplane.loader.server import start_loader


def main(argv: list[str] | None = None) -> int:
    return run_service("loader", argv, start_loader)


if __name__ == "__main__":
    sys.exit(main())
