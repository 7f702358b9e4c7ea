"""gRPC adapter of the scheduler: convert, call the service, convert back.

Every request kind has one handler (`_route`, `_turn`, `_tool_return`, `_finish`) that validates
and applies it; the unary RPCs and the gateway's `Session` stream both go through them, so the
two paths cannot disagree about what a valid request is.
"""

from __future__ import annotations

import asyncio

import grpc

from libra import log as liblog
from libra.errors import InvalidArgument, status_code
from libra.rpc import guard
from libra.service_base import check_run, require
from libra.services.scheduler import convert
from libra.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_log = liblog.get("libra.scheduler")
ACK_IDLE_S = 0.05
"""A session with reports but no Route to piggyback on gets a bare acknowledgement this often."""


def _ack(applied: bool) -> common_pb2.Ack:
    return common_pb2.Ack(applied=applied, detail="" if applied else "replay: already applied")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service):
        self.service = service
        self._reports = {"turn": self._turn, "tool_return": self._tool_return, "finish": self._finish}

    def _check(self, meta) -> str:
        check_run(meta.run_id, self.service.run_id)
        return require(meta.request_id, "meta.request_id")

    # --- one handler per request kind --------------------------------------------------------
    def _route(self, request) -> scheduler_pb2.RouteDecision:
        rid = self._check(request.meta)
        return convert.decision_to_proto(self.service.route(rid, convert.turn_from_proto(request)))

    def _turn(self, request) -> bool:
        rid = self._check(request.meta)
        require(request.worker_id, "worker_id")
        return self.service.turn_done(rid, request.trajectory_id, request.worker_id, request.output_tokens)

    def _tool_return(self, request) -> bool:
        rid = self._check(request.meta)
        status = convert.TOOL_STATUS.get(request.status)
        if status is None:
            raise InvalidArgument("status is required: TOOL_STATUS_SUCCESS, _FAILURE or _TIMEOUT "
                                  "(the structured outcome the workload reports)")
        require(request.tool, "tool")
        return self.service.tool_returned(rid, request.trajectory_id, request.tool, status, request.payload_tokens)

    def _finish(self, request) -> bool:
        rid = self._check(request.meta)
        return self.service.finish(rid, request.trajectory_id, request.prompt_id, request.output_tokens)

    # --- unary RPCs (tools, grpcurl) ------------------------------------------------------------
    @guard
    async def Route(self, request, context):
        return self._route(request)

    @guard
    async def ReportTurn(self, request, context):
        return _ack(self._turn(request))

    @guard
    async def ReportToolReturn(self, request, context):
        return _ack(self._tool_return(request))

    @guard
    async def ReportFinish(self, request, context):
        return _ack(self._finish(request))

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

    # --- the gateway's stream -------------------------------------------------------------------
    async def Session(self, request_iterator, context):
        """Apply each batch's messages in order; answer its Routes and failures in one batch.

        A message that fails gets a StreamError with its seq and the status code the unary RPC
        would have returned; the stream stays open. Reports are acknowledged by `processed_seq` on
        the next answer batch, or after ACK_IDLE_S when no answer comes, so a reconnecting gateway
        knows what to send again (and the replay window makes a resent message harmless).
        """
        lock = asyncio.Lock()
        processed = acked = 0
        acker: asyncio.Task | None = None

        async def write(answers: list) -> None:
            nonlocal acked
            async with lock:
                acked = processed
                await context.write(scheduler_pb2.SchedulerBatch(processed_seq=processed, answers=answers))

        async def acknowledge_later() -> None:
            await asyncio.sleep(ACK_IDLE_S)
            if processed > acked:
                await write([])

        try:
            async for batch in request_iterator:
                answers = []
                for message in batch.messages:
                    answer = self._apply(message)
                    processed = message.seq
                    if answer is not None:
                        answers.append(answer)
                if answers:
                    await write(answers)
                elif processed > acked and (acker is None or acker.done()):
                    acker = asyncio.get_running_loop().create_task(acknowledge_later())
        finally:
            if acker is not None:
                acker.cancel()

    def _apply(self, message) -> scheduler_pb2.SchedulerMessage | None:
        """One session message: its answer (a Route's decision, or an error), or None for a report."""
        kind = message.WhichOneof("body")
        try:
            if kind == "route":
                return scheduler_pb2.SchedulerMessage(seq=message.seq, route=self._route(message.route))
            handler = self._reports.get(kind)
            if handler is None:
                raise InvalidArgument("GatewayMessage.body is empty: set route, turn, tool_return or finish")
            handler(getattr(message, kind))
            return None
        except Exception as error:  # noqa: BLE001 - answered on the stream, the session goes on
            code = status_code(error)
            if code == grpc.StatusCode.INTERNAL:
                _log.exception("session message failed", kind=kind)
            return scheduler_pb2.SchedulerMessage(seq=message.seq, error=scheduler_pb2.StreamError(
                code=code.name, message=str(error) or type(error).__name__))
