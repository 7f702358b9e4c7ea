"""gRPC adapter of the trainer."""

from __future__ import annotations

from libra.rpc import guard
from libra.service_base import check_run, request_id
from libra.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service):
        self.service = service

    @guard
    async def GetStatus(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return self.service.status.to_proto()

    @guard
    async def WatchSteps(self, request, context):
        check_run(request.run_id, self.service.run_id)
        step = max(1, request.from_step)
        status = self.service.status
        while True:
            record = await status.wait_for_step(step)
            if record is not None:
                yield record
                step += 1
            elif status.phase in (trainer_pb2.TRAINER_PHASE_DONE, trainer_pb2.TRAINER_PHASE_FAILED):
                return

    @guard
    async def SaveCheckpoint(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        request_id(request.meta)
        return await self.service.save_checkpoint()

    @guard
    async def Pause(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        request_id(request.meta)
        return common_pb2.Ack(applied=await self.service.pause(True))

    @guard
    async def Resume(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        request_id(request.meta)
        return common_pb2.Ack(applied=await self.service.pause(False))

    @guard
    async def GetStepManifest(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return await self.service.manifest(request.step)

    @guard
    async def AdmitHybrid(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        rid = request_id(request.meta)
        return common_pb2.Ack(applied=await self.service.elastic_control().admit(
            request.replica_id, request.generation, rid))

    @guard
    async def ReleaseHybrid(self, request, context):
        check_run(request.meta.run_id, self.service.run_id)
        rid = request_id(request.meta)
        return common_pb2.Ack(applied=await self.service.elastic_control().release(
            request.replica_id, request.generation, rid))
