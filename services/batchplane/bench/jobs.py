"""What the benchmarks that run whole jobs (`chaos`, `transport`) share: the job file over a
demo dataset, and the stand-in trainer (`batchplane.examples.timed_trainer`) they measure with."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence

import yaml

from batchplane.launcher.local import LocalCluster


def write_job(
    folder: pathlib.Path, name: str, data: dict[str, pathlib.Path], *, ranks: int, batch: int, **sections: object
) -> pathlib.Path:
    """Writes `folder`/job.yaml: one epoch of `data`'s sources (name -> folder) on `ranks`
    data-parallel ranks, `batch` samples a step in 2 microbatches, run folder `folder`/run;
    `sections` add or replace top-level sections (loaders, constructors, network)."""
    folder.mkdir(parents=True)
    config = folder / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "job": name,
                "run_dir": str(folder / "run"),
                "seed": 0,
                "epochs": 1,
                "sources": [{"name": source, "path": str(path)} for source, path in data.items()],
                "mesh": {"dp": ranks},
                "batch": {"global_batch_size": batch, "microbatches": 2},
                **sections,
            }
        )
    )
    return config


def start_trainer(
    cluster: LocalCluster, ranks: Sequence[int], *, step_seconds: float, out: pathlib.Path, counts: bool = False
) -> subprocess.Popen:
    """The stand-in trainer for `ranks` of `cluster`'s job, spending `step_seconds` a step and
    writing one JSON line per rank and step to `out` (`counts`: each step's sample count, not
    its samples). It exits with the process that starts it (a bench killed mid-run)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchplane.examples.timed_trainer",
            "--ranks",
            ",".join(map(str, ranks)),
            "--step-seconds",
            str(step_seconds),
            "--out",
            str(out),
            *(["--counts"] if counts else []),
            "--parent",
            str(os.getpid()),
        ],
        env={**os.environ, "BATCHPLANE_ENDPOINTS": str(cluster.endpoints_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
