"""Generates the Python code of the wire contract from proto/batchplane/v1/*.proto.

`make proto` runs it in place; tests/unit/test_proto_fresh.py runs it into a temporary folder
and fails when the committed code differs, so the generated code never goes stale.

The generator is pinned, and old on purpose: grpcio-tools 1.62.3 (protoc 25.1). What protoc
writes decides which runtimes can import the contract: code from protoc 26 and later calls
`ValidateProtobufRuntimeVersion` and refuses any protobuf older than the protoc that wrote it
(and grpcio-tools 1.63 and later add the same check for grpcio), so code from today's tools
would force trainer images onto protobuf 7 and grpcio 1.85. Code from protoc 25.1 has no such
gate; it was measured to import and make gRPC round trips on protobuf 3.20.3, 4.21, 4.25, 5.26,
5.29, 6.30, 6.31 and 7.36 (C and pure-Python implementations) with grpcio 1.58 to 1.85, so the
package asks for protobuf>=4.25.1 (the protoc's own release, as protobuf's compatibility policy
wants) and grpcio>=1.62.3 (the generator's). tests/unit/test_dependency_floors.py keeps
pyproject.toml's floors and this generator in step.

grpcio-tools 1.62.3 declares protobuf<5, which the development environment (protobuf 7) cannot
hold, so it lives apart in .tools/grpcio-tools-1.62.3 (`make proto-tools`: pip install
--no-deps --target), where only its protoc is used. It ships wheels for CPython 3.7 to 3.12.

Usage: python proto/generate.py [--out DIR]   (default: next to the .proto files)
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
from types import ModuleType

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
PACKAGE = "batchplane/v1"
#: The grpcio-tools release that generates the committed code.
GENERATOR = "1.62.3"
#: Where `make proto-tools` installs it.
GENERATOR_DIR = PROTO_ROOT.parent / ".tools" / f"grpcio-tools-{GENERATOR}"


def proto_files() -> list[pathlib.Path]:
    """The contract's .proto files, sorted."""
    return sorted((PROTO_ROOT / PACKAGE).glob("*.proto"))


def load_protoc(directory: pathlib.Path = GENERATOR_DIR) -> ModuleType:
    """The pinned generator's `grpc_tools.protoc`, from `directory` and nowhere else.

    Raises:
        RuntimeError: it is not installed there, or another version is.
    """
    found = sorted(directory.glob("grpcio_tools-*.dist-info"))
    if [p.name for p in found] != [f"grpcio_tools-{GENERATOR}.dist-info"]:
        raise RuntimeError(
            f"the generator grpcio-tools=={GENERATOR} is not installed in {directory} (found {[p.name for p in found]}): "
            f"run `make proto-tools`, or `python -m pip install --no-deps --target {directory} grpcio-tools=={GENERATOR}`"
        )
    for name in [m for m in sys.modules if m == "grpc_tools" or m.startswith("grpc_tools.")]:
        del sys.modules[name]  # another grpc_tools (the environment's) must not answer
    sys.path.insert(0, str(directory))
    try:
        protoc = importlib.import_module("grpc_tools.protoc")
    finally:
        sys.path.remove(str(directory))
    if not pathlib.Path(protoc.__file__).resolve().is_relative_to(directory.resolve()):
        raise RuntimeError(f"grpc_tools came from {protoc.__file__}, not from {directory}")
    return protoc


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every .proto file below `out_dir`.

    Returns:
        The generated files, sorted.
    Raises:
        RuntimeError: when the generator is missing or protoc reports an error.
    """
    protoc = load_protoc()
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
    try:
        paths = generate(args.out)
    except RuntimeError as exc:
        print(f"proto/generate.py: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
