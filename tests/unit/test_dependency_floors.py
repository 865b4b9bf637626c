"""The floors pyproject.toml asks of protobuf and grpcio are the ones the generated wire contract
allows, and no higher: a trainer image with an older protobuf or grpcio (5.x and 6.x are common)
can install the client. The generated code decides: protoc 26 and later write a
`ValidateProtobufRuntimeVersion` gate refusing runtimes older than themselves, grpcio-tools 1.63
and later a `GRPC_GENERATED_VERSION` gate. The committed code comes from the pinned generator of
proto/generate.py (protoc 25.1, grpcio-tools 1.62.3), without either gate; the floors are that
protoc's protobuf release and that grpcio-tools release (see proto/generate.py for the runtimes
it was measured on). Regenerating with newer tools without raising the floors fails here."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ROOT / "proto" / "batchplane" / "v1"


def floors() -> dict[str, Version]:
    """The lowest version pyproject.toml's dependencies allow, per distribution."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for text in project["dependencies"]:
        req = Requirement(text)
        lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
        if lows:
            out[req.name] = max(lows)
    return out


def generator() -> str:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GENERATOR


def test_the_protobuf_floor_is_the_generated_codes() -> None:
    stamps, gates = set(), set()
    for path in sorted(GENERATED.glob("*_pb2.py")):
        text = path.read_text()
        stamps |= set(re.findall(r"^# Protobuf Python Version: ([0-9.]+)$", text, re.M))
        gate = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", text)
        if gate:
            gates.add(Version(".".join(gate.groups())))
    assert len(stamps) == 1, stamps  # every module from one protoc
    (stamp,) = stamps
    floor = floors()["protobuf"]
    assert floor == Version(stamp), f"pyproject.toml asks protobuf>={floor}; the generated code is protobuf {stamp}'s"
    assert all(g <= floor for g in gates), f"the generated code refuses protobuf older than {max(gates)}"


def test_the_grpcio_floor_is_the_generators() -> None:
    gates = set()
    for path in sorted(GENERATED.glob("*_pb2_grpc.py")):
        gates |= {Version(v) for v in re.findall(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", path.read_text(), re.M)}
    floor = floors()["grpcio"]
    assert floor == Version(generator()), f"pyproject.toml asks grpcio>={floor}; the generator is grpcio-tools {generator()}"
    assert all(g <= floor for g in gates), f"the generated code refuses grpcio older than {max(gates)}"


def test_the_makefile_installs_the_generator_generate_py_uses() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^PROTO_GENERATOR\s*:=\s*(\S+)$", makefile, re.M).group(1) == generator()
