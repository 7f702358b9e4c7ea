"""gRPC adapter of the scheduler: convert, call the service, convert back."""

from __future__ import annotations

from libra.errors import InvalidArgument
from libra.rpc import guard
from libra.service_base import check_run, require
from libra.services.scheduler import convert
from libra.v1 import common_pb2, scheduler_pb2_grpc


def _ack(applied: bool) -> common_pb2.Ack:
    return common_pb2.Ack(applied=applied, detail="" if applied else "replay: already applied")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service):
        self.service = service

    def _check(self, meta) -> str:
        check_run(meta.run_id, self.service.run_id)
        return require(meta.request_id, "meta.request_id")

    @guard
    async def Route(self, request, context):
        rid = self._check(request.meta)
        return convert.decision_to_proto(self.service.route(rid, convert.turn_from_proto(request)))

    @guard
    async def ReportTurn(self, request, context):
        rid = self._check(request.meta)
        require(request.worker_id, "worker_id")
        return _ack(self.service.turn_done(rid, request.trajectory_id, request.worker_id, request.output_tokens))

    @guard
    async def ReportToolReturn(self, request, context):
        rid = self._check(request.meta)
        status = convert.TOOL_STATUS.get(request.status)
        if status is None:
            raise InvalidArgument("status is required: TOOL_STATUS_SUCCESS, _FAILURE or _TIMEOUT "
                                  "(the structured outcome the workload reports)")
        require(request.tool, "tool")
        return _ack(self.service.tool_returned(rid, request.trajectory_id, request.tool, status,
                                               request.payload_tokens))

    @guard
    async def ReportFinish(self, request, context):
        rid = self._check(request.meta)
        return _ack(self.service.finish(rid, request.trajectory_id, request.prompt_id, request.output_tokens))

    @guard
    async def RegisterWorker(self, request, context):
        rid = self._check(request.meta)
        return _ack(await self.service.register_worker(rid, convert.worker_from_proto(request.worker)))

    @guard
    async def DeregisterWorker(self, request, context):
        rid = self._check(request.meta)
        require(request.worker_id, "worker_id")
        return _ack(await self.service.deregister_worker(rid, request.worker_id))

    @guard
    async def GetStats(self, request, context):
        check_run(request.run_id, self.service.run_id)
        return self.service.stats()
