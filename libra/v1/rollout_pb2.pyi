from libra.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "prompt_id", "samples", "min_version")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    samples: int
    min_version: int
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., samples: _Optional[int] = ..., min_version: _Optional[int] = ...) -> None: ...

class SubmitPromptsRequest(_message.Message):
    __slots__ = ("meta", "groups")
    META_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    groups: _containers.RepeatedCompositeFieldContainer[PromptGroup]
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[PromptGroup, _Mapping]]] = ...) -> None: ...

class SubmitPromptsResponse(_message.Message):
    __slots__ = ("accepted_groups", "duplicate_groups", "queued_trajectories")
    ACCEPTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    accepted_groups: int
    duplicate_groups: int
    queued_trajectories: int
    def __init__(self, accepted_groups: _Optional[int] = ..., duplicate_groups: _Optional[int] = ..., queued_trajectories: _Optional[int] = ...) -> None: ...

class GetTrajectoryRequest(_message.Message):
    __slots__ = ("run_id", "trajectory_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    trajectory_id: str
    def __init__(self, run_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("worker_id", "tp")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tp: int
    def __init__(self, worker_id: _Optional[str] = ..., tp: _Optional[int] = ...) -> None: ...

class WeightsGeneration(_message.Message):
    __slots__ = ("generation", "formed_for", "members")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FORMED_FOR_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    formed_for: int
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    def __init__(self, generation: _Optional[int] = ..., formed_for: _Optional[int] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("meta", "version", "path", "group", "colocated")
    META_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    version: int
    path: str
    group: WeightsGeneration
    colocated: str
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., version: _Optional[int] = ..., path: _Optional[str] = ..., group: _Optional[_Union[WeightsGeneration, _Mapping]] = ..., colocated: _Optional[str] = ...) -> None: ...

class WorkerAck(_message.Message):
    __slots__ = ("worker_id", "version", "seconds", "ok", "error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    version: int
    seconds: float
    ok: bool
    error: str
    def __init__(self, worker_id: _Optional[str] = ..., version: _Optional[int] = ..., seconds: _Optional[float] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "acks", "serving", "group_unusable")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    GROUP_UNUSABLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    acks: _containers.RepeatedCompositeFieldContainer[WorkerAck]
    serving: _containers.RepeatedCompositeFieldContainer[GroupMember]
    group_unusable: str
    def __init__(self, version: _Optional[int] = ..., acks: _Optional[_Iterable[_Union[WorkerAck, _Mapping]]] = ..., serving: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., group_unusable: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.WorkerInfo, _Mapping]]] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("meta", "worker_id", "timeout_seconds")
    META_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    worker_id: str
    timeout_seconds: float
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., worker_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class StartWorkersRequest(_message.Message):
    __slots__ = ("meta", "buckets")
    META_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    buckets: _containers.RepeatedCompositeFieldContainer[_common_pb2.BucketSpec]
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., buckets: _Optional[_Iterable[_Union[_common_pb2.BucketSpec, _Mapping]]] = ...) -> None: ...

class RolloutStatsRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class RolloutStats(_message.Message):
    __slots__ = ("queued", "running", "completed", "failed", "turns", "retried_turns", "mean_reward", "generated_tokens")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    RETRIED_TURNS_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queued: int
    running: int
    completed: int
    failed: int
    turns: int
    retried_turns: int
    mean_reward: float
    generated_tokens: int
    def __init__(self, queued: _Optional[int] = ..., running: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., turns: _Optional[int] = ..., retried_turns: _Optional[int] = ..., mean_reward: _Optional[float] = ..., generated_tokens: _Optional[int] = ...) -> None: ...
