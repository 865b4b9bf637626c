from batchplane.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterLoaderRequest(_message.Message):
    __slots__ = ("loader_index", "address", "sources", "replica", "incarnation", "shadow_of")
    LOADER_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SHADOW_OF_FIELD_NUMBER: _ClassVar[int]
    loader_index: int
    address: str
    sources: _containers.RepeatedCompositeFieldContainer[_common_pb2.SourceInfo]
    replica: str
    incarnation: str
    shadow_of: str
    def __init__(self, loader_index: _Optional[int] = ..., address: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[_common_pb2.SourceInfo, _Mapping]]] = ..., replica: _Optional[str] = ..., incarnation: _Optional[str] = ..., shadow_of: _Optional[str] = ...) -> None: ...

class DeregisterLoaderRequest(_message.Message):
    __slots__ = ("loader_index", "replica")
    LOADER_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    loader_index: int
    replica: str
    def __init__(self, loader_index: _Optional[int] = ..., replica: _Optional[str] = ...) -> None: ...

class DeregisterLoaderResponse(_message.Message):
    __slots__ = ("drain_through",)
    DRAIN_THROUGH_FIELD_NUMBER: _ClassVar[int]
    drain_through: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, drain_through: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterLoaderResponse(_message.Message):
    __slots__ = ("job", "restore", "shadow")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.JobInfo
    restore: _containers.RepeatedCompositeFieldContainer[SourceRestore]
    shadow: bool
    def __init__(self, job: _Optional[_Union[_common_pb2.JobInfo, _Mapping]] = ..., restore: _Optional[_Iterable[_Union[SourceRestore, _Mapping]]] = ..., shadow: bool = ...) -> None: ...

class SourceRestore(_message.Message):
    __slots__ = ("source", "from_seq", "through_seq", "routes", "planned_seq", "planned_steps", "delivered_below")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    THROUGH_SEQ_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    PLANNED_SEQ_FIELD_NUMBER: _ClassVar[int]
    PLANNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_BELOW_FIELD_NUMBER: _ClassVar[int]
    source: int
    from_seq: int
    through_seq: int
    routes: _containers.RepeatedCompositeFieldContainer[_common_pb2.Route]
    planned_seq: int
    planned_steps: int
    delivered_below: int
    def __init__(self, source: _Optional[int] = ..., from_seq: _Optional[int] = ..., through_seq: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[_common_pb2.Route, _Mapping]]] = ..., planned_seq: _Optional[int] = ..., planned_steps: _Optional[int] = ..., delivered_below: _Optional[int] = ...) -> None: ...

class RegisterConstructorRequest(_message.Message):
    __slots__ = ("constructor_index", "address", "ranks", "rejoin", "next_step")
    CONSTRUCTOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    constructor_index: int
    address: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    rejoin: bool
    next_step: int
    def __init__(self, constructor_index: _Optional[int] = ..., address: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., rejoin: bool = ..., next_step: _Optional[int] = ...) -> None: ...

class RegisterConstructorResponse(_message.Message):
    __slots__ = ("job", "resume_step", "oldest_step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    OLDEST_STEP_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.JobInfo
    resume_step: int
    oldest_step: int
    def __init__(self, job: _Optional[_Union[_common_pb2.JobInfo, _Mapping]] = ..., resume_step: _Optional[int] = ..., oldest_step: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("wait_ms",)
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    wait_ms: int
    def __init__(self, wait_ms: _Optional[int] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job", "ready", "length")
    JOB_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.JobInfo
    ready: bool
    length: _common_pb2.JobLength
    def __init__(self, job: _Optional[_Union[_common_pb2.JobInfo, _Mapping]] = ..., ready: bool = ..., length: _Optional[_Union[_common_pb2.JobLength, _Mapping]] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("constructor_index", "step", "wait_ms", "resume", "delivered_below", "rewind", "max_steps", "altered")
    class ResumeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONSTRUCTOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_BELOW_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    ALTERED_FIELD_NUMBER: _ClassVar[int]
    constructor_index: int
    step: int
    wait_ms: int
    resume: _containers.ScalarMap[str, str]
    delivered_below: int
    rewind: bool
    max_steps: int
    altered: _containers.RepeatedCompositeFieldContainer[AlteredSamples]
    def __init__(self, constructor_index: _Optional[int] = ..., step: _Optional[int] = ..., wait_ms: _Optional[int] = ..., resume: _Optional[_Mapping[str, str]] = ..., delivered_below: _Optional[int] = ..., rewind: bool = ..., max_steps: _Optional[int] = ..., altered: _Optional[_Iterable[_Union[AlteredSamples, _Mapping]]] = ...) -> None: ...

class AlteredSamples(_message.Message):
    __slots__ = ("loader_address", "source", "seq", "step", "count")
    LOADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    loader_address: str
    source: int
    seq: int
    step: int
    count: int
    def __init__(self, loader_address: _Optional[str] = ..., source: _Optional[int] = ..., seq: _Optional[int] = ..., step: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class RankPlan(_message.Message):
    __slots__ = ("dp_rank", "samples", "microbatch_offsets", "fetchers", "loaders", "copies")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    FETCHERS_FIELD_NUMBER: _ClassVar[int]
    LOADERS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    samples: _common_pb2.SampleSet
    microbatch_offsets: _common_pb2.Array
    fetchers: int
    loaders: _common_pb2.Array
    copies: _common_pb2.Array
    def __init__(self, dp_rank: _Optional[int] = ..., samples: _Optional[_Union[_common_pb2.SampleSet, _Mapping]] = ..., microbatch_offsets: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., fetchers: _Optional[int] = ..., loaders: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., copies: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...

class SubPlanPart(_message.Message):
    __slots__ = ("name", "axis", "metadata", "bucket", "samples", "values", "columns", "loaders", "copies")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AXIS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    LOADERS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    axis: str
    metadata: str
    bucket: int
    samples: _common_pb2.SampleSet
    values: _common_pb2.Array
    columns: _containers.RepeatedScalarFieldContainer[str]
    loaders: _common_pb2.Array
    copies: _common_pb2.Array
    def __init__(self, name: _Optional[str] = ..., axis: _Optional[str] = ..., metadata: _Optional[str] = ..., bucket: _Optional[int] = ..., samples: _Optional[_Union[_common_pb2.SampleSet, _Mapping]] = ..., values: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., columns: _Optional[_Iterable[str]] = ..., loaders: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., copies: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("step", "end_of_data", "ranks", "global_loss_tokens", "axis", "subplans", "loader_addresses", "oldest_step", "following")
    STEP_FIELD_NUMBER: _ClassVar[int]
    END_OF_DATA_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AXIS_FIELD_NUMBER: _ClassVar[int]
    SUBPLANS_FIELD_NUMBER: _ClassVar[int]
    LOADER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_STEP_FIELD_NUMBER: _ClassVar[int]
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    step: int
    end_of_data: bool
    ranks: _containers.RepeatedCompositeFieldContainer[RankPlan]
    global_loss_tokens: int
    axis: str
    subplans: _containers.RepeatedCompositeFieldContainer[SubPlanPart]
    loader_addresses: _containers.RepeatedScalarFieldContainer[str]
    oldest_step: int
    following: _containers.RepeatedCompositeFieldContainer[GetPlanResponse]
    def __init__(self, step: _Optional[int] = ..., end_of_data: bool = ..., ranks: _Optional[_Iterable[_Union[RankPlan, _Mapping]]] = ..., global_loss_tokens: _Optional[int] = ..., axis: _Optional[str] = ..., subplans: _Optional[_Iterable[_Union[SubPlanPart, _Mapping]]] = ..., loader_addresses: _Optional[_Iterable[str]] = ..., oldest_step: _Optional[int] = ..., following: _Optional[_Iterable[_Union[GetPlanResponse, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SourceStatus(_message.Message):
    __slots__ = ("name", "target_weight", "samples", "tokens", "bad_samples", "target_samples", "configured_samples")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TARGET_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    name: str
    target_weight: float
    samples: int
    tokens: int
    bad_samples: int
    target_samples: float
    configured_samples: float
    def __init__(self, name: _Optional[str] = ..., target_weight: _Optional[float] = ..., samples: _Optional[int] = ..., tokens: _Optional[int] = ..., bad_samples: _Optional[int] = ..., target_samples: _Optional[float] = ..., configured_samples: _Optional[float] = ...) -> None: ...

class BalanceFigure(_message.Message):
    __slots__ = ("method", "mean_max_over_min", "mean_max_over_mean")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MEAN_MAX_OVER_MIN_FIELD_NUMBER: _ClassVar[int]
    MEAN_MAX_OVER_MEAN_FIELD_NUMBER: _ClassVar[int]
    method: str
    mean_max_over_min: float
    mean_max_over_mean: float
    def __init__(self, method: _Optional[str] = ..., mean_max_over_min: _Optional[float] = ..., mean_max_over_mean: _Optional[float] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("job", "steps_planned", "end_step", "finished", "sources", "balance")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEPS_PLANNED_FIELD_NUMBER: _ClassVar[int]
    END_STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.JobInfo
    steps_planned: int
    end_step: int
    finished: bool
    sources: _containers.RepeatedCompositeFieldContainer[SourceStatus]
    balance: _containers.RepeatedCompositeFieldContainer[BalanceFigure]
    def __init__(self, job: _Optional[_Union[_common_pb2.JobInfo, _Mapping]] = ..., steps_planned: _Optional[int] = ..., end_step: _Optional[int] = ..., finished: bool = ..., sources: _Optional[_Iterable[_Union[SourceStatus, _Mapping]]] = ..., balance: _Optional[_Iterable[_Union[BalanceFigure, _Mapping]]] = ...) -> None: ...
