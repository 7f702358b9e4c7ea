"""gRPC adapter of the trainer (run checks, request ids and replays: `libra.boundary.rpc`)."""

from __future__ import annotations

from libra.boundary import rpc
from libra.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, service):
        self.service = service

    @rpc()
    async def GetStatus(self, request, context):
        return self.service.status.to_proto()

    @rpc()
    async def WatchSteps(self, request, context):
        step = max(1, request.from_step)
        status = self.service.status
        while True:
            record = await status.wait_for_step(step)
            if record is not None:
                yield record
                step += 1
            elif status.phase in (trainer_pb2.TRAINER_PHASE_DONE, trainer_pb2.TRAINER_PHASE_FAILED):
                return

    @rpc(mutating=True)
    async def SaveCheckpoint(self, request, context):
        return await self.service.save_checkpoint()

    @rpc(mutating=True)
    async def Pause(self, request, context):
        return common_pb2.Ack(applied=await self.service.pause(True))

    @rpc(mutating=True)
    async def Resume(self, request, context):
        return common_pb2.Ack(applied=await self.service.pause(False))

    @rpc()
    async def GetStepManifest(self, request, context):
        return await self.service.manifest(request.step)

    @rpc(mutating=True)
    async def AdmitHybrid(self, request, context):
        control = self.service.elastic_control()
        return common_pb2.Ack(applied=await control.admit(request.replica_id, request.generation))

    @rpc(mutating=True)
    async def ReleaseHybrid(self, request, context):
        control = self.service.elastic_control()
        return common_pb2.Ack(applied=await control.release(request.replica_id, request.generation))
