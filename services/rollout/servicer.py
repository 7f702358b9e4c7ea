"""gRPC adapter of the rollout gateway (run checks, request ids and replays: `libra.boundary.rpc`)."""

from __future__ import annotations

from libra.errors import InvalidArgument
from libra.boundary import rpc
from libra.service_base import require
from libra.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from libra.weights.roster import GroupRecord


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, service):
        self.service = service

    @rpc(mutating=True)
    async def SubmitPrompts(self, request, context):
        require(request.groups, "groups", "submit at least one prompt group")
        for group in request.groups:
            require(group.group_id, "groups[].group_id")
            require(group.prompt_id, "groups[].prompt_id")
            if group.samples < 1:
                raise InvalidArgument(f"groups[{group.group_id}].samples must be >= 1")
        accepted, duplicates, queued = await self.service.submit(list(request.groups))
        return rollout_pb2.SubmitPromptsResponse(accepted_groups=accepted, duplicate_groups=duplicates,
                                                 queued_trajectories=queued)

    @rpc()
    async def GetTrajectory(self, request, context):
        return await self.service.store.get_trajectory(require(request.trajectory_id, "trajectory_id"))

    @rpc(mutating=True)
    async def UpdateWeights(self, request, context):
        require(request.version, "version", "policy versions start at 1")
        group = GroupRecord.from_proto(request.group) if request.HasField("group") else None
        if group is None:
            require(request.path, "path", "a version sent without a weights-group generation is loaded from disk")
        elif not group.generation or not group.roster:
            raise InvalidArgument("group must name its generation (>= 1) and at least one member")
        done = await self.service.update_weights(request.version, request.path, group)
        return rollout_pb2.UpdateWeightsResponse(version=request.version, acks=done.acks,
                                                 serving=done.serving.to_proto(), group_unusable=done.group_unusable)

    @rpc()
    async def ListWorkers(self, request, context):
        return rollout_pb2.ListWorkersResponse(workers=[w.to_proto() for w in self.service.pool.workers.values()])

    @rpc(mutating=True)
    async def DrainWorker(self, request, context):
        await self.service.drain_worker(require(request.worker_id, "worker_id"), request.timeout_seconds or 60.0)
        return common_pb2.Ack(applied=True, detail=f"{request.worker_id} stopped")

    @rpc(mutating=True)
    async def StartWorkers(self, request, context):
        require(request.buckets, "buckets")
        workers = await self.service.start_workers(list(request.buckets))
        return rollout_pb2.ListWorkersResponse(workers=[w.to_proto() for w in workers])

    @rpc()
    async def GetStats(self, request, context):
        return self.service.stats()
