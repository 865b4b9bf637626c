"""`python -m batchplane`: the `batchplane` command."""

import sys

from batchplane.cli import main

sys.exit(main())
