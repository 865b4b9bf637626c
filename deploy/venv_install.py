"""Installs packages into the running interpreter's environment as pip would, through uv.

`make venv` installs some 150 packages. pip resolves and fetches them one after another: on a
2-core build machine 90 s, then 45 s compiling every module's bytecode. uv resolves and fetches
them in parallel: 9 s. uv reads none of pip's configuration, so this hands it pip's own (the
indexes, find-links, constraints and certificate bundle that `pip config list` reports from its
files and PIP_* variables), and lets it pick the best version across all indexes as pip does.
Bytecode is left to the first import (the test command writes it), which compiles only what is
imported. Where uv cannot be installed (an index without it), pip installs everything.

Usage: python deploy/venv_install.py -c constraints.txt -e '.[dev]'
    (the arguments of `pip install`, of those both tools take: requirements, -c, -e, -r)

Standard library only: it runs in a new, empty virtual environment.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

# Of pip's options, those that decide what is installed from where. Later sources win, as in
# pip: the global section, then install's, then PIP_* variables.
_SECTIONS = ("global", "install", ":env:")


def pip_settings(config_list: str) -> dict[str, str]:
    """`pip config list` output (`section.option='value'` lines) -> option -> effective value."""
    found: dict[str, dict[str, str]] = {}
    for line in config_list.splitlines():
        key, sep, value = line.partition("=")
        section, dot, option = key.rpartition(".")
        if not sep or not dot or section not in _SECTIONS:
            continue
        try:
            text = ast.literal_eval(value.strip())
        except (SyntaxError, ValueError):
            text = value.strip()
        found.setdefault(option, {})[section] = str(text)
    return {option: next(by[s] for s in reversed(_SECTIONS) if s in by) for option, by in found.items()}


def _true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """pip's effective settings -> (uv pip install flags, environment variables for uv)."""
    flags = ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best match over every index
    if "index-url" in settings:
        flags += ["--index-url", settings["index-url"].split()[0]]
    for option in ("extra-index-url", "find-links", "constraint"):
        for value in settings.get(option, "").split():
            flags += [f"--{option}", value]
    if _true(settings.get("no-index", "")):
        flags.append("--no-index")
    env = {"SSL_CERT_FILE": settings["cert"]} if settings.get("cert") else {}
    return flags, env


def main(argv: list[str]) -> int:
    python = sys.executable
    uv = pathlib.Path(python).with_name("uv")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    constraints = [a for i, a in enumerate(argv) if i and argv[i - 1] == "-c"]
    if not uv.exists() and subprocess.call([*pip, *(x for c in constraints for x in ("-c", c)), "uv"]) != 0:
        print("venv_install: uv could not be installed; pip installs instead (slower)", file=sys.stderr)
        return subprocess.call([*pip, *argv])
    config = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    flags, env = uv_arguments(pip_settings(config))
    command = [str(uv), "pip", "install", "--quiet", "--python", python, *flags, *argv]
    return subprocess.call(command, env={**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
