"""Trainer stand-ins for the mesh tests, one process per rank: `python mesh_client.py DIR WORLD`
imports the client (and torch) once, then forks WORLD processes, each given its RANK and
WORLD_SIZE in its environment (as torchrun sets them) before it makes its `Client()`, which finds
the constructor through BATCHPLANE_ENDPOINTS. Each reads every batch until the end of data and
pickles them to DIR/rank<r>.pkl as plain numpy arrays; its errors go to DIR/rank<r>.err. Exits 0
once every rank did, else 1 with the failed ranks' errors on stderr.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import sys
import traceback

from batchplane.client import Client


def main(out: str) -> None:
    batches = []
    with Client(timeout_s=60) as client:
        for batch in client:
            batches.append(
                {
                    **{
                        k: batch[k]
                        for k in ("step", "rank", "dp_rank", "cp_rank", "tp_rank", "pp_rank", "loss_weight", "global_loss_tokens")
                    },
                    "microbatches": [
                        {k: (v.numpy().copy() if hasattr(v, "numpy") else v) for k, v in mb.items()} for mb in batch["microbatches"]
                    ],
                    "subbatches": {name: {k: v.numpy().copy() for k, v in t.items()} for name, t in batch["subbatches"].items()},
                }
            )
    with open(out, "wb") as f:
        pickle.dump(batches, f)


def run_ranks(folder: pathlib.Path, world: int) -> int:
    """Forks one process per rank (nothing has started a thread yet) and waits for them all."""
    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with open(folder / f"rank{rank}.err", "w") as err:
                    os.dup2(err.fileno(), 2)
                os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
                main(str(folder / f"rank{rank}.pkl"))
                code = 0
            except BaseException:  # noqa: BLE001 - reported through the rank's error file
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    failed = []
    for pid, rank in children.items():
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(rank)
    for rank in failed:
        print(f"client of rank {rank} failed:\n{(folder / f'rank{rank}.err').read_text()}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_ranks(pathlib.Path(sys.argv[1]), int(sys.argv[2])))
