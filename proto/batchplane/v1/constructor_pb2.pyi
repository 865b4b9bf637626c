from batchplane.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataWait(_message.Message):
    __slots__ = ("client", "total_s", "waiting_s")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_S_FIELD_NUMBER: _ClassVar[int]
    client: str
    total_s: float
    waiting_s: float
    def __init__(self, client: _Optional[str] = ..., total_s: _Optional[float] = ..., waiting_s: _Optional[float] = ...) -> None: ...

class NoteWaitRequest(_message.Message):
    __slots__ = ("rank", "wait")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    wait: DataWait
    def __init__(self, rank: _Optional[int] = ..., wait: _Optional[_Union[DataWait, _Mapping]] = ...) -> None: ...

class NoteWaitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MarkCheckpointRequest(_message.Message):
    __slots__ = ("rank", "step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class MarkCheckpointResponse(_message.Message):
    __slots__ = ("accepted", "reason", "mark_step", "checkpointed")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MARK_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    mark_step: int
    checkpointed: bool
    def __init__(self, accepted: bool = ..., reason: _Optional[str] = ..., mark_step: _Optional[int] = ..., checkpointed: bool = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("job", "ranks", "max_batch_steps")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_STEPS_FIELD_NUMBER: _ClassVar[int]
    job: _common_pb2.JobInfo
    ranks: _containers.RepeatedScalarFieldContainer[int]
    max_batch_steps: int
    def __init__(self, job: _Optional[_Union[_common_pb2.JobInfo, _Mapping]] = ..., ranks: _Optional[_Iterable[int]] = ..., max_batch_steps: _Optional[int] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("step", "wait_ms", "rank", "resume", "restart", "shm_session", "released_slabs", "journal_cursor", "max_steps", "data_wait")
    class ResumeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SLABS_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    DATA_WAIT_FIELD_NUMBER: _ClassVar[int]
    step: int
    wait_ms: int
    rank: int
    resume: _containers.ScalarMap[str, str]
    restart: bool
    shm_session: str
    released_slabs: _containers.RepeatedScalarFieldContainer[int]
    journal_cursor: JournalCursor
    max_steps: int
    data_wait: DataWait
    def __init__(self, step: _Optional[int] = ..., wait_ms: _Optional[int] = ..., rank: _Optional[int] = ..., resume: _Optional[_Mapping[str, str]] = ..., restart: bool = ..., shm_session: _Optional[str] = ..., released_slabs: _Optional[_Iterable[int]] = ..., journal_cursor: _Optional[_Union[JournalCursor, _Mapping]] = ..., max_steps: _Optional[int] = ..., data_wait: _Optional[_Union[DataWait, _Mapping]] = ...) -> None: ...

class JournalCursor(_message.Message):
    __slots__ = ("manifest_version", "step", "offset")
    MANIFEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    manifest_version: int
    step: int
    offset: int
    def __init__(self, manifest_version: _Optional[int] = ..., step: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class GetLengthRequest(_message.Message):
    __slots__ = ("wait_ms",)
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    wait_ms: int
    def __init__(self, wait_ms: _Optional[int] = ...) -> None: ...

class GetLengthResponse(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: _common_pb2.JobLength
    def __init__(self, length: _Optional[_Union[_common_pb2.JobLength, _Mapping]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class MicrobatchSpec(_message.Message):
    __slots__ = ("tensors", "num_tokens", "loss_tokens", "filler", "loss_weight")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FILLER_FIELD_NUMBER: _ClassVar[int]
    LOSS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_tokens: int
    loss_tokens: int
    filler: bool
    loss_weight: float
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., loss_tokens: _Optional[int] = ..., filler: bool = ..., loss_weight: _Optional[float] = ...) -> None: ...

class SubBatchSpec(_message.Message):
    __slots__ = ("name", "metadata", "tensors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    metadata: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, name: _Optional[str] = ..., metadata: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class BatchHeader(_message.Message):
    __slots__ = ("step", "end_of_data", "dp_rank", "microbatches", "payload_bytes", "global_loss_tokens", "rank", "pp_rank", "cp_rank", "tp_rank", "subbatches", "shm", "journal_cursor", "end_step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    END_OF_DATA_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    SUBBATCHES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    JOURNAL_CURSOR_FIELD_NUMBER: _ClassVar[int]
    END_STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    end_of_data: bool
    dp_rank: int
    microbatches: _containers.RepeatedCompositeFieldContainer[MicrobatchSpec]
    payload_bytes: int
    global_loss_tokens: int
    rank: int
    pp_rank: int
    cp_rank: int
    tp_rank: int
    subbatches: _containers.RepeatedCompositeFieldContainer[SubBatchSpec]
    shm: ShmPlacement
    journal_cursor: JournalCursor
    end_step: int
    def __init__(self, step: _Optional[int] = ..., end_of_data: bool = ..., dp_rank: _Optional[int] = ..., microbatches: _Optional[_Iterable[_Union[MicrobatchSpec, _Mapping]]] = ..., payload_bytes: _Optional[int] = ..., global_loss_tokens: _Optional[int] = ..., rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., cp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., subbatches: _Optional[_Iterable[_Union[SubBatchSpec, _Mapping]]] = ..., shm: _Optional[_Union[ShmPlacement, _Mapping]] = ..., journal_cursor: _Optional[_Union[JournalCursor, _Mapping]] = ..., end_step: _Optional[int] = ...) -> None: ...

class ShmPlacement(_message.Message):
    __slots__ = ("slab", "offset", "length")
    SLAB_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    slab: int
    offset: int
    length: int
    def __init__(self, slab: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: BatchHeader
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[BatchHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...
