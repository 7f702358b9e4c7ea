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
    __slots__ = ("decision_id", "timestamp", "chosen", "candidates", "applied", "reason", "predicted_gain", "transition_cost", "trigger", "current", "predicted_current_seconds", "predicted_new_seconds", "inputs", "trace_sequences")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GAIN_FIELD_NUMBER: _ClassVar[int]
    TRANSITION_COST_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CURRENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_NEW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRACE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    decision_id: int
    timestamp: float
    chosen: _common_pb2.Plan
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    applied: bool
    reason: str
    predicted_gain: float
    transition_cost: float
    trigger: str
    current: _common_pb2.Plan
    predicted_current_seconds: float
    predicted_new_seconds: float
    inputs: _containers.ScalarMap[str, float]
    trace_sequences: int
    def __init__(self, decision_id: _Optional[int] = ..., timestamp: _Optional[float] = ..., chosen: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ..., applied: _Optional[bool] = ..., reason: _Optional[str] = ..., predicted_gain: _Optional[float] = ..., transition_cost: _Optional[float] = ..., trigger: _Optional[str] = ..., current: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ..., predicted_current_seconds: _Optional[float] = ..., predicted_new_seconds: _Optional[float] = ..., inputs: _Optional[_Mapping[str, float]] = ..., trace_sequences: _Optional[int] = ...) -> None: ...

class ObserveHistoryRequest(_message.Message):
    __slots__ = ("meta", "records")
    META_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    records: _containers.RepeatedCompositeFieldContainer[_common_pb2.HistoryRecord]
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., records: _Optional[_Iterable[_Union[_common_pb2.HistoryRecord, _Mapping]]] = ...) -> None: ...

class SetPlanRequest(_message.Message):
    __slots__ = ("meta", "buckets", "training", "reason")
    META_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    meta: _common_pb2.RequestMeta
    buckets: _containers.RepeatedCompositeFieldContainer[_common_pb2.BucketSpec]
    training: _common_pb2.TrainingLayout
    reason: str
    def __init__(self, meta: _Optional[_Union[_common_pb2.RequestMeta, _Mapping]] = ..., buckets: _Optional[_Iterable[_Union[_common_pb2.BucketSpec, _Mapping]]] = ..., training: _Optional[_Union[_common_pb2.TrainingLayout, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("run_id", "limit")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    limit: int
    def __init__(self, run_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class Efficiency(_message.Message):
    __slots__ = ("name", "base", "calibrated", "slowdown", "std", "samples", "resets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    base: float
    calibrated: float
    slowdown: float
    std: float
    samples: int
    resets: int
    def __init__(self, name: _Optional[str] = ..., base: _Optional[float] = ..., calibrated: _Optional[float] = ..., slowdown: _Optional[float] = ..., std: _Optional[float] = ..., samples: _Optional[int] = ..., resets: _Optional[int] = ...) -> None: ...

class PredictedVsMeasured(_message.Message):
    __slots__ = ("what", "predicted_seconds", "measured_seconds", "samples")
    WHAT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    what: str
    predicted_seconds: float
    measured_seconds: float
    samples: int
    def __init__(self, what: _Optional[str] = ..., predicted_seconds: _Optional[float] = ..., measured_seconds: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class CalibrationReport(_message.Message):
    __slots__ = ("efficiencies", "times", "rejected", "turns_read", "steps_read", "updated_at")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EFFICIENCIES_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    TURNS_READ_FIELD_NUMBER: _ClassVar[int]
    STEPS_READ_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    efficiencies: _containers.RepeatedCompositeFieldContainer[Efficiency]
    times: _containers.RepeatedCompositeFieldContainer[PredictedVsMeasured]
    rejected: _containers.ScalarMap[str, int]
    turns_read: int
    steps_read: int
    updated_at: float
    def __init__(self, efficiencies: _Optional[_Iterable[_Union[Efficiency, _Mapping]]] = ..., times: _Optional[_Iterable[_Union[PredictedVsMeasured, _Mapping]]] = ..., rejected: _Optional[_Mapping[str, int]] = ..., turns_read: _Optional[int] = ..., steps_read: _Optional[int] = ..., updated_at: _Optional[float] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("decisions", "calibration", "mode", "plan")
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[PlanDecision]
    calibration: CalibrationReport
    mode: str
    plan: _common_pb2.Plan
    def __init__(self, decisions: _Optional[_Iterable[_Union[PlanDecision, _Mapping]]] = ..., calibration: _Optional[_Union[CalibrationReport, _Mapping]] = ..., mode: _Optional[str] = ..., plan: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ...) -> None: ...
