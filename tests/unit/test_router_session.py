"""Ordering inside the gateway's scheduler session, with a stream whose writes we hold and release.

The real-gRPC behaviour is tested in tests/service/test_scheduler_session.py; this drives the one
interleaving that is hard to hit there: a message numbered while the session is (re)sending what
was not acknowledged, on a slow stream.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from libra.errors import Unavailable
from libra.services.rollout import router
from libra.services.rollout.router import SchedulerSession
from libra.v1 import scheduler_pb2 as spb


async def _spin(turns: int) -> None:
    """Let the event loop run `turns` rounds (the session's tasks advance by that much)."""
    for _ in range(turns):
        await asyncio.sleep(0)


class HeldCall:
    """A stream-stream call whose writes block until released; answers are pushed by the test."""

    def __init__(self):
        self.written: list[int] = []
        self.writes = 0
        self.gate = asyncio.Event()
        self.answers: asyncio.Queue = asyncio.Queue()

    async def write(self, batch):
        await self.gate.wait()
        self.written.extend(m.seq for m in batch.messages)
        self.writes += 1

    def cancel(self):
        self.answers.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self):
        answer = await self.answers.get()
        if answer is None:
            raise StopAsyncIteration
        return answer


class Stub:
    def __init__(self):
        self.calls: list[HeldCall] = []

    def Session(self):
        self.calls.append(HeldCall())
        return self.calls[-1]


def test_a_message_numbered_during_the_resend_is_written_once_in_order():
    async def scenario():
        stub = Stub()
        session = SchedulerSession(stub)
        first = asyncio.ensure_future(session.request(route=spb.RouteRequest(trajectory_id="a")))
        await _spin(5)  # the session task opens the stream and starts resending seq 1 (held)
        session.post(turn=spb.TurnReport(trajectory_id="a", worker_id="w"))  # seq 2
        second = asyncio.ensure_future(session.request(route=spb.RouteRequest(trajectory_id="b")))  # seq 3
        await _spin(5)
        call = stub.calls[0]
        call.gate.set()
        await _spin(20)
        assert call.written == [1, 2, 3]  # each once, in seq order
        assert call.writes == 2  # the resend of seq 1, then 2 and 3 together in one batch
        call.answers.put_nowait(spb.SchedulerBatch(processed_seq=1, answers=[
            spb.SchedulerMessage(seq=1, route=spb.RouteDecision(worker_id="w"))]))
        call.answers.put_nowait(spb.SchedulerBatch(processed_seq=3, answers=[
            spb.SchedulerMessage(seq=3, route=spb.RouteDecision(worker_id="w"))]))
        assert (await asyncio.wait_for(first, 5)).route.worker_id == "w"
        assert (await asyncio.wait_for(second, 5)).route.worker_id == "w"
        assert await session.flush(1.0)
        await session.close()
    asyncio.run(scenario())


def test_unacknowledged_messages_are_resent_in_order_on_a_new_stream():
    async def scenario():
        stub = Stub()
        session = SchedulerSession(stub)
        session.post(turn=spb.TurnReport(trajectory_id="a", worker_id="w"))
        pending = asyncio.ensure_future(session.request(route=spb.RouteRequest(trajectory_id="a")))
        await _spin(5)
        stub.calls[0].gate.set()
        await _spin(10)
        assert stub.calls[0].written == [1, 2]
        stub.calls[0].answers.put_nowait(spb.SchedulerBatch(processed_seq=1))  # the report was applied
        stub.calls[0].answers.put_nowait(None)  # then the stream ends (a scheduler restart)
        while len(stub.calls) < 2:
            await asyncio.sleep(0.01)
        stub.calls[1].gate.set()
        await _spin(10)
        assert stub.calls[1].written == [2]  # only what was not acknowledged
        stub.calls[1].answers.put_nowait(spb.SchedulerBatch(processed_seq=2, answers=[
            spb.SchedulerMessage(seq=2, route=spb.RouteDecision(worker_id="w2"))]))
        assert (await asyncio.wait_for(pending, 5)).route.worker_id == "w2"
        await session.close()
    asyncio.run(scenario())


def test_a_report_posted_while_the_flusher_writes_is_not_stranded():
    async def scenario():
        stub = Stub()
        session = SchedulerSession(stub)
        first = asyncio.ensure_future(session.request(route=spb.RouteRequest(trajectory_id="a")))
        await _spin(5)
        call = stub.calls[0]
        call.gate.set()
        await _spin(10)
        call.gate.clear()  # writes hold again
        session.post(turn=spb.TurnReport(trajectory_id="a", worker_id="w"))  # seq 2: the flusher starts writing
        await _spin(5)
        session.post(tool_return=spb.ToolReturnReport(trajectory_id="a", tool="t"))  # seq 3, during that write
        writes, messages = router.WRITES._value.get(), router.WRITTEN._value.get()
        call.gate.set()
        await _spin(20)
        assert call.written == [1, 2, 3]
        # the metrics count stream writes and the messages they carried (seq 2's write, then seq 3's)
        assert router.WRITES._value.get() - writes == call.writes - 1
        assert router.WRITTEN._value.get() - messages == 2
        call.answers.put_nowait(spb.SchedulerBatch(processed_seq=3, answers=[
            spb.SchedulerMessage(seq=1, route=spb.RouteDecision(worker_id="w"))]))
        await asyncio.wait_for(first, 5)
        assert await session.flush(1.0)
        await session.close()
    asyncio.run(scenario())


class BrokenStub:
    """Every Session it opens fails at once, as against a scheduler that is down."""

    def __init__(self):
        self.opened = 0

    def Session(self):
        self.opened += 1
        return BrokenCall()


class BrokenCall:
    async def write(self, batch):
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "connection refused")

    def cancel(self):
        pass


def test_a_session_that_cannot_reconnect_gives_up_and_fails_its_waiters(monkeypatch):
    monkeypatch.setattr(router, "RETRY_FOR_S", 0.5)

    async def scenario():
        stub = BrokenStub()
        session = SchedulerSession(stub)
        loop = asyncio.get_running_loop()
        started = loop.time()
        session.post(turn=spb.TurnReport(trajectory_id="a", worker_id="w"))
        waiter = loop.create_future()
        session._waiters[99] = waiter  # a Route waiting for its answer
        await asyncio.wait_for(session._task, 5)
        assert loop.time() - started >= 0.5  # it kept reopening the stream, with backoff, for RETRY_FOR_S
        assert stub.opened >= 3 and not session._unacked  # then gave up: nothing kept for a resend
        with pytest.raises(Unavailable, match="scheduler unavailable for 0s"):
            waiter.result()
        await session.close()
    asyncio.run(scenario())
