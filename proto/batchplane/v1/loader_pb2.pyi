from batchplane.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetSummaryRequest(_message.Message):
    __slots__ = ("source", "from_seq", "planned_seq", "max_samples", "wait_ms", "routes", "planned_steps", "delivered_below", "follow")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    PLANNED_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    PLANNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_BELOW_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    source: int
    from_seq: int
    planned_seq: int
    max_samples: int
    wait_ms: int
    routes: _containers.RepeatedCompositeFieldContainer[_common_pb2.Route]
    planned_steps: int
    delivered_below: int
    follow: bool
    def __init__(self, source: _Optional[int] = ..., from_seq: _Optional[int] = ..., planned_seq: _Optional[int] = ..., max_samples: _Optional[int] = ..., wait_ms: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[_common_pb2.Route, _Mapping]]] = ..., planned_steps: _Optional[int] = ..., delivered_below: _Optional[int] = ..., follow: bool = ...) -> None: ...

class GetSummaryResponse(_message.Message):
    __slots__ = ("start_seq", "row", "length", "end_of_stream", "features", "bad_reason", "digest")
    class FeaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Array
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...
    START_SEQ_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    END_OF_STREAM_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    BAD_REASON_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    start_seq: int
    row: _common_pb2.Array
    length: _common_pb2.Array
    end_of_stream: bool
    features: _containers.MessageMap[str, _common_pb2.Array]
    bad_reason: _common_pb2.Array
    digest: _common_pb2.Array
    def __init__(self, start_seq: _Optional[int] = ..., row: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., length: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., end_of_stream: bool = ..., features: _Optional[_Mapping[str, _common_pb2.Array]] = ..., bad_reason: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., digest: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...

class FetchSamplesRequest(_message.Message):
    __slots__ = ("constructor_index", "step", "samples", "release_below_step", "copies", "following")
    CONSTRUCTOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_BELOW_STEP_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    constructor_index: int
    step: int
    samples: _common_pb2.SampleSet
    release_below_step: int
    copies: _common_pb2.Array
    following: _containers.RepeatedCompositeFieldContainer[StepSamples]
    def __init__(self, constructor_index: _Optional[int] = ..., step: _Optional[int] = ..., samples: _Optional[_Union[_common_pb2.SampleSet, _Mapping]] = ..., release_below_step: _Optional[int] = ..., copies: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., following: _Optional[_Iterable[_Union[StepSamples, _Mapping]]] = ...) -> None: ...

class StepSamples(_message.Message):
    __slots__ = ("step", "samples", "copies")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    step: int
    samples: _common_pb2.SampleSet
    copies: _common_pb2.Array
    def __init__(self, step: _Optional[int] = ..., samples: _Optional[_Union[_common_pb2.SampleSet, _Mapping]] = ..., copies: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...

class FetchHeader(_message.Message):
    __slots__ = ("num_samples", "payload_bytes", "following_served")
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOLLOWING_SERVED_FIELD_NUMBER: _ClassVar[int]
    num_samples: int
    payload_bytes: int
    following_served: int
    def __init__(self, num_samples: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., following_served: _Optional[int] = ...) -> None: ...

class FetchSamplesResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: FetchHeader
    chunk: _common_pb2.Chunk
    def __init__(self, header: _Optional[_Union[FetchHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...
