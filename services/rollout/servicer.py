"""gRPC adapter of the rollout gateway (run checks, request ids and replays: `libra.boundary.rpc`)."""

from __future__ import annotations

from libra.errors import InvalidArgument
from libra.boundary import rpc
from libra.service_base import require
from libra.services.rollout import bounds
from libra.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from libra.weights.roster import GroupRecord


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, service):
        self.service = service

    @rpc(mutating=True)
    async def SubmitPrompts(self, request, context):
        bounds.check_groups(request.groups)
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
        if group is None and not request.colocated:
            require(request.path, "path", "a version sent without a weights-group generation or a colocated "
                                          "descriptor is loaded from disk")
        elif group is not None and (not group.generation or not group.roster):
            raise InvalidArgument("group must name its generation (>= 1) and at least one member")
        done = await self.service.update_weights(request.version, request.path, group, request.colocated)
        return rollout_pb2.UpdateWeightsResponse(version=request.version, acks=done.acks,
                                                 serving=done.serving.to_proto(), group_unusable=done.group_unusable)

    @rpc()
    async def ListWorkers(self, request, context):
        return rollout_pb2.ListWorkersResponse(workers=[w.to_proto() for w in self.service.pool.workers.values()])

    @rpc(mutating=True)
    async def DrainWorker(self, request, context):
        timeout_s = bounds.drain_timeout(request.timeout_seconds)
        await self.service.drain_worker(require(request.worker_id, "worker_id"), timeout_s)
        return common_pb2.Ack(applied=True, detail=f"{request.worker_id} stopped")

    @rpc(mutating=True)
    async def StartWorkers(self, request, context):
        running = sum(1 for w in self.service.pool.workers.values() if w.state != common_pb2.WORKER_STATE_STOPPED)
        bounds.check_start(request.buckets, running, self.service.config.security.limits.max_workers)
        workers = await self.service.start_workers(list(request.buckets))
        return rollout_pb2.ListWorkersResponse(workers=[w.to_proto() for w in workers])

    @rpc()
    async def GetStats(self, request, context):
        return self.service.stats()
