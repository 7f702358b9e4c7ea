"""gRPC adapter of the planner: convert, call the service, convert back (run checks, request ids
and replays: `libra.boundary.rpc`)."""

from __future__ import annotations

from libra.boundary import rpc
from libra.errors import InvalidArgument
from libra.plans import to_proto
from libra.services.planner.manual import requested_plan
from libra.v1 import common_pb2, planner_pb2_grpc


MAX_RECORDS = 10_000
"""History records one ObserveHistory may carry (the history streams are capped anyway)."""


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(self, service):
        self.service = service

    @rpc()
    async def GetPlan(self, request, context):
        return to_proto(await self.service.current_plan())

    @rpc()
    async def Preflight(self, request, context):
        return await self.service.preflight(request)

    @rpc(mutating=True)
    async def ObserveHistory(self, request, context):
        if len(request.records) > MAX_RECORDS:
            raise InvalidArgument(f"records: at most {MAX_RECORDS} per request, got {len(request.records)}")
        applied = await self.service.observe(list(request.records))
        return common_pb2.Ack(applied=applied, detail=f"{len(request.records)} records")

    @rpc()
    async def Explain(self, request, context):
        if request.limit > 1000:
            raise InvalidArgument(f"limit must be <= 1000 (decisions kept), got {request.limit}")
        return await self.service.explain(request.limit or 20)

    @rpc(mutating=True)
    async def SetPlan(self, request, context):
        plan = requested_plan(request, self.service.config.security.limits.max_gpus, self.service.clock())
        return await self.service.set_plan(plan)
