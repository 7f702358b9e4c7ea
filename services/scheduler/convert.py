"""protobuf <-> scheduler domain objects."""

from __future__ import annotations

import urllib.parse

from libra.errors import InvalidArgument
from libra.routing.policy import Decision, Turn, Worker
from libra.v1 import common_pb2, scheduler_pb2

TOOL_STATUS = {common_pb2.TOOL_STATUS_SUCCESS: "success", common_pb2.TOOL_STATUS_FAILURE: "failure",
               common_pb2.TOOL_STATUS_TIMEOUT: "timeout"}


def check_worker(info: common_pb2.WorkerInfo) -> None:
    """What a RegisterWorker must say: ids of 1-256 characters, an http(s)://HOST:PORT address, TP
    in 0..64 (0: 1). Who may register is the token's to decide (every RPC carries it)."""
    for field in ("worker_id", "bucket"):
        value = getattr(info, field)
        if not value or len(value) > 256 or any(c.isspace() for c in value):
            raise InvalidArgument(f"worker.{field} is required: 1-256 characters without whitespace")
    url = urllib.parse.urlsplit(info.address) if len(info.address) <= 2048 else None
    try:
        port = url.port if url is not None else None
    except ValueError:  # a port that is not a number in 0..65535
        port = None
    if url is None or url.scheme not in ("http", "https") or not url.hostname or not port:
        raise InvalidArgument(f"worker.address must be the worker's base URL, http(s)://HOST:PORT; "
                              f"got {info.address[:80]!r}")
    if info.tp > 64:
        raise InvalidArgument(f"worker.tp must be in 1..64 (0: 1), got {info.tp}")


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
