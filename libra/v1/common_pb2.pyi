from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_UNHEALTHY: _ClassVar[WorkerState]

class TrajectoryStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAJECTORY_STATUS_UNSPECIFIED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_QUEUED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_RUNNING: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_COMPLETED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_FAILED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_CONSUMED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_REJECTED: _ClassVar[TrajectoryStatus]

class ToolStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_STATUS_UNSPECIFIED: _ClassVar[ToolStatus]
    TOOL_STATUS_SUCCESS: _ClassVar[ToolStatus]
    TOOL_STATUS_FAILURE: _ClassVar[ToolStatus]
    TOOL_STATUS_TIMEOUT: _ClassVar[ToolStatus]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_UNHEALTHY: WorkerState
TRAJECTORY_STATUS_UNSPECIFIED: TrajectoryStatus
TRAJECTORY_STATUS_QUEUED: TrajectoryStatus
TRAJECTORY_STATUS_RUNNING: TrajectoryStatus
TRAJECTORY_STATUS_COMPLETED: TrajectoryStatus
TRAJECTORY_STATUS_FAILED: TrajectoryStatus
TRAJECTORY_STATUS_CONSUMED: TrajectoryStatus
TRAJECTORY_STATUS_REJECTED: TrajectoryStatus
TOOL_STATUS_UNSPECIFIED: ToolStatus
TOOL_STATUS_SUCCESS: ToolStatus
TOOL_STATUS_FAILURE: ToolStatus
TOOL_STATUS_TIMEOUT: ToolStatus

class RequestMeta(_message.Message):
    __slots__ = ("request_id", "run_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    run_id: str
    def __init__(self, request_id: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("applied", "detail")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    detail: str
    def __init__(self, applied: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class BucketSpec(_message.Message):
    __slots__ = ("name", "tp", "max_tokens", "replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tp: int
    max_tokens: int
    replicas: int
    def __init__(self, name: _Optional[str] = ..., tp: _Optional[int] = ..., max_tokens: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class TrainingLayout(_message.Message):
    __slots__ = ("gpus", "tp", "pp", "dp", "micro_batch")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    gpus: int
    tp: int
    pp: int
    dp: int
    micro_batch: int
    def __init__(self, gpus: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., dp: _Optional[int] = ..., micro_batch: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("generation", "training", "buckets", "source", "reason", "predicted_step_seconds", "created_at")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    training: TrainingLayout
    buckets: _containers.RepeatedCompositeFieldContainer[BucketSpec]
    source: str
    reason: str
    predicted_step_seconds: float
    created_at: float
    def __init__(self, generation: _Optional[int] = ..., training: _Optional[_Union[TrainingLayout, _Mapping]] = ..., buckets: _Optional[_Iterable[_Union[BucketSpec, _Mapping]]] = ..., source: _Optional[str] = ..., reason: _Optional[str] = ..., predicted_step_seconds: _Optional[float] = ..., created_at: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "bucket", "address", "tp", "state", "policy_version", "outstanding_tokens", "outstanding_requests", "engine")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    bucket: str
    address: str
    tp: int
    state: WorkerState
    policy_version: int
    outstanding_tokens: int
    outstanding_requests: int
    engine: str
    def __init__(self, worker_id: _Optional[str] = ..., bucket: _Optional[str] = ..., address: _Optional[str] = ..., tp: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., policy_version: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., outstanding_requests: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class ToolEvent(_message.Message):
    __slots__ = ("turn", "tool", "status", "payload_tokens", "seconds")
    TURN_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    turn: int
    tool: str
    status: ToolStatus
    payload_tokens: int
    seconds: float
    def __init__(self, turn: _Optional[int] = ..., tool: _Optional[str] = ..., status: _Optional[_Union[ToolStatus, str]] = ..., payload_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "prompt_id", "group_id", "sample_index", "status", "prompt_length", "token_ids", "loss_mask", "logprobs", "versions", "tool_events", "reward", "turns", "finish_reason", "started_at", "finished_at", "error")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOOL_EVENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    prompt_id: str
    group_id: str
    sample_index: int
    status: TrajectoryStatus
    prompt_length: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    tool_events: _containers.RepeatedCompositeFieldContainer[ToolEvent]
    reward: float
    turns: int
    finish_reason: str
    started_at: float
    finished_at: float
    error: str
    def __init__(self, trajectory_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., status: _Optional[_Union[TrajectoryStatus, str]] = ..., prompt_length: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., tool_events: _Optional[_Iterable[_Union[ToolEvent, _Mapping]]] = ..., reward: _Optional[float] = ..., turns: _Optional[int] = ..., finish_reason: _Optional[str] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class HistoryRecord(_message.Message):
    __slots__ = ("kind", "timestamp", "bucket", "prompt_tokens", "output_tokens", "seconds", "queue_depth", "step", "train_seconds", "rollout_seconds", "rejected_rollouts", "sequences", "active_rollouts", "tp", "batch", "prompt_lengths", "output_lengths", "overhead_seconds", "gap_seconds", "trajectory_id", "turn_number", "worker_id", "route_seconds", "engine_batch")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_NUMBER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BATCH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    timestamp: float
    bucket: str
    prompt_tokens: int
    output_tokens: int
    seconds: float
    queue_depth: int
    step: int
    train_seconds: float
    rollout_seconds: float
    rejected_rollouts: int
    sequences: int
    active_rollouts: int
    tp: int
    batch: int
    prompt_lengths: _containers.RepeatedScalarFieldContainer[int]
    output_lengths: _containers.RepeatedScalarFieldContainer[int]
    overhead_seconds: float
    gap_seconds: float
    trajectory_id: str
    turn_number: int
    worker_id: str
    route_seconds: float
    engine_batch: float
    def __init__(self, kind: _Optional[str] = ..., timestamp: _Optional[float] = ..., bucket: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., queue_depth: _Optional[int] = ..., step: _Optional[int] = ..., train_seconds: _Optional[float] = ..., rollout_seconds: _Optional[float] = ..., rejected_rollouts: _Optional[int] = ..., sequences: _Optional[int] = ..., active_rollouts: _Optional[int] = ..., tp: _Optional[int] = ..., batch: _Optional[int] = ..., prompt_lengths: _Optional[_Iterable[int]] = ..., output_lengths: _Optional[_Iterable[int]] = ..., overhead_seconds: _Optional[float] = ..., gap_seconds: _Optional[float] = ..., trajectory_id: _Optional[str] = ..., turn_number: _Optional[int] = ..., worker_id: _Optional[str] = ..., route_seconds: _Optional[float] = ..., engine_batch: _Optional[float] = ...) -> None: ...
