"""The folder of a constructor's trainer socket: made with mode 2770 before the server binds,
shared by the pod's constructors, and refused when every user may enter it."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from batchplane.constructor.server import prepare_socket_folder
from batchplane.core.errors import ConfigError


def test_the_folder_is_made_for_the_group_only(tmp_path) -> None:
    prepare_socket_folder(f"unix://{tmp_path}/run/socket/constructor.sock")
    assert stat.S_IMODE((tmp_path / "run" / "socket").stat().st_mode) == 0o2770


def test_the_constructors_of_a_pod_make_it_at_once_without_failing(tmp_path) -> None:
    errors: list[BaseException] = []

    def make(i: int) -> None:
        try:
            prepare_socket_folder(f"unix://{tmp_path}/socket/constructor-{i}.sock")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_folder_every_user_may_enter_is_refused_naming_the_flag(tmp_path) -> None:
    shared = tmp_path / "emptydir"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match="--listen: the socket folder .* lets every user in"):
        prepare_socket_folder(f"unix://{shared}/constructor.sock")
