"""The scheduler as the agent runner sees it: a gRPC client with a request id on every call."""

from __future__ import annotations

import uuid

from libra.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

TIMEOUT_S = 10.0


class SchedulerRouter:
    def __init__(self, channel, run_id: str):
        self.stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self.run_id = run_id

    def _meta(self) -> common_pb2.RequestMeta:
        return common_pb2.RequestMeta(request_id=uuid.uuid4().hex, run_id=self.run_id)

    async def route(self, trajectory_id: str, prompt_id: str, turn: int, prompt_tokens: int, max_new_tokens: int,
                    exclude: list[str]) -> scheduler_pb2.RouteDecision:
        request = scheduler_pb2.RouteRequest(meta=self._meta(), trajectory_id=trajectory_id, prompt_id=prompt_id,
                                             turn=turn, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                                             exclude_workers=exclude)
        return await self.stub.Route(request, timeout=TIMEOUT_S)

    async def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int, seconds: float,
                        failed: bool) -> None:
        await self.stub.ReportTurn(scheduler_pb2.TurnReport(
            meta=self._meta(), trajectory_id=trajectory_id, worker_id=worker_id, output_tokens=output_tokens,
            seconds=seconds, failed=failed), timeout=TIMEOUT_S)

    async def tool_returned(self, trajectory_id: str, tool: str, status: int, payload_tokens: int) -> None:
        await self.stub.ReportToolReturn(scheduler_pb2.ToolReturnReport(
            meta=self._meta(), trajectory_id=trajectory_id, tool=tool, status=status,
            payload_tokens=payload_tokens), timeout=TIMEOUT_S)

    async def finished(self, trajectory_id: str, prompt_id: str, output_tokens: int, status: int) -> None:
        await self.stub.ReportFinish(scheduler_pb2.FinishReport(
            meta=self._meta(), trajectory_id=trajectory_id, prompt_id=prompt_id, output_tokens=output_tokens,
            status=status), timeout=TIMEOUT_S)

    async def register(self, worker: common_pb2.WorkerInfo) -> None:
        request = scheduler_pb2.RegisterWorkerRequest(meta=self._meta(), worker=worker)
        await self.stub.RegisterWorker(request, timeout=TIMEOUT_S)

    async def deregister(self, worker_id: str) -> None:
        request = scheduler_pb2.DeregisterWorkerRequest(meta=self._meta(), worker_id=worker_id)
        await self.stub.DeregisterWorker(request, timeout=TIMEOUT_S)
