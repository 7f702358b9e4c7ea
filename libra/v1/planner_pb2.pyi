from libra.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetPlanRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class LengthSample(_message.Message):
    __slots__ = ("prompt_tokens", "output_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    output_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class PreflightRequest(_message.Message):
    __slots__ = ("run_id", "cluster_yaml", "model_yaml", "gpus", "trace", "top_k")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_YAML_FIELD_NUMBER: _ClassVar[int]
    MODEL_YAML_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    cluster_yaml: str
    model_yaml: str
    gpus: int
    trace: _containers.RepeatedCompositeFieldContainer[LengthSample]
    top_k: int
    def __init__(self, run_id: _Optional[str] = ..., cluster_yaml: _Optional[str] = ..., model_yaml: _Optional[str] = ..., gpus: _Optional[int] = ..., trace: _Optional[_Iterable[_Union[LengthSample, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("plan", "predicted_train_seconds", "predicted_rollout_seconds", "feasible", "note")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ROLLOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.Plan
    predicted_train_seconds: float
    predicted_rollout_seconds: float
    feasible: bool
    note: str
    def __init__(self, plan: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ..., predicted_train_seconds: _Optional[float] = ..., predicted_rollout_seconds: _Optional[float] = ..., feasible: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class PlanDecision(_message.Message):
    __slots__ = ("decision_id", "timestamp", "chosen", "candidates", "applied", "reason", "predicted_gain", "transition_cost")
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GAIN_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_COST_FIELD_NUMBER: _ClassVar[int]
    decision_id: int
    timestamp: float
    chosen: _common_pb2.Plan
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    applied: bool
    reason: str
    predicted_gain: float
    transition_cost: float
    def __init__(self, decision_id: _Optional[int] = ..., timestamp: _Optional[float] = ..., chosen: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., applied: _Optional[bool] = ..., reason: _Optional[str] = ..., predicted_gain: _Optional[float] = ..., transition_cost: _Optional[float] = ...) -> None: ...

class ObserveHistoryRequest(_message.Message):
    __slots__ = ("meta", "records")
    META_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    records: _containers.RepeatedCompositeFieldContainer[_common_pb2.HistoryRecord]
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., records: _Optional[_Iterable[_Union[_common_pb2.HistoryRecord, _Mapping]]] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("run_id", "limit")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    limit: int
    def __init__(self, run_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("decisions",)
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[PlanDecision]
    def __init__(self, decisions: _Optional[_Iterable[_Union[PlanDecision, _Mapping]]] = ...) -> None: ...
