from libra.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAINER_PHASE_UNSPECIFIED: _ClassVar[TrainerPhase]
    TRAINER_PHASE_WAITING_FOR_PEERS: _ClassVar[TrainerPhase]
    TRAINER_PHASE_WARMUP: _ClassVar[TrainerPhase]
    TRAINER_PHASE_TRAINING: _ClassVar[TrainerPhase]
    TRAINER_PHASE_PAUSED: _ClassVar[TrainerPhase]
    TRAINER_PHASE_DONE: _ClassVar[TrainerPhase]
    TRAINER_PHASE_FAILED: _ClassVar[TrainerPhase]

class HybridState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HYBRID_STATE_UNSPECIFIED: _ClassVar[HybridState]
    HYBRID_STATE_JOINING: _ClassVar[HybridState]
    HYBRID_STATE_SNAPSHOT: _ClassVar[HybridState]
    HYBRID_STATE_ACTIVE: _ClassVar[HybridState]
    HYBRID_STATE_RELEASED: _ClassVar[HybridState]
    HYBRID_STATE_FAILED: _ClassVar[HybridState]
TRAINER_PHASE_UNSPECIFIED: TrainerPhase
TRAINER_PHASE_WAITING_FOR_PEERS: TrainerPhase
TRAINER_PHASE_WARMUP: TrainerPhase
TRAINER_PHASE_TRAINING: TrainerPhase
TRAINER_PHASE_PAUSED: TrainerPhase
TRAINER_PHASE_DONE: TrainerPhase
TRAINER_PHASE_FAILED: TrainerPhase
HYBRID_STATE_UNSPECIFIED: HybridState
HYBRID_STATE_JOINING: HybridState
HYBRID_STATE_SNAPSHOT: HybridState
HYBRID_STATE_ACTIVE: HybridState
HYBRID_STATE_RELEASED: HybridState
HYBRID_STATE_FAILED: HybridState

class TrainerStatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("phase", "step", "total_steps", "policy_version", "last_mean_reward", "detail")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    phase: TrainerPhase
    step: int
    total_steps: int
    policy_version: int
    last_mean_reward: float
    detail: str
    def __init__(self, phase: _Optional[_Union[TrainerPhase, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., last_mean_reward: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class WatchStepsRequest(_message.Message):
    __slots__ = ("run_id", "from_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    from_step: int
    def __init__(self, run_id: _Optional[str] = ..., from_step: _Optional[int] = ...) -> None: ...

class StepRecord(_message.Message):
    __slots__ = ("step", "policy_version", "mean_reward", "loss", "trajectories", "rejected_stale", "mean_staleness", "train_seconds", "wait_seconds", "publish_seconds", "mean_turns", "tokens", "phase", "timestamp", "clip_fraction", "kl", "behaviour_logprob_gap", "fresh_sequences", "publish_write_seconds", "publish_send_seconds", "publish_rpc_seconds", "workers_updated")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_STALE_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TURNS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROB_GAP_FIELD_NUMBER: _ClassVar[int]
    FRESH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_RPC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    mean_reward: float
    loss: float
    trajectories: int
    rejected_stale: int
    mean_staleness: float
    train_seconds: float
    wait_seconds: float
    publish_seconds: float
    mean_turns: float
    tokens: int
    phase: TrainerPhase
    timestamp: float
    clip_fraction: float
    kl: float
    behaviour_logprob_gap: float
    fresh_sequences: int
    publish_write_seconds: float
    publish_send_seconds: float
    publish_rpc_seconds: float
    workers_updated: int
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., mean_reward: _Optional[float] = ..., loss: _Optional[float] = ..., trajectories: _Optional[int] = ..., rejected_stale: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., train_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., publish_seconds: _Optional[float] = ..., mean_turns: _Optional[float] = ..., tokens: _Optional[int] = ..., phase: _Optional[_Union[TrainerPhase, str]] = ..., timestamp: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., kl: _Optional[float] = ..., behaviour_logprob_gap: _Optional[float] = ..., fresh_sequences: _Optional[int] = ..., publish_write_seconds: _Optional[float] = ..., publish_send_seconds: _Optional[float] = ..., publish_rpc_seconds: _Optional[float] = ..., workers_updated: _Optional[int] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("meta",)
    META_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("step", "policy_version", "path")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    path: str
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("meta",)
    META_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ...) -> None: ...

class StepManifestRequest(_message.Message):
    __slots__ = ("run_id", "step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class StepManifest(_message.Message):
    __slots__ = ("step", "membership_epoch", "active_replicas", "acknowledged_by", "hybrids", "lane_endpoints", "core_replicas")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_BY_FIELD_NUMBER: _ClassVar[int]
    HYBRIDS_FIELD_NUMBER: _ClassVar[int]
    LANE_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    CORE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    step: int
    membership_epoch: int
    active_replicas: _containers.RepeatedScalarFieldContainer[str]
    acknowledged_by: _containers.RepeatedScalarFieldContainer[str]
    hybrids: _containers.RepeatedCompositeFieldContainer[HybridReplica]
    lane_endpoints: _containers.RepeatedScalarFieldContainer[str]
    core_replicas: int
    def __init__(self, step: _Optional[int] = ..., membership_epoch: _Optional[int] = ..., active_replicas: _Optional[_Iterable[str]] = ..., acknowledged_by: _Optional[_Iterable[str]] = ..., hybrids: _Optional[_Iterable[_Union[HybridReplica, _Mapping]]] = ..., lane_endpoints: _Optional[_Iterable[str]] = ..., core_replicas: _Optional[int] = ...) -> None: ...

class HybridReplica(_message.Message):
    __slots__ = ("replica_id", "state", "dp_rank", "endpoint", "generation", "reason", "snapshot_step", "active_from_step")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_STEP_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    state: HybridState
    dp_rank: int
    endpoint: str
    generation: int
    reason: str
    snapshot_step: int
    active_from_step: int
    def __init__(self, replica_id: _Optional[str] = ..., state: _Optional[_Union[HybridState, str]] = ..., dp_rank: _Optional[int] = ..., endpoint: _Optional[str] = ..., generation: _Optional[int] = ..., reason: _Optional[str] = ..., snapshot_step: _Optional[int] = ..., active_from_step: _Optional[int] = ...) -> None: ...

class HybridRequest(_message.Message):
    __slots__ = ("meta", "replica_id", "generation")
    META_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    replica_id: str
    generation: int
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., replica_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...
