"""deploy/venv_install.py: pip's configuration, as pip itself reports it, handed to uv.

The settings are read from the real `pip config list` (a configuration file and PIP_* variables
made here, over whatever this machine configures), so a change of pip's output format fails this
test rather than a machine's install.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("venv_install", ROOT / "deploy" / "venv_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


venv_install = _load()


def pip_config_list(tmp_path: pathlib.Path, config: str, **variables: str) -> str:
    path = tmp_path / "pip.conf"
    path.write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(path), **variables)
    return subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, capture_output=True, text=True, check=True).stdout


def test_variables_win_over_the_install_section_which_wins_over_global(tmp_path) -> None:
    listed = pip_config_list(
        tmp_path,
        "[global]\nfind-links = /g\nindex-url = https://global.example/simple\ncert = /etc/g.pem\n"
        "[install]\nindex-url = https://install.example/simple\n",
        PIP_FIND_LINKS="/from/env",
    )
    settings = venv_install.pip_settings(listed)
    assert settings["find-links"] == "/from/env"
    assert settings["index-url"] == "https://install.example/simple"
    assert settings["cert"] == "/etc/g.pem"


def test_every_index_find_links_and_constraint_reaches_uv_and_the_bundle_its_environment(tmp_path) -> None:
    listed = pip_config_list(
        tmp_path,
        "[global]\nextra-index-url = file:///a/simple file:///b/simple\nconstraint = /etc/cap.txt\n",
        PIP_FIND_LINKS="/wheels /more-wheels",
        PIP_CERT="/etc/ca.pem",
    )
    flags, env = venv_install.uv_arguments(venv_install.pip_settings(listed))
    pairs = list(zip(flags[::2], flags[1::2]))
    assert pairs == [
        ("--index-strategy", "unsafe-best-match"),
        ("--extra-index-url", "file:///a/simple"),
        ("--extra-index-url", "file:///b/simple"),
        ("--find-links", "/wheels"),
        ("--find-links", "/more-wheels"),
        ("--constraint", "/etc/cap.txt"),
    ]
    assert env == {"SSL_CERT_FILE": "/etc/ca.pem"}


def test_no_index_is_kept_and_nothing_configured_adds_only_the_index_strategy(tmp_path) -> None:
    assert venv_install.uv_arguments(venv_install.pip_settings("")) == (["--index-strategy", "unsafe-best-match"], {})
    flags, _ = venv_install.uv_arguments(venv_install.pip_settings(pip_config_list(tmp_path, "", PIP_NO_INDEX="1")))
    assert flags[-1] == "--no-index"
    flags, _ = venv_install.uv_arguments(venv_install.pip_settings(pip_config_list(tmp_path, "[global]\nno-index = false\n")))
    assert "--no-index" not in flags
