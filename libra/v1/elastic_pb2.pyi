from libra.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ROLLOUT: _ClassVar[Role]
    ROLE_TRAINING: _ClassVar[Role]
    ROLE_HYBRID: _ClassVar[Role]

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_ROLLOUT: _ClassVar[MemberState]
    MEMBER_STATE_JOINING: _ClassVar[MemberState]
    MEMBER_STATE_FETCHING_STATE: _ClassVar[MemberState]
    MEMBER_STATE_ALIGNED: _ClassVar[MemberState]
    MEMBER_STATE_ACTIVE: _ClassVar[MemberState]
    MEMBER_STATE_RELEASING: _ClassVar[MemberState]
    MEMBER_STATE_FAILED: _ClassVar[MemberState]
    MEMBER_STATE_OFFLINE: _ClassVar[MemberState]
    MEMBER_STATE_TRAINING: _ClassVar[MemberState]
ROLE_UNSPECIFIED: Role
ROLE_ROLLOUT: Role
ROLE_TRAINING: Role
ROLE_HYBRID: Role
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_ROLLOUT: MemberState
MEMBER_STATE_JOINING: MemberState
MEMBER_STATE_FETCHING_STATE: MemberState
MEMBER_STATE_ALIGNED: MemberState
MEMBER_STATE_ACTIVE: MemberState
MEMBER_STATE_RELEASING: MemberState
MEMBER_STATE_FAILED: MemberState
MEMBER_STATE_OFFLINE: MemberState
MEMBER_STATE_TRAINING: MemberState

class Member(_message.Message):
    __slots__ = ("member_id", "role", "state", "generation", "address", "bucket", "gpus", "last_heartbeat", "detail", "plan_generation", "state_since", "history", "displaced", "pid", "step")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PLAN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_SINCE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    DISPLACED_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    role: Role
    state: MemberState
    generation: int
    address: str
    bucket: str
    gpus: int
    last_heartbeat: float
    detail: str
    plan_generation: int
    state_since: float
    history: _containers.RepeatedCompositeFieldContainer[PhaseRecord]
    displaced: _containers.RepeatedCompositeFieldContainer[_common_pb2.BucketSpec]
    pid: int
    step: int
    def __init__(self, member_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., state: _Optional[_Union[MemberState, str]] = ..., generation: _Optional[int] = ..., address: _Optional[str] = ..., bucket: _Optional[str] = ..., gpus: _Optional[int] = ..., last_heartbeat: _Optional[float] = ..., detail: _Optional[str] = ..., plan_generation: _Optional[int] = ..., state_since: _Optional[float] = ..., history: _Optional[_Iterable[_Union[PhaseRecord, _Mapping]]] = ..., displaced: _Optional[_Iterable[_Union[_common_pb2.BucketSpec, _Mapping]]] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class PhaseRecord(_message.Message):
    __slots__ = ("from_state", "to_state", "generation", "at", "seconds_in_previous", "detail", "plan_generation")
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_IN_PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    PLAN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    from_state: MemberState
    to_state: MemberState
    generation: int
    at: float
    seconds_in_previous: float
    detail: str
    plan_generation: int
    def __init__(self, from_state: _Optional[_Union[MemberState, str]] = ..., to_state: _Optional[_Union[MemberState, str]] = ..., generation: _Optional[int] = ..., at: _Optional[float] = ..., seconds_in_previous: _Optional[float] = ..., detail: _Optional[str] = ..., plan_generation: _Optional[int] = ...) -> None: ...

class RegisterMemberRequest(_message.Message):
    __slots__ = ("meta", "member")
    META_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    member: Member
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., member: _Optional[_Union[Member, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("run_id", "member_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member_id: str
    def __init__(self, run_id: _Optional[str] = ..., member_id: _Optional[str] = ...) -> None: ...

class ListMembersRequest(_message.Message):
    __slots__ = ("run_id", "role")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    role: Role
    def __init__(self, run_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ...) -> None: ...

class ListMembersResponse(_message.Message):
    __slots__ = ("members", "membership_epoch")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    membership_epoch: int
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., membership_epoch: _Optional[int] = ...) -> None: ...

class TransitionRequest(_message.Message):
    __slots__ = ("meta", "member_id", "target", "expected_generation", "detail")
    META_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    member_id: str
    target: MemberState
    expected_generation: int
    detail: str
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., member_id: _Optional[str] = ..., target: _Optional[_Union[MemberState, str]] = ..., expected_generation: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ApplyPlanRequest(_message.Message):
    __slots__ = ("meta", "plan")
    META_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    plan: _common_pb2.Plan
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., plan: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ...) -> None: ...

class PlanProgressRequest(_message.Message):
    __slots__ = ("run_id", "generation")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    generation: int
    def __init__(self, run_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class PlanProgress(_message.Message):
    __slots__ = ("generation", "state", "detail", "steps_done", "steps_total", "actions", "replicas", "started_at", "finished_at")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    state: str
    detail: str
    steps_done: int
    steps_total: int
    actions: _containers.RepeatedCompositeFieldContainer[PlanAction]
    replicas: _containers.RepeatedCompositeFieldContainer[Member]
    started_at: float
    finished_at: float
    def __init__(self, generation: _Optional[int] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., steps_done: _Optional[int] = ..., steps_total: _Optional[int] = ..., actions: _Optional[_Iterable[_Union[PlanAction, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ...) -> None: ...

class PlanAction(_message.Message):
    __slots__ = ("kind", "target", "state", "detail", "started_at", "finished_at", "phase", "gpus", "displaced")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DISPLACED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    target: str
    state: str
    detail: str
    started_at: float
    finished_at: float
    phase: int
    gpus: int
    displaced: _containers.RepeatedCompositeFieldContainer[_common_pb2.BucketSpec]
    def __init__(self, kind: _Optional[str] = ..., target: _Optional[str] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., phase: _Optional[int] = ..., gpus: _Optional[int] = ..., displaced: _Optional[_Iterable[_Union[_common_pb2.BucketSpec, _Mapping]]] = ...) -> None: ...
