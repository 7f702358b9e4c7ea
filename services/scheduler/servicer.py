"""gRPC adapter of the scheduler: convert, call the service, convert back.

Every request kind has one handler (`_route`, `_turn`, `_tool_return`, `_finish`) that validates
and applies it; the unary RPCs and the gateway's `Session` stream both reach them through the RPC
boundary (`libra.boundary`) under the same RPC name, so the two paths cannot disagree about what
a valid request is, and a request id is applied once whichever path carried it (the scheduler's
replies are kept in memory: `SchedulerService.replies`). What a request changed is saved to Redis
(`SchedulerService.persist`) before its answer, or the acknowledgement of its seq, goes out; the
reply is saved with its trajectory's record, for a replay after a restart (services/scheduler/live.py).
"""

from __future__ import annotations

import asyncio

import grpc

from libra import log as liblog
from libra.boundary import apply, rpc
from libra.errors import InvalidArgument, status_code
from libra.service_base import require
from libra.services.scheduler import convert
from libra.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_log = liblog.get("libra.scheduler")
ACK_IDLE_S = 0.05
"""A session with reports but no Route to piggyback on gets a bare acknowledgement this often."""
MAX_WAITING_BYTES = 4 * 2**20
"""What a session reads ahead of the batches being applied and saved (serialized bytes; one batch of any
allowed size is always read when none waits): beyond it the stream is not read, and gRPC's flow
control holds the gateway back, as when the session read one batch at a time."""


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, service):
        self.service = service
        self._reports = {"turn": ("ReportTurn", self._turn), "tool_return": ("ReportToolReturn", self._tool_return),
                         "finish": ("ReportFinish", self._finish)}

    # --- one handler per request kind (run and request id already checked) ---------------------
    def _route(self, request) -> scheduler_pb2.RouteDecision:
        return convert.decision_to_proto(self.service.route(convert.turn_from_proto(request)))

    def _turn(self, request) -> common_pb2.Ack:
        require(request.worker_id, "worker_id")
        self.service.turn_done(request.trajectory_id, request.worker_id, request.output_tokens)
        return common_pb2.Ack(applied=True)

    def _tool_return(self, request) -> common_pb2.Ack:
        status = convert.TOOL_STATUS.get(request.status)
        if status is None:
            raise InvalidArgument("status is required: TOOL_STATUS_SUCCESS, _FAILURE or _TIMEOUT "
                                  "(the structured outcome the workload reports)")
        require(request.tool, "tool")
        self.service.tool_returned(request.trajectory_id, request.tool, status, request.payload_tokens)
        return common_pb2.Ack(applied=True)

    def _finish(self, request) -> common_pb2.Ack:
        if request.status == common_pb2.TRAJECTORY_STATUS_QUEUED:  # to be played again from its start
            forgotten = self.service.forget(request.trajectory_id)
            return common_pb2.Ack(applied=forgotten, detail="" if forgotten else "not routed: nothing to forget")
        self.service.finish(request.trajectory_id, request.prompt_id, request.output_tokens)
        return common_pb2.Ack(applied=True)

    # --- unary RPCs (tools, grpcurl) ------------------------------------------------------------
    @rpc(mutating=True)
    async def Route(self, request, context):
        return await self._saved("Route", request, self._route)

    @rpc(mutating=True)
    async def ReportTurn(self, request, context):
        return await self._saved("ReportTurn", request, self._turn)

    @rpc(mutating=True)
    async def ReportToolReturn(self, request, context):
        return await self._saved("ReportToolReturn", request, self._tool_return)

    @rpc(mutating=True)
    async def ReportFinish(self, request, context):
        return await self._saved("ReportFinish", request, self._finish)

    async def _saved(self, name: str, request, handler):
        """A unary routing RPC (the boundary has checked it): apply, keep the reply, save, answer."""
        reply = handler(request)
        self._keep_reply(name, request, reply)
        await self.service.persist()
        return reply

    def _keep_reply(self, name: str, request, reply) -> None:
        self.service.replied(request.trajectory_id, f"Scheduler.{name}", request.meta.request_id, reply)

    @rpc(mutating=True)
    async def RegisterWorker(self, request, context):
        convert.check_worker(request.worker)
        await self.service.register_worker(convert.worker_from_proto(request.worker))
        return common_pb2.Ack(applied=True)

    @rpc(mutating=True)
    async def DeregisterWorker(self, request, context):
        await self.service.deregister_worker(require(request.worker_id, "worker_id"))
        return common_pb2.Ack(applied=True)

    @rpc()
    async def GetStats(self, request, context):
        return self.service.stats()

    # --- the gateway's stream -------------------------------------------------------------------
    @rpc()
    async def Session(self, request_iterator, context):
        """Apply each batch's messages in order; answer its Routes and failures in one batch.

        Batches that arrived while the last ones were being saved are taken together: their messages
        are applied in order, saved once and answered in one write (under load a Route would
        otherwise wait for one Redis round trip per batch ahead of it; with ~3 messages a batch the
        quickstart's scheduler spent 60% of its session saving, and a Route waited ~64 ms).
        A message that fails gets a StreamError with its seq and the status code the unary RPC
        would have returned; the stream stays open. Reports are acknowledged by `processed_seq` on
        the next answer batch, or after ACK_IDLE_S when no answer comes, so a reconnecting gateway
        knows what to send again (and the replay window makes a resent message harmless).
        """
        lock = asyncio.Lock()
        processed = acked = 0
        acker: asyncio.Task | None = None
        arrived: asyncio.Queue = asyncio.Queue()
        room = asyncio.Event()
        ended = object()
        waiting = 0  # bytes of the batches in `arrived`

        async def write(answers: list) -> None:
            nonlocal acked
            async with lock:
                acked = processed
                await context.write(scheduler_pb2.SchedulerBatch(processed_seq=processed, answers=answers))

        async def acknowledge_later() -> None:
            await asyncio.sleep(ACK_IDLE_S)
            if processed > acked:
                await write([])

        async def read() -> None:
            nonlocal waiting
            try:
                async for batch in request_iterator:
                    while waiting >= MAX_WAITING_BYTES:  # (0 when none waits: a batch of any size is read)
                        room.clear()
                        await room.wait()
                    waiting += batch.ByteSize()
                    arrived.put_nowait(batch)
            finally:
                arrived.put_nowait(ended)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            done = False
            while not done:
                batches = [await arrived.get()]
                while not arrived.empty():
                    batches.append(arrived.get_nowait())
                waiting = 0
                room.set()
                done = batches[-1] is ended
                messages = [message for batch in batches if batch is not ended for message in batch.messages]
                answers = []
                for message in messages:
                    answer = await self._apply(message)
                    if answer is not None:
                        answers.append(answer)
                await self.service.persist()  # saved before anything of these batches is answered or acked
                if messages:
                    processed = messages[-1].seq
                if answers:
                    await write(answers)
                elif processed > acked and (acker is None or acker.done()):
                    acker = asyncio.get_running_loop().create_task(acknowledge_later())
            await reader  # a broken stream's error, if that is how it ended
        finally:
            reader.cancel()
            if acker is not None:
                acker.cancel()

    async def _apply(self, message) -> scheduler_pb2.SchedulerMessage | None:
        """One session message: its answer (a Route's decision, or an error), or None for a report.

        It goes through the boundary as the unary RPC of its kind would (same run and request-id
        checks, same replay scope)."""
        kind = message.WhichOneof("body")
        try:
            if kind == "route":
                decision = await apply(self, "Route", message.route, lambda: self._route(message.route))
                self._keep_reply("Route", message.route, decision)
                return scheduler_pb2.SchedulerMessage(seq=message.seq, route=decision)
            if kind not in self._reports:
                raise InvalidArgument("GatewayMessage.body is empty: set route, turn, tool_return or finish")
            name, handler = self._reports[kind]
            report = getattr(message, kind)
            self._keep_reply(name, report, await apply(self, name, report, lambda: handler(report)))
            return None
        except Exception as error:  # noqa: BLE001 - answered on the stream, the session goes on
            code = status_code(error)
            if code == grpc.StatusCode.INTERNAL:
                _log.exception("session message failed", kind=kind)
            return scheduler_pb2.SchedulerMessage(seq=message.seq, error=scheduler_pb2.StreamError(
                code=code.name, message=str(error) or type(error).__name__))
