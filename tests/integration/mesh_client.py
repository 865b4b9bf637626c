"""A trainer stand-in run as its own process by the mesh tests: `python mesh_client.py OUT`.

Takes its rank from RANK and WORLD_SIZE (as torchrun sets them) and the constructor from
BATCHPLANE_ENDPOINTS, reads every batch until the end of data and pickles them to OUT as plain
numpy arrays.
"""

from __future__ import annotations

import pickle
import sys

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


if __name__ == "__main__":
    main(sys.argv[1])
