from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class SampleSet(_message.Message):
    __slots__ = ("source", "seq", "row", "length", "epoch", "digest")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    source: Array
    seq: Array
    row: Array
    length: Array
    epoch: Array
    digest: Array
    def __init__(self, source: _Optional[_Union[Array, _Mapping]] = ..., seq: _Optional[_Union[Array, _Mapping]] = ..., row: _Optional[_Union[Array, _Mapping]] = ..., length: _Optional[_Union[Array, _Mapping]] = ..., epoch: _Optional[_Union[Array, _Mapping]] = ..., digest: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class SourceInfo(_message.Message):
    __slots__ = ("name", "num_rows", "num_files", "num_row_groups", "row_group_sizes", "files")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_FILES_FIELD_NUMBER: _ClassVar[int]
    NUM_ROW_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ROW_GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    num_files: int
    num_row_groups: int
    row_group_sizes: _containers.RepeatedScalarFieldContainer[int]
    files: _containers.RepeatedCompositeFieldContainer[SourceFile]
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., num_files: _Optional[int] = ..., num_row_groups: _Optional[int] = ..., row_group_sizes: _Optional[_Iterable[int]] = ..., files: _Optional[_Iterable[_Union[SourceFile, _Mapping]]] = ...) -> None: ...

class SourceFile(_message.Message):
    __slots__ = ("name", "size_bytes", "mtime_ns", "rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    mtime_ns: int
    rows: int
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("from_window", "replicas")
    FROM_WINDOW_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    from_window: int
    replicas: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, from_window: _Optional[int] = ..., replicas: _Optional[_Iterable[str]] = ...) -> None: ...

class Mesh(_message.Message):
    __slots__ = ("dp", "cp", "tp", "pp", "order", "cp_slicing", "broadcast_at")
    DP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    CP_SLICING_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_AT_FIELD_NUMBER: _ClassVar[int]
    dp: int
    cp: int
    tp: int
    pp: int
    order: str
    cp_slicing: str
    broadcast_at: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dp: _Optional[int] = ..., cp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., order: _Optional[str] = ..., cp_slicing: _Optional[str] = ..., broadcast_at: _Optional[_Iterable[str]] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "fingerprint", "sources", "mesh", "global_batch_size", "microbatches", "hooks", "fingerprints", "format")
    class FingerprintsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    HOOKS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fingerprint: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    mesh: Mesh
    global_batch_size: int
    microbatches: int
    hooks: Hooks
    fingerprints: _containers.ScalarMap[str, str]
    format: BatchFormat
    def __init__(self, job_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ..., mesh: _Optional[_Union[Mesh, _Mapping]] = ..., global_batch_size: _Optional[int] = ..., microbatches: _Optional[int] = ..., hooks: _Optional[_Union[Hooks, _Mapping]] = ..., fingerprints: _Optional[_Mapping[str, str]] = ..., format: _Optional[_Union[BatchFormat, _Mapping]] = ...) -> None: ...

class BatchFormat(_message.Message):
    __slots__ = ("pad_id", "ignore_id", "labels", "packing", "pack_length", "max_length", "length_policy", "payload")
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    IGNORE_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    PACK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_POLICY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    pad_id: int
    ignore_id: int
    labels: str
    packing: bool
    pack_length: int
    max_length: int
    length_policy: str
    payload: _containers.RepeatedCompositeFieldContainer[PayloadColumn]
    def __init__(self, pad_id: _Optional[int] = ..., ignore_id: _Optional[int] = ..., labels: _Optional[str] = ..., packing: bool = ..., pack_length: _Optional[int] = ..., max_length: _Optional[int] = ..., length_policy: _Optional[str] = ..., payload: _Optional[_Iterable[_Union[PayloadColumn, _Mapping]]] = ...) -> None: ...

class PayloadColumn(_message.Message):
    __slots__ = ("name", "kind", "dtype", "shape", "fill")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    fill: float
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., fill: _Optional[float] = ...) -> None: ...

class JobLength(_message.Message):
    __slots__ = ("num_steps", "infinite", "unknown", "exact")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    INFINITE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    infinite: bool
    unknown: str
    exact: bool
    def __init__(self, num_steps: _Optional[int] = ..., infinite: bool = ..., unknown: _Optional[str] = ..., exact: bool = ...) -> None: ...

class Hooks(_message.Message):
    __slots__ = ("loader_do_plan", "constructor_do_plan")
    LOADER_DO_PLAN_FIELD_NUMBER: _ClassVar[int]
    CONSTRUCTOR_DO_PLAN_FIELD_NUMBER: _ClassVar[int]
    loader_do_plan: str
    constructor_do_plan: str
    def __init__(self, loader_do_plan: _Optional[str] = ..., constructor_do_plan: _Optional[str] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("step", "losses")
    class LossesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    step: int
    losses: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., losses: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: bool = ..., reason: _Optional[str] = ...) -> None: ...
