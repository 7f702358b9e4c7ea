"""The scheduler as the agent runner sees it: a gRPC client with a request id on every call.

A call that finds the scheduler unavailable (restarting) is retried with the same request id, so
the scheduler applies it once however many times it arrives.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from libra.errors import Unavailable
from libra.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

TIMEOUT_S = 10.0
RETRY_FOR_S = 60.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class _RetryingStub:
    """Wraps each unary method of a stub: retry UNAVAILABLE/DEADLINE_EXCEEDED with backoff."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        async def call(request, timeout: float = TIMEOUT_S):
            loop = asyncio.get_running_loop()
            deadline, backoff = loop.time() + RETRY_FOR_S, 0.1
            while True:
                try:
                    return await method(request, timeout=timeout)
                except grpc.aio.AioRpcError as error:
                    if error.code() not in RETRYABLE:
                        raise
                    if loop.time() > deadline:
                        raise Unavailable(f"scheduler unavailable for {RETRY_FOR_S:.0f}s: {error.details()}") from error
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
        return call


class SchedulerRouter:
    def __init__(self, channel, run_id: str):
        self.stub = _RetryingStub(scheduler_pb2_grpc.SchedulerStub(channel))
        self.run_id = run_id

    def _meta(self) -> common_pb2.RequestMeta:
        return common_pb2.RequestMeta(request_id=uuid.uuid4().hex, run_id=self.run_id)

    async def route(self, trajectory_id: str, prompt_id: str, turn: int, prompt_tokens: int, max_new_tokens: int,
                    exclude: list[str]) -> scheduler_pb2.RouteDecision:
        request = scheduler_pb2.RouteRequest(meta=self._meta(), trajectory_id=trajectory_id, prompt_id=prompt_id,
                                             turn=turn, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                                             exclude_workers=exclude)
        return await self.stub.Route(request, timeout=TIMEOUT_S)

    async def _report(self, method: str, request) -> None:
        """Reports about a trajectory a restarted scheduler never saw are moot: it lost only load
        estimates (its worker registry is in Redis), so NOT_FOUND is ignored here."""
        try:
            await getattr(self.stub, method)(request)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int, seconds: float,
                        failed: bool) -> None:
        await self._report("ReportTurn", scheduler_pb2.TurnReport(
            meta=self._meta(), trajectory_id=trajectory_id, worker_id=worker_id, output_tokens=output_tokens,
            seconds=seconds, failed=failed))

    async def tool_returned(self, trajectory_id: str, tool: str, status: int, payload_tokens: int) -> None:
        await self._report("ReportToolReturn", scheduler_pb2.ToolReturnReport(
            meta=self._meta(), trajectory_id=trajectory_id, tool=tool, status=status,
            payload_tokens=payload_tokens))

    async def finished(self, trajectory_id: str, prompt_id: str, output_tokens: int, status: int) -> None:
        await self._report("ReportFinish", scheduler_pb2.FinishReport(
            meta=self._meta(), trajectory_id=trajectory_id, prompt_id=prompt_id, output_tokens=output_tokens,
            status=status))

    async def register(self, worker: common_pb2.WorkerInfo) -> None:
        request = scheduler_pb2.RegisterWorkerRequest(meta=self._meta(), worker=worker)
        await self.stub.RegisterWorker(request, timeout=TIMEOUT_S)

    async def deregister(self, worker_id: str) -> None:
        request = scheduler_pb2.DeregisterWorkerRequest(meta=self._meta(), worker_id=worker_id)
        await self.stub.DeregisterWorker(request, timeout=TIMEOUT_S)
