"""gRPC adapter of the rollout gateway."""

from __future__ import annotations

from libra.errors import InvalidArgument
from libra.rpc import guard
from libra.service_base import check_run, request_id, require
from libra.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, service):
        self.service = service

    @guard
    async def SubmitPrompts(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        request_id(request.meta)
        require(request.groups, "groups", "submit at least one prompt group")
        for group in request.groups:
            require(group.group_id, "groups[].group_id")
            require(group.prompt_id, "groups[].prompt_id")
            if group.samples < 1:
                raise InvalidArgument(f"groups[{group.group_id}].samples must be >= 1")
        accepted, duplicates, queued = await self.service.submit(list(request.groups))
        return rollout_pb2.SubmitPromptsResponse(accepted_groups=accepted, duplicate_groups=duplicates,
                                                 queued_trajectories=queued)

    @guard
    async def GetTrajectory(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return await self.service.store.get_trajectory(require(request.trajectory_id, "trajectory_id"))

    @guard
    async def UpdateWeights(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        request_id(request.meta)
        require(request.version, "version", "policy versions start at 1")
        require(request.path, "path")
        acks = await self.service.update_weights(request.version, request.path, request.over_group)
        return rollout_pb2.UpdateWeightsResponse(version=request.version, acks=acks)

    @guard
    async def ListWorkers(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return rollout_pb2.ListWorkersResponse(workers=[w.to_proto() for w in self.service.pool.workers.values()])

    @guard
    async def DrainWorker(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        request_id(request.meta)
        await self.service.drain_worker(require(request.worker_id, "worker_id"), request.timeout_seconds or 60.0)
        return common_pb2.Ack(applied=True, detail=f"{request.worker_id} stopped")

    @guard
    async def StartWorkers(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        request_id(request.meta)
        require(request.buckets, "buckets")
        workers = await self.service.start_workers(list(request.buckets))
        return rollout_pb2.ListWorkersResponse(workers=[w.to_proto() for w in workers])

    @guard
    async def GetStats(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return self.service.stats()
