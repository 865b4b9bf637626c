"""The committed generated code of the wire contract matches its .proto files."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_not_stale(tmp_path: pathlib.Path) -> None:
    """Regenerated with the pinned generator (proto/generate.py; `make proto-tools` installs it),
    the code is byte for byte what is committed."""
    done = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    fresh = sorted((tmp_path / "batchplane" / "v1").glob("*_pb2*.py*"))
    committed = sorted((ROOT / "proto" / "batchplane" / "v1").glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    stale = [p.name for p, q in zip(fresh, committed) if p.read_bytes() != q.read_bytes()]
    assert stale == [], f"run `make proto`: {stale} differ from the .proto files"


def test_every_message_and_field_is_commented() -> None:
    """STYLE.md: every rpc, message and field of the contract carries a comment."""
    missing = []
    for proto in sorted((ROOT / "proto" / "batchplane" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            text = line.strip()
            is_decl = text.startswith(("message ", "rpc ", "service ")) or (
                "=" in text and text.endswith(";") and not text.startswith(("syntax", "package", "option", "//"))
            )
            if is_decl and not lines[i - 1].strip().startswith("//"):
                missing.append(f"{proto.name}:{i + 1}: {text}")
    assert missing == []
