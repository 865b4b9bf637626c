"""A trainer pod's constructor index under every kind of training job (batchplane.core.pod_rank),
and the constructor's `--index-from` / `--publish-index` flags that use it: each index source
from the variables the chart's sidecar fills from the downward API, and a clear error naming the
source and the variable when one is missing, empty or malformed."""

from __future__ import annotations

import pathlib

import pytest

from batchplane.constructor.__main__ import index_args, main, publish_index
from batchplane.core import pod_rank
from batchplane.core.pod_rank import PodRankError, check_source, resolve_index, variables
from batchplane.core.process import EXIT_BAD_INPUT, parse_process_args

CASES = [
    # (source, environment, index)
    ("indexed-job", {"BATCHPLANE_COMPLETION_INDEX": "0"}, 0),
    ("indexed-job", {"BATCHPLANE_COMPLETION_INDEX": "7"}, 7),
    ("env:JOB_COMPLETION_INDEX", {"JOB_COMPLETION_INDEX": "3"}, 3),
    ("env:PET_NODE_RANK", {"PET_NODE_RANK": " 12 "}, 12),
    ("pod-ordinal", {"BATCHPLANE_POD_NAME": "trainer-0"}, 0),
    ("pod-ordinal", {"BATCHPLANE_POD_NAME": "llama-70b-trainer-15"}, 15),  # a StatefulSet's pod
    ("pod-ordinal", {"BATCHPLANE_POD_NAME": "run-worker-3"}, 3),  # a PyTorchJob without Master, a Volcano task
    ("kubeflow", {"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "master", "BATCHPLANE_KUBEFLOW_REPLICA_INDEX": "0"}, 0),
    ("kubeflow", {"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "worker", "BATCHPLANE_KUBEFLOW_REPLICA_INDEX": "0"}, 1),
    ("kubeflow", {"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "Worker", "BATCHPLANE_KUBEFLOW_REPLICA_INDEX": "6"}, 7),
    # 8 trainer pods in 2 Jobs of 4: job 1, completion 2 -> 6
    (
        "jobset",
        {
            "BATCHPLANE_JOBSET_JOB_INDEX": "1",
            "BATCHPLANE_JOBSET_REPLICAS": "2",
            "BATCHPLANE_COMPLETION_INDEX": "2",
            "BATCHPLANE_TRAINER_PODS": "8",
        },
        6,
    ),
    (
        "jobset",
        {
            "BATCHPLANE_JOBSET_JOB_INDEX": "0",
            "BATCHPLANE_JOBSET_REPLICAS": "2",
            "BATCHPLANE_COMPLETION_INDEX": "3",
            "BATCHPLANE_TRAINER_PODS": "8",
        },
        3,
    ),
    # one pod per Job: Jobs need not be Indexed, the completion index is 0
    (
        "jobset",
        {
            "BATCHPLANE_JOBSET_JOB_INDEX": "5",
            "BATCHPLANE_JOBSET_REPLICAS": "8",
            "BATCHPLANE_COMPLETION_INDEX": "",
            "BATCHPLANE_TRAINER_PODS": "8",
        },
        5,
    ),
    # one Job of every pod (also a Kubeflow TrainJob's node Job)
    (
        "jobset",
        {
            "BATCHPLANE_JOBSET_JOB_INDEX": "0",
            "BATCHPLANE_JOBSET_REPLICAS": "1",
            "BATCHPLANE_COMPLETION_INDEX": "5",
            "BATCHPLANE_TRAINER_PODS": "8",
        },
        5,
    ),
    ("leaderworkerset", {"BATCHPLANE_LWS_GROUP_INDEX": "0", "BATCHPLANE_LWS_WORKER_INDEX": "0", "BATCHPLANE_LWS_SIZE": "4"}, 0),
    ("leaderworkerset", {"BATCHPLANE_LWS_GROUP_INDEX": "2", "BATCHPLANE_LWS_WORKER_INDEX": "3", "BATCHPLANE_LWS_SIZE": "4"}, 11),
]


@pytest.mark.parametrize(("source", "environ", "index"), CASES, ids=[f"{s}-{i}" for s, _, i in CASES])
def test_every_source_gives_the_index(source: str, environ: dict[str, str], index: int) -> None:
    assert resolve_index(source, environ) == index
    # it reads only the variables it declares: with everything else around, the same answer
    noise = {name: "999" for name in pod_rank.FIELD_PATHS if name not in environ}
    assert resolve_index(source, {**noise, **environ}) == index
    assert set(variables(source)) >= {k for k, v in environ.items() if v}


def test_the_indices_of_a_whole_job_are_its_constructors_each_once() -> None:
    """Every pod of each kind of job, as its controller labels it, gets a distinct index in
    [0, pods): the constructors of the job, each exactly once."""
    pods = 8
    jobset = [
        {
            "BATCHPLANE_JOBSET_JOB_INDEX": str(j),
            "BATCHPLANE_JOBSET_REPLICAS": "4",
            "BATCHPLANE_COMPLETION_INDEX": str(c),
            "BATCHPLANE_TRAINER_PODS": str(pods),
        }
        for j in range(4)
        for c in range(2)
    ]
    kubeflow = [{"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "master", "BATCHPLANE_KUBEFLOW_REPLICA_INDEX": "0"}] + [
        {"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "worker", "BATCHPLANE_KUBEFLOW_REPLICA_INDEX": str(i)} for i in range(pods - 1)
    ]
    lws = [
        {"BATCHPLANE_LWS_GROUP_INDEX": str(g), "BATCHPLANE_LWS_WORKER_INDEX": str(w), "BATCHPLANE_LWS_SIZE": "2"}
        for g in range(4)
        for w in range(2)
    ]
    ordinal = [{"BATCHPLANE_POD_NAME": f"train-{i}"} for i in range(pods)]
    for source, environs in (("jobset", jobset), ("kubeflow", kubeflow), ("leaderworkerset", lws), ("pod-ordinal", ordinal)):
        assert sorted(resolve_index(source, e) for e in environs) == list(range(pods)), source


MISSING = [
    # (source, environment, the variable named, a piece of the message)
    ("indexed-job", {}, "BATCHPLANE_COMPLETION_INDEX", "is not set"),
    ("indexed-job", {"BATCHPLANE_COMPLETION_INDEX": ""}, "BATCHPLANE_COMPLETION_INDEX", "only an Indexed Job's pods have"),
    ("indexed-job", {"BATCHPLANE_COMPLETION_INDEX": "-1"}, "BATCHPLANE_COMPLETION_INDEX", "must be an integer >= 0"),
    ("env:NODE_RANK", {"RANK": "1"}, "NODE_RANK", "is not set"),
    ("env:NODE_RANK", {"NODE_RANK": "one"}, "NODE_RANK", "must be an integer"),
    ("pod-ordinal", {"BATCHPLANE_POD_NAME": "trainer-abcde"}, "BATCHPLANE_POD_NAME", "must end in -N"),
    ("pod-ordinal", {}, "BATCHPLANE_POD_NAME", "is not set"),
    (
        "kubeflow",
        {"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "", "BATCHPLANE_KUBEFLOW_REPLICA_INDEX": ""},
        "BATCHPLANE_KUBEFLOW_REPLICA_TYPE",
        "training.kubeflow.org/replica-type",
    ),
    ("kubeflow", {"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "worker"}, "BATCHPLANE_KUBEFLOW_REPLICA_INDEX", "is not set"),
    (
        "kubeflow",
        {"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "ps", "BATCHPLANE_KUBEFLOW_REPLICA_INDEX": "0"},
        "BATCHPLANE_KUBEFLOW_REPLICA_TYPE",
        "must be master or worker",
    ),
    (
        "kubeflow",
        {"BATCHPLANE_KUBEFLOW_REPLICA_TYPE": "master", "BATCHPLANE_KUBEFLOW_REPLICA_INDEX": "1"},
        "BATCHPLANE_KUBEFLOW_REPLICA_INDEX",
        "must be 0 for the Master",
    ),
    (
        "jobset",
        {"BATCHPLANE_JOBSET_REPLICAS": "2", "BATCHPLANE_COMPLETION_INDEX": "0", "BATCHPLANE_TRAINER_PODS": "4"},
        "BATCHPLANE_JOBSET_JOB_INDEX",
        "jobset.sigs.k8s.io/job-index",
    ),
    (
        "jobset",
        {"BATCHPLANE_JOBSET_JOB_INDEX": "0", "BATCHPLANE_JOBSET_REPLICAS": "2", "BATCHPLANE_COMPLETION_INDEX": "0"},
        "BATCHPLANE_TRAINER_PODS",
        "trainer pod count",
    ),
    (
        "jobset",
        {
            "BATCHPLANE_JOBSET_JOB_INDEX": "0",
            "BATCHPLANE_JOBSET_REPLICAS": "3",
            "BATCHPLANE_COMPLETION_INDEX": "0",
            "BATCHPLANE_TRAINER_PODS": "4",
        },
        "BATCHPLANE_JOBSET_REPLICAS",
        "must divide the 4 trainer pods",
    ),
    (
        "jobset",
        {"BATCHPLANE_JOBSET_JOB_INDEX": "1", "BATCHPLANE_JOBSET_REPLICAS": "2", "BATCHPLANE_TRAINER_PODS": "8"},
        "BATCHPLANE_COMPLETION_INDEX",
        "is not set",
    ),
    (
        "jobset",
        {
            "BATCHPLANE_JOBSET_JOB_INDEX": "1",
            "BATCHPLANE_JOBSET_REPLICAS": "2",
            "BATCHPLANE_COMPLETION_INDEX": "4",
            "BATCHPLANE_TRAINER_PODS": "8",
        },
        "BATCHPLANE_COMPLETION_INDEX",
        "must be < 4",
    ),
    (
        "jobset",
        {
            "BATCHPLANE_JOBSET_JOB_INDEX": "2",
            "BATCHPLANE_JOBSET_REPLICAS": "2",
            "BATCHPLANE_COMPLETION_INDEX": "0",
            "BATCHPLANE_TRAINER_PODS": "8",
        },
        "BATCHPLANE_JOBSET_JOB_INDEX",
        "must be < 2",
    ),
    (
        "leaderworkerset",
        {"BATCHPLANE_LWS_GROUP_INDEX": "0", "BATCHPLANE_LWS_WORKER_INDEX": "1"},
        "BATCHPLANE_LWS_SIZE",
        "leaderworkerset.sigs.k8s.io/size",
    ),
    (
        "leaderworkerset",
        {"BATCHPLANE_LWS_GROUP_INDEX": "0", "BATCHPLANE_LWS_WORKER_INDEX": "4", "BATCHPLANE_LWS_SIZE": "4"},
        "BATCHPLANE_LWS_WORKER_INDEX",
        "must be < the group size 4",
    ),
    (
        "leaderworkerset",
        {"BATCHPLANE_LWS_GROUP_INDEX": "0", "BATCHPLANE_LWS_WORKER_INDEX": "0", "BATCHPLANE_LWS_SIZE": "0"},
        "BATCHPLANE_LWS_SIZE",
        "must be an integer >= 1",
    ),
]


@pytest.mark.parametrize(("source", "environ", "variable", "words"), MISSING, ids=[f"{s}-{v}-{w[:20]}" for s, _, v, w in MISSING])
def test_a_missing_or_bad_variable_is_named_with_the_source(source: str, environ: dict[str, str], variable: str, words: str) -> None:
    with pytest.raises(PodRankError) as info:
        resolve_index(source, environ)
    assert (info.value.source, info.value.variable) == (source, variable)
    message = str(info.value)
    assert message.startswith(f"--index-from {source}: {variable}: ") and words in message, message


@pytest.mark.parametrize("source", ["indexed_job", "rank", "env:", "env:1X", "env:A-B", ""])
def test_an_unknown_source_is_refused(source: str) -> None:
    with pytest.raises(PodRankError, match="index source|env:NAME"):
        check_source(source)


def test_every_variable_the_chart_reads_has_a_field_path() -> None:
    for source, names in pod_rank.SOURCES.items():
        for name in names:
            assert name in pod_rank.FIELD_PATHS or name == pod_rank.TRAINER_PODS, (source, name)
    assert pod_rank.FIELD_PATHS[pod_rank.COMPLETION_INDEX] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"


# ---- the constructor's flags ---------------------------------------------------------------------

BASE = ["-c", "/etc/batchplane/job.yaml", "--planner", "planner:50051", "--listen", "unix:///run/batchplane/constructor.sock"]


def test_index_from_becomes_the_index_the_services_parser_reads(tmp_path: pathlib.Path) -> None:
    env = {"BATCHPLANE_LWS_GROUP_INDEX": "1", "BATCHPLANE_LWS_WORKER_INDEX": "2", "BATCHPLANE_LWS_SIZE": "3"}
    target = tmp_path / "constructor-index"
    args, index, publish = index_args([*BASE, "--index-from", "leaderworkerset", "--publish-index", str(target)], env)
    assert (index, publish) == (5, target)
    settings = parse_process_args("constructor", args)
    assert settings.index == 5 and settings.planner == "planner:50051" and settings.listen == BASE[-1]
    publish_index(target, index)
    assert target.read_text() == "5\n" and not list(tmp_path.glob("*.tmp"))
    # without --index-from the arguments pass through untouched
    assert index_args([*BASE, "--index", "2"], env) == ([*BASE, "--index", "2"], None, None)


@pytest.mark.parametrize(
    "extra",
    [
        ["--index-from", "indexed-job", "--index", "1"],
        ["--index-from", "indexed-job", "--index=1"],
        ["--publish-index", "/tmp/x"],
        ["--index-from", "nope"],
    ],
)
def test_conflicting_or_bad_flags_are_usage_errors(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        index_args([*BASE, *extra], {"BATCHPLANE_COMPLETION_INDEX": "0"})
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_constructor_exits_with_bad_input_naming_the_variable(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod outside a JobSet whose sidecar says --index-from jobset: exit status 2 and a line
    naming the source and the variable, not a crash loop on `--index ''`; nothing published."""
    for name in pod_rank.FIELD_PATHS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BATCHPLANE_JOBSET_JOB_INDEX", "")
    target = tmp_path / "constructor-index"
    code = main([*BASE, "--index-from", "jobset", "--publish-index", str(target)])
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--index-from jobset: BATCHPLANE_JOBSET_JOB_INDEX: is empty" in err and "jobset.sigs.k8s.io/job-index" in err
    assert not target.exists()
