"""gRPC adapter of the elastic coordinator (run checks, request ids and replays: `libra.boundary.rpc`)."""

from __future__ import annotations

from libra.boundary import rpc
from libra.errors import InvalidArgument
from libra.plans import check_plan
from libra.service_base import require
from libra.v1 import elastic_pb2, elastic_pb2_grpc

ROLES = (elastic_pb2.ROLE_ROLLOUT, elastic_pb2.ROLE_TRAINING, elastic_pb2.ROLE_HYBRID)


def check_id(value: str, field: str) -> str:
    """A member id: 1-256 characters without whitespace."""
    if not value or len(value) > 256 or any(c.isspace() for c in value):
        raise InvalidArgument(f"{field} is required: 1-256 characters without whitespace")
    return value


def check_member(member: elastic_pb2.Member, max_gpus: int) -> None:
    """What a RegisterMember may say about a member (its state and history are the coordinator's)."""
    check_id(member.member_id, "member.member_id")
    if member.role not in ROLES:
        raise InvalidArgument(f"member.role must be ROLE_ROLLOUT, ROLE_TRAINING or ROLE_HYBRID, got {member.role}")
    if member.gpus > max_gpus:
        raise InvalidArgument(f"member.gpus must be <= security.limits.max_gpus ({max_gpus}), got {member.gpus}")


class ElasticServicer(elastic_pb2_grpc.ElasticCoordinatorServicer):
    def __init__(self, service):
        self.service = service

    @rpc(mutating=True)
    async def RegisterMember(self, request, context):
        check_member(request.member, self.service.config.security.limits.max_gpus)
        return await self.service.register_member(request.member)

    @rpc()
    async def Heartbeat(self, request, context):
        return await self.service.heartbeat(check_id(request.member_id, "member_id"))

    @rpc()
    async def ListMembers(self, request, context):
        members, epoch = await self.service.list_members(request.role)
        return elastic_pb2.ListMembersResponse(members=members, membership_epoch=epoch)

    @rpc(mutating=True)
    async def Transition(self, request, context):
        check_id(request.member_id, "member_id")
        if not request.target or request.target not in elastic_pb2.MemberState.values():
            raise InvalidArgument(f"target is required: a MemberState, got {request.target}")
        return await self.service.transition(request.member_id, request.target,
                                             request.expected_generation, request.detail)

    @rpc(mutating=True)
    async def ApplyPlan(self, request, context):
        require(request.plan.generation, "plan.generation")
        check_plan(request.plan, self.service.config.security.limits.max_gpus)
        return await self.service.apply_plan(request.plan)

    @rpc()
    async def GetPlanProgress(self, request, context):
        return await self.service.plan_progress(request.generation)
