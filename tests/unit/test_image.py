"""The container image: one multi-stage Dockerfile for every part, non-root, without torch, its
base image a build argument; the entrypoint picks the part by its first argument. (No container
engine can pull a base image on the test machines, so `make image` is not run here; these
check what the image is built from.)"""

from __future__ import annotations

import pathlib
import re
import tomllib

import pytest

from batchplane import entrypoint

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
INSTRUCTIONS = [line.split(None, 1) for line in re.sub(r"\\\n", " ", DOCKERFILE).splitlines() if line.strip() and not line.startswith("#")]


def _stages() -> list[list[list[str]]]:
    stages: list[list[list[str]]] = []
    for instruction in INSTRUCTIONS:
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def test_the_base_image_is_a_build_argument_of_every_stage() -> None:
    assert INSTRUCTIONS[0][0] == "ARG" and INSTRUCTIONS[0][1].startswith("BASE_IMAGE=")
    froms = [i[1] for i in INSTRUCTIONS if i[0] == "FROM"]
    assert len(froms) >= 2, "multi-stage: build and runtime"
    assert all(f.startswith("${BASE_IMAGE}") for f in froms)


def test_the_runtime_stage_installs_only_the_services_and_runs_as_a_numeric_non_root_user() -> None:
    runtime = _stages()[-1]
    installs = " ".join(i[1] for i in runtime if i[0] == "RUN" and "pip install" in i[1])
    assert '"batchplane[services]"' in installs and "--no-index" in installs
    assert "find_spec('torch') is not None" in installs, "the build fails if torch got in"
    users = [i[1] for i in runtime if i[0] == "USER"]
    assert users == ["${UID}:${UID}"]
    uid = next(i[1] for i in runtime if i[0] == "ARG" and i[1].startswith("UID="))
    assert int(uid.split("=")[1]) >= 1000
    assert not any(i[0] == "COPY" and "--from" not in i[1] for i in runtime), "the runtime stage copies no sources"
    assert next(i[1] for i in runtime if i[0] == "ENTRYPOINT") == '["python", "-m", "batchplane.entrypoint"]'


def test_the_services_extra_has_no_torch_and_the_client_extra_does() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(req.startswith("torch") for req in extras["services"])
    assert any(req.startswith("torch") for req in extras["client"])


def test_the_build_context_holds_only_what_the_image_builds_from() -> None:
    rules = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "*"
    # deploy/wheels: extra wheels (a local CPU build of torch) for the e2e target only.
    assert {r[1:].rstrip("/") for r in rules if r.startswith("!")} == {
        "pyproject.toml",
        "constraints.txt",
        "README.md",
        "proto",
        "services",
        "client",
        "deploy/wheels",
    }
    copied = {p for i in _stages()[0] if i[0] == "COPY" for p in i[1].split()[:-1]}
    assert copied <= {"constraints.txt", "pyproject.toml", "README.md", "proto", "services", "client"}


def test_the_entrypoint_runs_the_named_part(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        entrypoint.main(["loader", "--help"])
    assert exited.value.code == 0
    assert "python -m batchplane.loader" in capsys.readouterr().out


def test_the_entrypoint_without_a_part_says_how_to_use_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert entrypoint.main([]) == 2
    assert "PART one of planner, loader, constructor, operator" in capsys.readouterr().err


def test_any_other_first_argument_is_a_batchplane_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        entrypoint.main(["bench", "--help"])
    assert "balance" in capsys.readouterr().out
