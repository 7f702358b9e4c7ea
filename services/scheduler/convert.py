"""protobuf <-> scheduler domain objects."""

from __future__ import annotations

from libra.routing.policy import Decision, Turn, Worker
from libra.v1 import common_pb2, scheduler_pb2

TOOL_STATUS = {common_pb2.TOOL_STATUS_SUCCESS: "success", common_pb2.TOOL_STATUS_FAILURE: "failure",
               common_pb2.TOOL_STATUS_TIMEOUT: "timeout"}


def worker_from_proto(info: common_pb2.WorkerInfo) -> Worker:
    return Worker(worker_id=info.worker_id, bucket=info.bucket, address=info.address, tp=info.tp or 1,
                  serving=info.state in (common_pb2.WORKER_STATE_SERVING, common_pb2.WORKER_STATE_UNSPECIFIED))


def worker_to_proto(worker: Worker) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id=worker.worker_id, bucket=worker.bucket, address=worker.address, tp=worker.tp,
        state=common_pb2.WORKER_STATE_SERVING if worker.serving else common_pb2.WORKER_STATE_DRAINING,
        outstanding_tokens=worker.outstanding_tokens, outstanding_requests=worker.outstanding_requests)


def turn_from_proto(request: scheduler_pb2.RouteRequest) -> Turn:
    return Turn(trajectory_id=request.trajectory_id, prompt_id=request.prompt_id, turn=request.turn,
                prompt_tokens=request.prompt_tokens, max_new_tokens=request.max_new_tokens,
                exclude=frozenset(request.exclude_workers))


def decision_to_proto(decision: Decision) -> scheduler_pb2.RouteDecision:
    return scheduler_pb2.RouteDecision(worker_id=decision.worker_id, bucket=decision.bucket,
                                       address=decision.address, reason=decision.reason, moved=decision.moved)


def decision_from_proto(message: scheduler_pb2.RouteDecision) -> Decision:
    return Decision(message.worker_id, message.bucket, message.address, message.reason, message.moved)
