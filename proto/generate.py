"""Generates the Python code of the wire contract from proto/batchplane/v1/*.proto.

`make proto` runs it in place; tests/unit/test_proto_fresh.py runs it into a temporary folder
and fails when the committed code differs, so the generated code never goes stale.

Usage: python proto/generate.py [--out DIR]   (default: next to the .proto files)
"""

from __future__ import annotations

import argparse
import pathlib
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
PACKAGE = "batchplane/v1"


def proto_files() -> list[pathlib.Path]:
    """The contract's .proto files, sorted."""
    return sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto file below `out_dir`.

    Returns:
        The generated files, sorted.
    Raises:
        RuntimeError: when protoc reports an error.
    """
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    # protoc resolves the relative .proto paths against -I; run from the root so they match.
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return sorted((out_dir / PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
