"""Which constructor a trainer pod runs: its index, worked out from what the controller that made
the pod tells it, so the constructor sidecar works under any kind of training job.

Pure: no I/O and no environment of its own; the caller passes the environment. A trainer pod's
constructor serves the global ranks [index * ranksPerPod, (index + 1) * ranksPerPod), so its
index must be the pod's node rank as the trainer's launcher (torchrun) sees it. The chart's
sidecar (`batchplane.constructorSidecar`) fills the variables below from the downward API
(`FIELD_PATHS`: the pod's name, labels and annotations); `resolve_index` reads them for one
index source:

| source | index | set by |
| --- | --- | --- |
| `indexed-job` | the completion index | an Indexed Job: annotation batch.kubernetes.io/job-completion-index (also a Kubeflow TrainJob, whose PET_NODE_RANK is that index, and a JobSet of one Job) |
| `env:NAME` | the integer in variable NAME | whatever sets NAME in the sidecar's environment |
| `pod-ordinal` | the trailing -N of the pod's name | a StatefulSet (pod `<set>-N`), a Volcano job of one task (`<job>-<task>-N`), a PyTorchJob without Master (`<job>-worker-N`) |
| `kubeflow` | 0 for the Master, replica index + 1 for a Worker | a Kubeflow PyTorchJob (kubeflow.org/v1) with a Master: labels training.kubeflow.org/replica-type and replica-index; the training operator's RANK |
| `jobset` | job index x pods per Job + completion index | a JobSet (jobset.x-k8s.io) whose trainer pods are one replicated Job: labels jobset.sigs.k8s.io/job-index and replicatedjob-replicas, and the trainer pod count (BATCHPLANE_TRAINER_PODS), which gives the pods per Job |
| `leaderworkerset` | group index x group size + worker index | a LeaderWorkerSet (leaderworkerset.x-k8s.io): labels leaderworkerset.sigs.k8s.io/group-index and worker-index, annotation leaderworkerset.sigs.k8s.io/size |

The downward API gives an empty string for a label or annotation the pod does not have; every
source refuses an empty or missing variable with `PodRankError`, naming the source, the variable
and where it comes from, instead of starting a constructor with the wrong index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from batchplane.core.errors import ConfigError

#: Variables the chart sets in the sidecar (and the trainer) from the downward API, and their
#: fieldPath. BATCHPLANE_TRAINER_PODS is a plain value (the chart's trainer pod count).
POD_NAME = "BATCHPLANE_POD_NAME"
COMPLETION_INDEX = "BATCHPLANE_COMPLETION_INDEX"
KUBEFLOW_REPLICA_TYPE = "BATCHPLANE_KUBEFLOW_REPLICA_TYPE"
KUBEFLOW_REPLICA_INDEX = "BATCHPLANE_KUBEFLOW_REPLICA_INDEX"
JOBSET_JOB_INDEX = "BATCHPLANE_JOBSET_JOB_INDEX"
JOBSET_REPLICAS = "BATCHPLANE_JOBSET_REPLICAS"
LWS_GROUP_INDEX = "BATCHPLANE_LWS_GROUP_INDEX"
LWS_WORKER_INDEX = "BATCHPLANE_LWS_WORKER_INDEX"
LWS_SIZE = "BATCHPLANE_LWS_SIZE"
TRAINER_PODS = "BATCHPLANE_TRAINER_PODS"

FIELD_PATHS: Mapping[str, str] = {
    POD_NAME: "metadata.name",
    COMPLETION_INDEX: "metadata.annotations['batch.kubernetes.io/job-completion-index']",
    KUBEFLOW_REPLICA_TYPE: "metadata.labels['training.kubeflow.org/replica-type']",
    KUBEFLOW_REPLICA_INDEX: "metadata.labels['training.kubeflow.org/replica-index']",
    JOBSET_JOB_INDEX: "metadata.labels['jobset.sigs.k8s.io/job-index']",
    JOBSET_REPLICAS: "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']",
    LWS_GROUP_INDEX: "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']",
    LWS_WORKER_INDEX: "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']",
    LWS_SIZE: "metadata.annotations['leaderworkerset.sigs.k8s.io/size']",
}

#: The index sources with a fixed name, and the variables each reads (`env:NAME` reads NAME).
SOURCES: Mapping[str, tuple[str, ...]] = {
    "indexed-job": (COMPLETION_INDEX,),
    "pod-ordinal": (POD_NAME,),
    "kubeflow": (KUBEFLOW_REPLICA_TYPE, KUBEFLOW_REPLICA_INDEX),
    "jobset": (JOBSET_JOB_INDEX, JOBSET_REPLICAS, COMPLETION_INDEX, TRAINER_PODS),
    "leaderworkerset": (LWS_GROUP_INDEX, LWS_WORKER_INDEX, LWS_SIZE),
}
#: The prefix of an index source that reads one environment variable.
ENV_PREFIX = "env:"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ORDINAL = re.compile(r".*-(\d+)")
_WHERE = {
    POD_NAME: "the pod's name",
    COMPLETION_INDEX: "annotation batch.kubernetes.io/job-completion-index, which only an Indexed Job's pods have",
    KUBEFLOW_REPLICA_TYPE: "label training.kubeflow.org/replica-type, which the Kubeflow training operator puts on PyTorchJob pods",
    KUBEFLOW_REPLICA_INDEX: "label training.kubeflow.org/replica-index, which the Kubeflow training operator puts on PyTorchJob pods",
    JOBSET_JOB_INDEX: "label jobset.sigs.k8s.io/job-index, which the JobSet controller puts on its pods",
    JOBSET_REPLICAS: "label jobset.sigs.k8s.io/replicatedjob-replicas, which the JobSet controller puts on its pods",
    LWS_GROUP_INDEX: "label leaderworkerset.sigs.k8s.io/group-index, which the LeaderWorkerSet controller puts on its pods",
    LWS_WORKER_INDEX: "label leaderworkerset.sigs.k8s.io/worker-index, which the LeaderWorkerSet controller puts on its pods",
    LWS_SIZE: "annotation leaderworkerset.sigs.k8s.io/size, which the LeaderWorkerSet controller puts on its pods",
    TRAINER_PODS: "the chart's trainer pod count (batchplane.constructorSidecar sets it)",
}


class PodRankError(ConfigError):
    """The index source cannot give this pod's index: a variable is missing or malformed, or the
    pod is not of the kind the source reads.

    Attributes:
        source: The index source, e.g. "jobset".
        variable: The environment variable at fault (None: not one variable).
    """

    def __init__(self, source: str, variable: str | None, problem: str, value: object) -> None:
        self.source = source
        self.variable = variable
        super().__init__(f"--index-from {source}" + (f": {variable}" if variable else ""), problem, value)


def check_source(source: str) -> str:
    """`source` if it names an index source ("indexed-job", "env:NAME", ...).

    Raises:
        PodRankError: an unknown source or a bad variable name.
    """
    if source.startswith(ENV_PREFIX):
        if not _ENV_NAME.fullmatch(source[len(ENV_PREFIX) :]):
            raise PodRankError(source, None, "must be env:NAME with NAME an environment variable name", source)
        return source
    if source not in SOURCES:
        known = ", ".join([*SOURCES, ENV_PREFIX + "NAME"])
        raise PodRankError(source, None, f"is not an index source (known: {known})", source)
    return source


def variables(source: str) -> tuple[str, ...]:
    """The environment variables `source` reads."""
    check_source(source)
    if source.startswith(ENV_PREFIX):
        return (source[len(ENV_PREFIX) :],)
    return SOURCES[source]


def resolve_index(source: str, environ: Mapping[str, str]) -> int:
    """This pod's constructor index, as `source` reads it from `environ`.

    Args:
        source: An index source: "indexed-job", "env:NAME", "pod-ordinal", "kubeflow", "jobset"
            or "leaderworkerset".
        environ: The environment (the sidecar's os.environ).
    Returns:
        The index, >= 0.
    Raises:
        PodRankError: a variable the source needs is missing, empty or malformed, or the pod is
            not of the kind the source reads; the message names the source and the variable.
    """
    check_source(source)
    if source.startswith(ENV_PREFIX):
        return _integer(source, source[len(ENV_PREFIX) :], environ)
    if source == "indexed-job":
        return _integer(source, COMPLETION_INDEX, environ)
    if source == "pod-ordinal":
        name = _text(source, POD_NAME, environ)
        match = _ORDINAL.fullmatch(name)
        if match is None:
            raise PodRankError(source, POD_NAME, "must end in -N (a StatefulSet's or a Volcano job's pod)", name)
        return int(match.group(1))
    if source == "kubeflow":
        kind = _text(source, KUBEFLOW_REPLICA_TYPE, environ).lower()
        index = _integer(source, KUBEFLOW_REPLICA_INDEX, environ)
        if kind == "master":
            if index != 0:
                raise PodRankError(source, KUBEFLOW_REPLICA_INDEX, "must be 0 for the Master (a PyTorchJob has one Master)", index)
            return 0
        if kind == "worker":
            return index + 1  # the Master is node 0, as the training operator's RANK has it
        raise PodRankError(source, KUBEFLOW_REPLICA_TYPE, "must be master or worker (the PyTorchJob replica types that train)", kind)
    if source == "jobset":
        job = _integer(source, JOBSET_JOB_INDEX, environ)
        jobs = _integer(source, JOBSET_REPLICAS, environ, least=1)
        pods = _integer(source, TRAINER_PODS, environ, least=1)
        if pods % jobs:
            raise PodRankError(
                source,
                JOBSET_REPLICAS,
                f"must divide the {pods} trainer pods (the replicated Job holds every trainer pod, the same number per Job)",
                jobs,
            )
        per_job = pods // jobs
        completion = _integer(source, COMPLETION_INDEX, environ) if per_job > 1 or environ.get(COMPLETION_INDEX) else 0
        if completion >= per_job:
            raise PodRankError(source, COMPLETION_INDEX, f"must be < {per_job}, the pods of each of the {jobs} Jobs", completion)
        if job >= jobs:
            raise PodRankError(source, JOBSET_JOB_INDEX, f"must be < {jobs}, the replicated Job's replicas", job)
        return job * per_job + completion
    # leaderworkerset
    group = _integer(source, LWS_GROUP_INDEX, environ)
    worker = _integer(source, LWS_WORKER_INDEX, environ)
    size = _integer(source, LWS_SIZE, environ, least=1)
    if worker >= size:
        raise PodRankError(source, LWS_WORKER_INDEX, f"must be < the group size {size}", worker)
    return group * size + worker


def _text(source: str, variable: str, environ: Mapping[str, str]) -> str:
    value = environ.get(variable)
    if not value:
        where = _WHERE.get(variable, f"the environment variable {variable}")
        state = "is not set" if value is None else "is empty"
        raise PodRankError(source, variable, f"{state} (it comes from {where}: is the pod of the kind --index-from {source} reads?)", value)
    return value


def _integer(source: str, variable: str, environ: Mapping[str, str], *, least: int = 0) -> int:
    text = _text(source, variable, environ).strip()
    if not re.fullmatch(r"\d+", text) or int(text) < least:
        raise PodRankError(source, variable, f"must be an integer >= {least}", text)
    return int(text)
