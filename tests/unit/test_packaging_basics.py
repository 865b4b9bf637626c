"""The basics a package is judged by: `batchplane --version`, the license, and the PEP 561
markers that tell type checkers the client and the services are typed."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from batchplane import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"batchplane {importlib.metadata.version('batchplane')}\n"
    assert importlib.metadata.version("batchplane") == PYPROJECT["project"]["version"]


def test_version_through_the_installed_command() -> None:
    command = pathlib.Path(sys.executable).parent / "batchplane"
    done = subprocess.run([str(command), "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"batchplane {PYPROJECT['project']['version']}\n"), done.stderr


def test_the_license_is_the_apache_license_the_metadata_names() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS AND CONDITIONS" in text
    assert len(text.split()) > 1500  # the whole text, not a pointer to it


@pytest.mark.parametrize("marker", ["services/batchplane/py.typed", "client/batchplane/client/py.typed"])
def test_typed_markers_are_in_the_packages_the_wheel_takes(marker: str) -> None:
    assert (ROOT / marker).is_file()
    wheel = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]
    # hatchling takes every file below the listed package folders (py.typed included) that
    # neither .gitignore nor an exclude pattern leaves out.
    assert any(marker.startswith(package + "/") for package in wheel["packages"])
    assert not wheel.get("exclude") and not wheel.get("only-include")
    ignored = subprocess.run(["git", "check-ignore", "-q", marker], cwd=ROOT, capture_output=True)
    assert ignored.returncode == 1, f"{marker} is git-ignored, so hatchling leaves it out of the wheel"


def test_every_library_the_services_import_is_a_declared_dependency() -> None:
    """A library the services import but only a test extra brings (cryptography came with
    moto) would pass CI and break `pip install batchplane[services]`: each is declared in the
    base dependencies, `services` or the optional `fsspec` extra."""
    root = pathlib.Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["services"], *project["optional-dependencies"]["fsspec"]]
    declared = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}
    providers = importlib.metadata.packages_distributions()
    missing = set()
    # The S3 endpoint of the benchmarks runs moto's application (with werkzeug, both from the
    # dev extra's moto[server]) in a process of its own, started only when moto is installed
    # (`moto_server.available()`); nothing else imports that module's `main`.
    optional = {"services/batchplane/bench/moto_server.py": {"moto", "werkzeug"}}
    for path in (root / "services" / "batchplane").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("batchplane", "__future__"):
                    continue
                if top in optional.get(path.relative_to(root).as_posix(), ()):
                    continue
                dists = {d.lower().replace("_", "-") for d in providers.get(top, [top])}
                if not dists & declared:
                    missing.add(f"{path.relative_to(root)}: {top} ({', '.join(sorted(dists))})")
    assert sorted(missing) == []


def test_python_dash_m_batchplane_is_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "batchplane", "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"batchplane {PYPROJECT['project']['version']}\n"), done.stderr
