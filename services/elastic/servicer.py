"""gRPC adapter of the elastic coordinator (run checks, request ids and replays: `libra.boundary.rpc`)."""

from __future__ import annotations

from libra.boundary import rpc
from libra.service_base import require
from libra.v1 import elastic_pb2, elastic_pb2_grpc


class ElasticServicer(elastic_pb2_grpc.ElasticCoordinatorServicer):
    def __init__(self, service):
        self.service = service

    @rpc(mutating=True)
    async def RegisterMember(self, request, context):
        require(request.member.member_id, "member.member_id")
        return await self.service.register_member(request.meta.request_id, request.member)

    @rpc()
    async def Heartbeat(self, request, context):
        return await self.service.heartbeat(require(request.member_id, "member_id"))

    @rpc()
    async def ListMembers(self, request, context):
        members, epoch = await self.service.list_members(request.role)
        return elastic_pb2.ListMembersResponse(members=members, membership_epoch=epoch)

    @rpc(mutating=True)
    async def Transition(self, request, context):
        require(request.member_id, "member_id")
        require(request.target, "target", "a MemberState")
        return await self.service.transition(request.meta.request_id, request.member_id, request.target,
                                             request.expected_generation, request.detail)

    @rpc(mutating=True)
    async def ApplyPlan(self, request, context):
        require(request.plan.generation, "plan.generation")
        return await self.service.apply_plan(request.meta.request_id, request.plan)

    @rpc()
    async def GetPlanProgress(self, request, context):
        return await self.service.plan_progress(request.generation)
