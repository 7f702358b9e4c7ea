from libra.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GatewayMessage(_message.Message):
    __slots__ = ("seq", "route", "turn", "tool_return", "finish")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    TOOL_RETURN_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    route: RouteRequest
    turn: TurnReport
    tool_return: ToolReturnReport
    finish: FinishReport
    def __init__(self, seq: _Optional[int] = ..., route: _Optional[_Union[RouteRequest, _Mapping]] = ..., turn: _Optional[_Union[TurnReport, _Mapping]] = ..., tool_return: _Optional[_Union[ToolReturnReport, _Mapping]] = ..., finish: _Optional[_Union[FinishReport, _Mapping]] = ...) -> None: ...

class GatewayBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[GatewayMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[GatewayMessage, _Mapping]]] = ...) -> None: ...

class SchedulerBatch(_message.Message):
    __slots__ = ("processed_seq", "answers")
    PROCESSED_SEQ_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    processed_seq: int
    answers: _containers.RepeatedCompositeFieldContainer[SchedulerMessage]
    def __init__(self, processed_seq: _Optional[int] = ..., answers: _Optional[_Iterable[_Union[SchedulerMessage, _Mapping]]] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("seq", "route", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    route: RouteDecision
    error: StreamError
    def __init__(self, seq: _Optional[int] = ..., route: _Optional[_Union[RouteDecision, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("meta", "trajectory_id", "prompt_id", "turn", "prompt_tokens", "max_new_tokens", "exclude_workers")
    META_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    trajectory_id: str
    prompt_id: str
    turn: int
    prompt_tokens: int
    max_new_tokens: int
    exclude_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., trajectory_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., turn: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., exclude_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteDecision(_message.Message):
    __slots__ = ("worker_id", "bucket", "address", "reason", "moved")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    bucket: str
    address: str
    reason: str
    moved: bool
    def __init__(self, worker_id: _Optional[str] = ..., bucket: _Optional[str] = ..., address: _Optional[str] = ..., reason: _Optional[str] = ..., moved: _Optional[bool] = ...) -> None: ...

class TurnReport(_message.Message):
    __slots__ = ("meta", "trajectory_id", "worker_id", "output_tokens", "seconds", "failed")
    META_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    trajectory_id: str
    worker_id: str
    output_tokens: int
    seconds: float
    failed: bool
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., trajectory_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., output_tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., failed: _Optional[bool] = ...) -> None: ...

class ToolReturnReport(_message.Message):
    __slots__ = ("meta", "trajectory_id", "tool", "status", "payload_tokens")
    META_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    trajectory_id: str
    tool: str
    status: _common_pb2.ToolStatus
    payload_tokens: int
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., trajectory_id: _Optional[str] = ..., tool: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.ToolStatus, str]] = ..., payload_tokens: _Optional[int] = ...) -> None: ...

class FinishReport(_message.Message):
    __slots__ = ("meta", "trajectory_id", "prompt_id", "output_tokens", "status")
    META_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    trajectory_id: str
    prompt_id: str
    output_tokens: int
    status: _common_pb2.TrajectoryStatus
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., trajectory_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., output_tokens: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.TrajectoryStatus, str]] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("meta", "worker")
    META_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    worker: _common_pb2.WorkerInfo
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("meta", "worker_id")
    META_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    worker_id: str
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class BucketStats(_message.Message):
    __slots__ = ("bucket", "workers", "outstanding_tokens", "outstanding_requests", "routed", "moves_in", "moves_out")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    MOVES_IN_FIELD_NUMBER: _ClassVar[int]
    MOVES_OUT_FIELD_NUMBER: _ClassVar[int]
    bucket: str
    workers: int
    outstanding_tokens: int
    outstanding_requests: int
    routed: int
    moves_in: int
    moves_out: int
    def __init__(self, bucket: _Optional[str] = ..., workers: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., outstanding_requests: _Optional[int] = ..., routed: _Optional[int] = ..., moves_in: _Optional[int] = ..., moves_out: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("policy", "buckets", "workers", "reasons", "active_trajectories")
    class ReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    buckets: _containers.RepeatedCompositeFieldContainer[BucketStats]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerInfo]
    reasons: _containers.ScalarMap[str, int]
    active_trajectories: int
    def __init__(self, policy: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[BucketStats, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[_common_pb2.WorkerInfo, _Mapping]]] = ..., reasons: _Optional[_Mapping[str, int]] = ..., active_trajectories: _Optional[int] = ...) -> None: ...
