"""A part the constructor depends on killed with SIGKILL and not restarted: once the prefetched
batches are used up, the trainer's next batch raises DataPlaneUnavailable within the client's
timeout, and the message names the part that is gone and its address."""

from __future__ import annotations

import pathlib

import pytest
from disturbed import kill
from harness import running_cluster, skewed_lengths, write_job, write_source

from batchplane.client import Client
from batchplane.client.errors import DataPlaneUnavailable

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("part", ["loader", "planner"])
def test_the_trainer_is_told_which_part_is_gone(tmp_path: pathlib.Path, part: str) -> None:
    source = write_source(tmp_path / "data", "a", skewed_lengths(400, seed=0), row_group_size=20)
    config = write_job(
        tmp_path / "job.yaml",
        [source],
        mesh={"dp": 1},
        batch={"global_batch_size": 4, "microbatches": 1, "token_dtype": "int32"},
        constructors={"prefetch_steps": 1},
        network={"rpc_timeout_s": 1.0},
    )
    with running_cluster(config) as cluster:
        victim = cluster.loaders[0] if part == "loader" else cluster.planner
        with Client(cluster.constructors[0].address, rank=0, timeout_s=5.0) as client:
            batches = iter(client)
            for _ in range(2):
                next(batches)
            kill(victim)
            with pytest.raises(DataPlaneUnavailable) as raised:
                # the steps held, then the one that cannot be built: the constructor holds at most
                # the plans of 2 x fetch_steps steps past the one asked (8 by default), and builds
                # prefetch_steps past the last of the steps a call carries (at most 8)
                for _ in range(1 + 2 * 8 + 8 + 2):
                    next(batches)
    assert f"{part} at {victim.address}" in str(raised.value)
