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
    __slots__ = ("member_id", "role", "state", "generation", "address", "bucket", "gpus", "last_heartbeat", "detail")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    role: Role
    state: MemberState
    generation: int
    address: str
    bucket: str
    gpus: int
    last_heartbeat: float
    detail: str
    def __init__(self, member_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., state: _Optional[_Union[MemberState, str]] = ..., generation: _Optional[int] = ..., address: _Optional[str] = ..., bucket: _Optional[str] = ..., gpus: _Optional[int] = ..., last_heartbeat: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("generation", "state", "detail", "steps_done", "steps_total")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    generation: int
    state: str
    detail: str
    steps_done: int
    steps_total: int
    def __init__(self, generation: _Optional[int] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., steps_done: _Optional[int] = ..., steps_total: _Optional[int] = ...) -> None: ...
