"""A stand-in trainer that records, for every step of every rank, how long it waited for its
batch and which samples it received: what `batchplane bench chaos` measures a failure by.

    BATCHPLANE_ENDPOINTS=.../endpoints.json python -m batchplane.examples.timed_trainer \
        --ranks 0,1 --step-seconds 0.05 --out steps.jsonl

Ranks run as threads in lockstep (data-parallel ranks all-reduce every step), each spending
`--step-seconds` on its "forward and backward" after receiving its batch. Each line of `--out` is
one rank's step: {"rank", "step", "wait_s", "received" (Unix time), "samples" [[source, row,
epoch], ...]}, written as it happens so a harness can follow the run. With `--counts`, "samples"
is the step's number of samples instead (the bookkeeping of `bench delivery`'s DataLoader ranks,
which it is compared with). With `--parent PID` (the harness's pid) it exits as soon as that
process is gone (a harness killed mid-run), instead of retrying until its deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", required=True, help="comma-separated global ranks, e.g. 0,1")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="compute time per step (default 0.05)")
    parser.add_argument("--timeout", type=float, default=120.0, help="the client's deadline per batch, seconds (default 120)")
    parser.add_argument("--out", required=True, help="file to write one JSON line per rank and step to")
    parser.add_argument("--counts", action="store_true", help="write each step's sample count, not its samples")
    parser.add_argument("--parent", type=int, help="the pid of the process that starts it: exit once that process is gone")
    args = parser.parse_args(argv)
    if args.parent is not None:
        _exit_with_parent(args.parent)
    from batchplane.client import Client  # after the watch: importing torch takes seconds

    ranks = [int(r) for r in args.ranks.split(",")]
    lockstep = threading.Barrier(len(ranks))
    lock = threading.Lock()
    failures: list[BaseException] = []

    with open(args.out, "w") as out:

        def train(rank: int) -> None:
            try:
                with Client(rank=rank, timeout_s=args.timeout) as client:
                    batches = iter(client)
                    while True:
                        begin = time.perf_counter()
                        batch = next(batches, None)
                        waited = time.perf_counter() - begin
                        if batch is None:
                            return
                        samples: int | list[list[int]]
                        if args.counts:
                            samples = sum(len(mb["sample_row"]) for mb in batch["microbatches"])
                        else:
                            samples = [
                                [int(k), int(r), int(e)]
                                for mb in batch["microbatches"]
                                for k, r, e in zip(mb["sample_source"].tolist(), mb["sample_row"].tolist(), mb["sample_epoch"].tolist())
                            ]
                        line = {"rank": rank, "step": batch["step"], "wait_s": waited, "received": time.time(), "samples": samples}
                        with lock:
                            out.write(json.dumps(line) + "\n")
                            out.flush()
                        time.sleep(args.step_seconds)
                        lockstep.wait()
            except BaseException as exc:  # noqa: BLE001 - reported below, after the other ranks stop
                failures.append(exc)
                lockstep.abort()

        threads = [threading.Thread(target=train, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    real = [f for f in failures if not isinstance(f, threading.BrokenBarrierError)]
    if real:
        print(f"timed_trainer: {real[0]}", flush=True)
        return 1
    return 0


def _exit_with_parent(parent: int) -> None:
    """Exits the process (status 1) once `parent` is not its parent (at once if it already is
    not): the harness that started it died, and its ranks would otherwise retry a data plane
    that is gone until their deadline, taking CPU from whatever runs next."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        try:
            print(f"timed_trainer: the process that started it (pid {parent}) is gone; exiting", flush=True)
        except OSError:  # its output went to that process, whose end of the pipe is closed
            pass
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    raise SystemExit(main())
