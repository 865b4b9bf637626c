"""What every test process shares: one OpenMP thread for torch, in the test process and the
processes it starts (trainers, torchrun's workers), unless OMP_NUM_THREADS says otherwise.

The models the tests train are tiny: a second intra-op thread buys nothing on them, and on a
loaded machine (or beside `make test`'s other pytest-xdist workers) its busy-waiting costs a
multiple of the work itself (the plain-loop step of test_hf_trainer.py: 0.9 s of CPU on one
thread, 34 s on two, on a 2-core machine under load). It is set here, before any test module
imports torch, because OpenMP reads it once, when torch is loaded. torchrun sets the same for
the workers it starts."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
