"""gRPC adapter of the elastic coordinator."""

from __future__ import annotations

from libra.rpc import guard
from libra.service_base import check_run, request_id, require
from libra.v1 import elastic_pb2, elastic_pb2_grpc


class ElasticServicer(elastic_pb2_grpc.ElasticCoordinatorServicer):
    def __init__(self, service):
        self.service = service

    @guard
    async def RegisterMember(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        rid = request_id(request.meta)
        require(request.member.member_id, "member.member_id")
        return await self.service.register_member(rid, request.member)

    @guard
    async def Heartbeat(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return await self.service.heartbeat(require(request.member_id, "member_id"))

    @guard
    async def ListMembers(self, request, context):
        check_run(request.run_id, self.service.run_id)
        members, epoch = await self.service.list_members(request.role)
        return elastic_pb2.ListMembersResponse(members=members, membership_epoch=epoch)

    @guard
    async def Transition(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        rid = request_id(request.meta)
        require(request.member_id, "member_id")
        require(request.target, "target", "a MemberState")
        return await self.service.transition(rid, request.member_id, request.target,
                                             request.expected_generation, request.detail)

    @guard
    async def ApplyPlan(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        rid = request_id(request.meta)
        require(request.plan.generation, "plan.generation")
        return await self.service.apply_plan(rid, request.plan)

    @guard
    async def GetPlanProgress(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return await self.service.plan_progress(request.generation)
