"""gRPC adapter of the planner: convert, call the service, convert back."""

from __future__ import annotations

from libra.errors import InvalidArgument
from libra.plans import to_proto
from libra.rpc import guard
from libra.service_base import check_run, request_id
from libra.v1 import common_pb2, planner_pb2_grpc


class PlannerServicer(planner_pb2_grpc.PlannerServicer):
    def __init__(self, service):
        self.service = service

    @guard
    async def GetPlan(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return to_proto(await self.service.current_plan())

    @guard
    async def Preflight(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return await self.service.preflight(request)

    @guard
    async def ObserveHistory(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        applied = await self.service.observe(request_id(request.meta), list(request.records))
        return common_pb2.Ack(applied=applied, detail=f"{len(request.records)} records")

    @guard
    async def Explain(self, request, context):
        check_run(request.run_id, self.service.run_id)
        if request.limit > 1000:
            raise InvalidArgument(f"limit must be <= 1000 (decisions kept), got {request.limit}")
        return await self.service.explain(request.limit or 20)
