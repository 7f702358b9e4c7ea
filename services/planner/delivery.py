"""Sending a stored plan to the elastic coordinator (`ElasticCoordinator.ApplyPlan`).

One call per attempt, over a fresh channel whose service config retries UNAVAILABLE within the
call (libra.rpc.channel); the request id is the generation's, so sending a plan again is a replay
at the coordinator when the first one got through. Whoever sends keeps what is still to send: an
applied replan stays `pending_apply` in the planner.online blob for the next tick (server.py), a
hand-made plan is sent again when the planner restarts. Knows neither the replanner nor Redis.
"""

from __future__ import annotations

import grpc

from libra import log as liblog
from libra.rpc import channel
from libra.v1 import common_pb2, elastic_pb2, elastic_pb2_grpc

_log = liblog.get("libra.planner")
APPLY_TIMEOUT_S = 10.0


def request_id(generation: int) -> str:
    """The ApplyPlan request id of a plan generation (the same for every attempt)."""
    return f"planner-apply-gen{generation}"


async def send_plan(address: str, run_id: str, plan: common_pb2.Plan) -> bool | None:
    """Send `plan` (the stored one) to the coordinator at `address`. True: it took it; False: it
    refused it (logged; sending it again would not help); None: unreachable, send it again later."""
    request = elastic_pb2.ApplyPlanRequest(meta=common_pb2.RequestMeta(
        request_id=request_id(plan.generation), run_id=run_id), plan=plan)
    try:
        async with channel(address) as chan:
            progress = await elastic_pb2_grpc.ElasticCoordinatorStub(chan).ApplyPlan(request, timeout=APPLY_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            _log.warning("elastic coordinator unavailable; the plan is sent again later",
                         generation=plan.generation, code=error.code().name)
            return None
        _log.error("elastic coordinator refused the plan", generation=plan.generation,
                   code=error.code().name, detail=error.details())
        return False
    _log.info("plan sent to the elastic coordinator", generation=plan.generation, state=progress.state)
    return True
