"""Every setting of a job belongs to exactly one resume-fingerprint group
(`config.FINGERPRINT_GROUPS`), and changing it changes exactly that group's fingerprint: a
setting that changes the plan cannot be left out of the fingerprint, and one that does not
(group "none", e.g. `ledger.compare_methods`) cannot make a resume re-plan."""

from __future__ import annotations

import collections
import copy
import dataclasses
import pathlib
import typing
from typing import Any

import pytest

from batchplane.core.config import FINGERPRINT_GROUPS, JobSettings, SECTION_CHECKS, job_from_mapping

MiB = 1 << 20
BASE: dict[str, Any] = {
    "job": "j",
    "sources": [{"name": "web", "path": "data/web"}, {"name": "code", "path": "data/code"}],
    "mesh": {"dp": 2},
    "batch": {"global_batch_size": 16, "microbatches": 2},
}
#: A valid value other than the base job's for every setting ("sources[]." fields: the first source's).
CHANGES: dict[str, Any] = {
    "job": "k",
    "sources[].name": "web2",
    "sources[].path": "elsewhere/web",
    "sources[].token_column": "ids",
    "sources[].transform": "recipes:tokens",
    "sources[].transform_args": {"k": 1},
    "sources[].columns": ["text"],
    "sources[].repeat": 2,
    "sources[].on_change": "restart",
    "seed": 3,
    "epochs": 2,
    "run_dir": "other/run",
    "strategy": "strategy.py",
    "mixture.weights": {"web": 2.0},
    "mixture.schedule": {"kind": "staged", "stages": [{"start": 0, "weights": {"web": 2}}]},
    "mesh.dp": 4,
    "mesh.cp": 2,
    "mesh.tp": 2,
    "mesh.pp": 2,
    "mesh.order": "cp-tp-dp-pp",
    "batch.global_batch_size": 32,
    "batch.microbatches": 4,
    "batch.pad_id": 1,
    "batch.ignore_id": -1,
    "batch.token_dtype": "int32",
    "batch.packing": True,
    "batch.pack_length": 128,
    "batch.max_length": 64,
    "batch.length_policy": "truncate",
    "batch.bad_samples.policy": "skip",
    "batch.bad_samples.max_per_window": 2,
    "batch.payload": [{"name": "pixels", "kind": "blob", "dtype": "uint8", "shape": [4]}],
    "balance.method": "greedy",
    "balance.max_tokens": 64,
    "balance.max_cost": 5.0,
    "balance.window_steps": 1,
    "balance.cost.kind": "linear",
    "balance.cost.linear": 0.5,
    "balance.cost.quadratic": 2.0,
    "loaders.count": 1,
    "loaders.groups": [["web", "code"]],
    "loaders.read_ahead_samples": 8192,
    "loaders.buffer_bytes": MiB,
    "loaders.shuffle.enabled": False,
    "loaders.shuffle.window_row_groups": 8,
    "loaders.shadow": True,
    "loaders.failover.probe_interval_s": 1.0,
    "loaders.failover.failures": 5,
    "constructors.ranks_per_constructor": 2,
    "constructors.prefetch_steps": 3,
    "constructors.fetch_steps": 2,
    "constructors.batch_steps": 3,
    "constructors.cp_slicing": "contiguous",
    "constructors.pp_middle_tensors": ["position_ids"],
    "constructors.pulling_ranks": "megatron",
    "constructors.shm_bytes": 0,
    "network.host": "0.0.0.0",
    "network.tls": False,
    "network.insecure": True,
    "network.max_message_bytes": 8 * MiB,
    "network.rpc_timeout_s": 5.0,
    "network.heartbeat_s": 1.0,
    "ledger.location": "s3://bucket/ledger",
    "ledger.keep_detail_steps": 10,
    "ledger.compare_methods": True,
    "batch.delivery": "journal",
    "journal.location": "s3://bucket/journal",
    "journal.policy": "aimd",
    "journal.producers": 3,
    "journal.max_lag_steps": 64,
    "journal.prefetch_steps": 4,
    "journal.reclaim": False,
    "journal.min_age_s": 300.0,
}


def settings_fields(cls: type, prefix: str = "") -> list[str]:
    """Every public setting of dataclass `cls` as a dotted path; a list of settings objects
    (`sources`) as "name[].field"; other lists and mappings are one setting each."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        hint, path = hints[f.name], prefix + f.name
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if dataclasses.is_dataclass(hint):
            out += settings_fields(hint, path + ".")
        elif typing.get_origin(hint) is tuple and args and dataclasses.is_dataclass(args[0]) and f.name == "sources":
            out += settings_fields(args[0], path + "[].")
        else:
            out.append(path)
    return out


FIELDS = settings_fields(JobSettings)
GROUP_OF = {field: group for group, fields in FINGERPRINT_GROUPS.items() for field in fields}


def test_every_setting_is_in_exactly_one_fingerprint_group() -> None:
    counts = collections.Counter(field for fields in FINGERPRINT_GROUPS.values() for field in fields)
    twice = sorted(f for f, n in counts.items() if n > 1)
    assert twice == [], f"settings listed in more than one group of config.FINGERPRINT_GROUPS: {twice}"
    missing = sorted(set(FIELDS) - set(counts))
    assert missing == [], f"settings in no group of config.FINGERPRINT_GROUPS (add each where it belongs): {missing}"
    unknown = sorted(set(counts) - set(FIELDS))
    assert unknown == [], f"config.FINGERPRINT_GROUPS names settings that do not exist: {unknown}"


def test_the_groups_are_the_fingerprints_groups_and_none() -> None:
    assert set(FINGERPRINT_GROUPS) == set(job_from_mapping(BASE).fingerprints) | {"none"}


def test_every_setting_has_a_change_below() -> None:
    assert sorted(set(FIELDS) ^ set(CHANGES)) == []


def _changed(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    head, _, rest = path.partition("[].")
    if rest:
        node, keys = data[head][0], rest.split(".")
    else:
        node, keys = data, path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return data


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_changing_a_setting_changes_exactly_its_groups_fingerprint(field: str, tmp_path: pathlib.Path) -> None:
    (tmp_path / "strategy.py").write_text("def strategy(mesh):\n    pass\n")
    before = job_from_mapping(BASE, base_dir=tmp_path).fingerprints
    after = job_from_mapping(_changed(BASE, field, CHANGES[field]), base_dir=tmp_path).fingerprints
    changed = {group for group in before if before[group] != after[group]}
    expected = set() if GROUP_OF[field] == "none" else {GROUP_OF[field]}
    assert changed == expected, (
        f"changing {field} changed fingerprint groups {sorted(changed)}; FINGERPRINT_GROUPS puts it in {GROUP_OF[field]!r}"
    )


def test_validation_has_one_check_per_section() -> None:
    hints = typing.get_type_hints(JobSettings)
    sections = {name for name, hint in hints.items() if dataclasses.is_dataclass(hint)} | {"sources"}
    assert {check.__name__ for check in SECTION_CHECKS} == {f"_check_{s}" for s in sections} | {"_check_top_level"}
