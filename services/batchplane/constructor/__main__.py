"""`python -m batchplane.constructor -c job.yaml --index I --planner HOST:PORT`: one constructor.

In a trainer pod the index comes from the pod instead: `--index-from SOURCE` (instead of
--index) works it out from the environment the chart's sidecar fills from the downward API
(`batchplane.core.pod_rank`: indexed-job, env:NAME, pod-ordinal, kubeflow, jobset,
leaderworkerset), and `--publish-index PATH` writes it to PATH before the constructor starts, for
the trainer container of the same pod (the sidecar's startup probe holds the trainer back until
the constructor serves, so the file is there when the trainer starts).

With journal delivery (`batch.delivery: journal`) a constructor takes one of two roles:
`--produce --index I --planner HOST:PORT` (producer I of `journal.producers`: builds the steps
s with s % producers == I for the whole mesh and commits them to the journal) or `--consume --index I` (pod I's sidecar: serves its trainers
from the journal, without a planner). Both take `--run-dir` (the journal lies in
<run-dir>/journal unless `journal.location` says otherwise).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from collections.abc import Mapping, Sequence

from batchplane.constructor.server import start_constructor, start_consumer, start_producer
from batchplane.core.pod_rank import PodRankError, check_source, resolve_index
from batchplane.core.process import EXIT_BAD_INPUT, run_service


def index_args(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[list[str], int | None, pathlib.Path | None]:
    """`argv` with `--index-from SOURCE` replaced by `--index I`, I the index SOURCE gives in
    `environ`; I (None without --index-from); and the path of `--publish-index`, if given.

    Raises:
        PodRankError: the source cannot give the index (names the source and the variable).
        SystemExit: bad flags (argparse's usage error, exit status 2).
    """
    # allow_abbrev=False: "--index 3" must stay the index, not abbreviate --index-from.
    parser = argparse.ArgumentParser(prog="python -m batchplane.constructor", add_help=False, allow_abbrev=False)
    parser.add_argument("--index-from", type=_source, help="where the pod's index comes from (batchplane.core.pod_rank)")
    parser.add_argument("--publish-index", type=pathlib.Path, help="write the index to this file, for the trainer container")
    known, rest = parser.parse_known_args(list(argv))
    if known.index_from is None:
        if known.publish_index is not None:
            parser.error("--publish-index needs --index-from")
        return rest, None, None
    if any(a == "--index" or a.startswith("--index=") for a in rest):
        parser.error("give --index or --index-from, not both")
    index = resolve_index(known.index_from, environ)
    return [*rest, "--index", str(index)], index, known.publish_index


def role_args(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """`argv` without `--produce` / `--consume`, and the role they give ("produce", "consume",
    or None for a streaming constructor).

    Raises:
        SystemExit: both flags (argparse's usage error, exit status 2).
    """
    parser = argparse.ArgumentParser(prog="python -m batchplane.constructor", add_help=False, allow_abbrev=False)
    roles = parser.add_mutually_exclusive_group()
    roles.add_argument("--produce", action="store_true", help="journal delivery: producer --index I of journal.producers (with --planner)")
    roles.add_argument("--consume", action="store_true", help="journal delivery: pod I's consumer (--index I)")
    known, rest = parser.parse_known_args(list(argv))
    return rest, "produce" if known.produce else "consume" if known.consume else None


def _source(text: str) -> str:
    try:
        return check_source(text)
    except PodRankError as exc:
        raise argparse.ArgumentTypeError(exc.problem) from None


def publish_index(path: pathlib.Path, index: int) -> None:
    """Writes `index` to `path` atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{index}\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    try:
        args, index, publish = index_args(sys.argv[1:] if argv is None else argv, os.environ)
    except PodRankError as exc:
        sys.stderr.write(f"python -m batchplane.constructor: cannot work out the constructor's index: {exc}\n")
        return EXIT_BAD_INPUT
    if publish is not None and index is not None:
        publish_index(publish, index)
    args, role = role_args(args)
    start = start_producer if role == "produce" else start_consumer if role == "consume" else start_constructor
    return run_service("constructor", args, start)


if __name__ == "__main__":
    sys.exit(main())
