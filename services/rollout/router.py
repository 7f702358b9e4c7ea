"""The scheduler as the agent runner sees it.

Per-turn traffic (Route and the three reports) goes over one long-lived `Session` stream per
gateway: a message on an open stream costs a fraction of a unary call in Python gRPC, which is
what keeps the scheduler's share of a turn under a millisecond with a thousand trajectories in
flight (benchmarks/scheduler_grpc_latency.py). Only a Route is waited for; a report returns once
it is queued for sending, in order behind everything sent before it, so the scheduler always
sees a turn's report before that trajectory's next Route.

Nothing is lost when the scheduler restarts: every message keeps a request id and a seq until the
scheduler acknowledges it (`processed_seq`); on a broken stream the router reconnects with
backoff (`libra.rpc.Backoff`: gRPC never retries a stream that has answered) and sends the
unacknowledged messages again, in order, with their ids, and the scheduler's replay window
applies each once. Registration and stats stay unary (rare, and grpcurl-shaped); gRPC retries
them itself (the channel's service config, `libra.rpc.channel`), and waits for a scheduler that
is not up yet when the channel was made with `wait_for_ready=True`.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import OrderedDict, deque

import grpc
from prometheus_client import Counter

from libra import log as liblog
from libra.errors import FailedPrecondition, InvalidArgument, LibraError, NotFound, Unavailable
from libra.rpc import Backoff
from libra.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

RETRY_FOR_S = 60.0
"""A unary call's deadline, and how long a broken session keeps reconnecting before giving up."""
RESEND_BATCH = 1000  # messages per stream write when a reconnect resends what was not acknowledged
SESSION_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.CANCELLED,  # a scheduler shutting down cancels its streams
                     grpc.StatusCode.INTERNAL)  # "Internal error from Core": a stream cut by a killed scheduler
ERRORS = {"INVALID_ARGUMENT": InvalidArgument, "NOT_FOUND": NotFound, "FAILED_PRECONDITION": FailedPrecondition,
          "UNAVAILABLE": Unavailable, "DEADLINE_EXCEEDED": Unavailable}
_log = liblog.get("libra.rollout.router")
REPORT_ERRORS = Counter("libra_gateway_report_errors_total", "scheduler reports rejected on the session", ["code"])
RECONNECTS = Counter("libra_gateway_session_reconnects_total", "scheduler session streams reopened")
WRITES = Counter("libra_gateway_session_writes_total", "writes on the scheduler session stream (each a batch)")
WRITTEN = Counter("libra_gateway_session_messages_total", "messages written on the scheduler session stream")


class SchedulerSession:
    """One `Session` stream, reopened when it breaks; messages stay kept until acknowledged.

    Every message is numbered and queued in one deque, so the queue is in seq order; writers take
    from its head only, under a lock, so the stream carries messages in seq order. A Route's caller
    writes through to its own message and waits for the answer; a report is posted (the caller
    goes on) and written by a flusher task or by the next Route, whichever comes first. A
    background task reads answers and, when the stream breaks, reopens it and resends what the
    scheduler has not acknowledged.
    """

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub):
        self._stub = stub
        self._seq = itertools.count(1)
        self._unacked: OrderedDict[int, scheduler_pb2.GatewayMessage] = OrderedDict()
        self._waiters: dict[int, asyncio.Future] = {}
        self._lock = asyncio.Lock()
        self._pending: deque[scheduler_pb2.GatewayMessage] = deque()  # numbered, not yet written
        self._flusher: asyncio.Task | None = None
        self._call = None          # the open stream, None while (re)connecting
        self._written = 0          # highest seq written on self._call
        self._task: asyncio.Task | None = None
        self._closed = False

    def _keep(self, body: dict, answer: asyncio.Future | None) -> scheduler_pb2.GatewayMessage:
        """Number a message and queue it for the stream; the queue is in seq order."""
        if self._closed:
            raise Unavailable("the scheduler session is closed")
        seq = next(self._seq)
        message = scheduler_pb2.GatewayMessage(seq=seq, **body)
        self._unacked[seq] = message
        self._pending.append(message)
        if answer is not None:
            self._waiters[seq] = answer
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="scheduler-session")
        return message

    def post(self, **body) -> int:
        """Queue a report (turn=, tool_return= or finish=) without waiting; returns its seq.

        It goes onto the stream ahead of anything sent after it; the gateway's turn does not wait
        for the write."""
        message = self._keep(body, None)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._write_through(None))
        return message.seq

    async def send(self, answer: asyncio.Future | None = None, **body) -> int:
        """Send one message now (after everything queued before it); returns its seq.

        Returns once the message is on the stream, or kept for the reconnect to resend; `answer`,
        if given, receives the scheduler's answer to it."""
        message = self._keep(body, answer)
        await self._write_through(message.seq)
        return message.seq

    async def _write_through(self, seq: int | None) -> None:
        """Write queued messages from the head as batches (under load many messages share one
        stream write): up to `seq` and whatever queued behind it meanwhile, or, for the flusher
        (seq None), until nothing is left, messages posted during a write included."""
        async with self._lock:
            while self._pending and (seq is None or self._pending[0].seq <= seq):
                batch = [m for m in self._take_pending() if m.seq > self._written]
                call = self._call
                if call is None or not batch:
                    continue  # no stream: the reconnect resends them from the unacknowledged
                try:
                    await call.write(scheduler_pb2.GatewayBatch(messages=batch))
                    WRITES.inc()
                    WRITTEN.inc(len(batch))
                    self._written = batch[-1].seq
                except Exception:  # noqa: BLE001 - the stream broke; the reader reconnects and resends
                    self._call = None

    def _take_pending(self) -> list[scheduler_pb2.GatewayMessage]:
        taken = list(self._pending)
        self._pending.clear()
        return taken

    async def request(self, **body) -> scheduler_pb2.SchedulerMessage:
        """Send a message that the scheduler answers (a Route) and wait for the answer."""
        future = asyncio.get_running_loop().create_future()
        seq = await self.send(answer=future, **body)
        try:
            return await asyncio.wait_for(future, RETRY_FOR_S)
        except asyncio.TimeoutError as error:
            raise Unavailable(f"no answer from the scheduler within {RETRY_FOR_S:.0f}s") from error
        finally:
            self._waiters.pop(seq, None)

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the scheduler has acknowledged everything sent; False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._unacked and self._task is not None and not self._task.done() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return not self._unacked

    async def close(self) -> None:
        self._closed = True
        for task in (self._task, self._flusher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._fail_all(Unavailable("the scheduler session was closed"))

    async def _run(self) -> None:
        backoff = Backoff(first_s=0.05, max_s=2.0, factor=2.0, give_up_s=RETRY_FOR_S)
        while True:
            call = self._stub.Session()
            try:
                async with self._lock:
                    resend = list(self._unacked.values())  # not confirmed by any stream yet, in order
                    for start in range(0, len(resend), RESEND_BATCH):
                        chunk = resend[start:start + RESEND_BATCH]
                        await call.write(scheduler_pb2.GatewayBatch(messages=chunk))
                        self._written = chunk[-1].seq
                    while self._pending and self._pending[0].seq <= self._written:
                        self._pending.popleft()  # just resent; anything newer is still to write, in order
                    self._call = call
                async for answer in call:
                    backoff.reset()
                    self._handle(answer)
                error = None
            except grpc.aio.AioRpcError as rpc_error:
                error = rpc_error
            except asyncio.InvalidStateError:  # the new stream ended before the resend: the scheduler is down
                error = None
            finally:
                self._call = None
                call.cancel()
            if error is not None and error.code() not in SESSION_RETRYABLE:
                self._fail_all(LibraError(f"scheduler session failed: {error.code().name}: {error.details()}"))
                return
            RECONNECTS.inc()
            _log.warning("scheduler session broken; reconnecting", unacknowledged=len(self._unacked),
                         error=error.code().name if error is not None else "stream ended")
            try:
                await backoff.wait("the scheduler's session stream")
            except TimeoutError:
                self._fail_all(Unavailable(f"scheduler unavailable for {RETRY_FOR_S:.0f}s"))
                return

    def _handle(self, batch: scheduler_pb2.SchedulerBatch) -> None:
        while self._unacked and next(iter(self._unacked)) <= batch.processed_seq:
            self._unacked.popitem(last=False)
        for answer in batch.answers:
            self._unacked.pop(answer.seq, None)
            future = self._waiters.get(answer.seq)
            if answer.WhichOneof("body") == "error":
                error = ERRORS.get(answer.error.code, LibraError)(answer.error.message)
                if future is not None and not future.done():
                    future.set_exception(error)
                elif answer.error.code != "NOT_FOUND":
                    # NOT_FOUND on a report: sent again after a scheduler restart for a trajectory that
                    # had finished meanwhile (its finish was applied and saved): expected, nothing lost.
                    REPORT_ERRORS.labels(answer.error.code).inc()
                    _log.warning("scheduler rejected a report", code=answer.error.code, reason=answer.error.message)
            elif future is not None and not future.done():
                future.set_result(answer)

    def _fail_all(self, error: Exception) -> None:
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(error)
        if self._unacked:
            _log.error("scheduler session gave up", unacknowledged=len(self._unacked), error=str(error))
        self._unacked.clear()
        self._pending.clear()


class SchedulerRouter:
    """The gateway's scheduler: Routes and reports on the session, registration unary.

    Give it a channel from `libra.rpc.channel(address, wait_for_ready=True)`: its unary calls then
    wait up to RETRY_FOR_S for a scheduler that is restarting, with gRPC's retries."""

    def __init__(self, channel, run_id: str):
        self.stub = scheduler_pb2_grpc.SchedulerStub(channel)
        self.session = SchedulerSession(self.stub)
        self.run_id = run_id

    @staticmethod
    async def _unary(call) -> None:
        try:
            await call
        except grpc.aio.AioRpcError as error:
            raise ERRORS.get(error.code().name, LibraError)(
                f"scheduler: {error.code().name} {error.details() or ''}".rstrip()) from error

    def _meta(self) -> common_pb2.RequestMeta:
        return common_pb2.RequestMeta(request_id=uuid.uuid4().hex, run_id=self.run_id)

    async def route(self, trajectory_id: str, prompt_id: str, turn: int, prompt_tokens: int, max_new_tokens: int,
                    exclude: list[str]) -> scheduler_pb2.RouteDecision:
        request = scheduler_pb2.RouteRequest(meta=self._meta(), trajectory_id=trajectory_id, prompt_id=prompt_id,
                                             turn=turn, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                                             exclude_workers=exclude)
        return (await self.session.request(route=request)).route

    async def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int, seconds: float,
                        failed: bool) -> None:
        if not worker_id:
            raise InvalidArgument("worker_id is required")
        self.session.post(turn=scheduler_pb2.TurnReport(
            meta=self._meta(), trajectory_id=trajectory_id, worker_id=worker_id, output_tokens=output_tokens,
            seconds=seconds, failed=failed))

    async def tool_returned(self, trajectory_id: str, tool: str, status: int, payload_tokens: int) -> None:
        if status == common_pb2.TOOL_STATUS_UNSPECIFIED or not tool:
            raise InvalidArgument("a tool return needs the tool's name and its structured status "
                                  f"(got tool={tool!r}, status={status})")
        self.session.post(tool_return=scheduler_pb2.ToolReturnReport(
            meta=self._meta(), trajectory_id=trajectory_id, tool=tool, status=status,
            payload_tokens=payload_tokens))

    async def finished(self, trajectory_id: str, prompt_id: str, output_tokens: int, status: int) -> None:
        self.session.post(finish=scheduler_pb2.FinishReport(
            meta=self._meta(), trajectory_id=trajectory_id, prompt_id=prompt_id, output_tokens=output_tokens,
            status=status))

    async def register(self, worker: common_pb2.WorkerInfo) -> None:
        request = scheduler_pb2.RegisterWorkerRequest(meta=self._meta(), worker=worker)
        await self._unary(self.stub.RegisterWorker(request, timeout=RETRY_FOR_S))

    async def deregister(self, worker_id: str) -> None:
        request = scheduler_pb2.DeregisterWorkerRequest(meta=self._meta(), worker_id=worker_id)
        await self._unary(self.stub.DeregisterWorker(request, timeout=RETRY_FOR_S))

    async def close(self, flush_timeout_s: float = 5.0) -> None:
        """Send what is queued (the last trajectories' reports), then end the session."""
        if not await self.session.flush(flush_timeout_s):
            _log.warning("closing the scheduler session with unacknowledged reports",
                         unacknowledged=len(self.session._unacked))
        await self.session.close()
