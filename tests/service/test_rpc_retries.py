"""Retries declared once, in the channel's service config (`libra.rpc.channel`), on real gRPC:
UNAVAILABLE is retried by gRPC itself, `wait_for_ready` waits for a peer that is not up yet,
health checks and other codes are not retried, and `Backoff` (the one helper for what the service
config cannot do) grows, gives up, and starts over after progress."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from libra.redis_server import free_port
from libra.rpc import RETRY_POLICY, Backoff, channel, peer_serving, service_config, wire_services
from libra.v1 import trainer_pb2, trainer_pb2_grpc


class FlakyTrainer(trainer_pb2_grpc.TrainerServicer):
    """GetStatus answers `code` for its first `failures` calls, then a status."""

    def __init__(self, failures: int, code=grpc.StatusCode.UNAVAILABLE):
        self.failures, self.code, self.calls = failures, code, 0

    async def GetStatus(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            await context.abort(self.code, f"attempt {self.calls} fails")
        return trainer_pb2.TrainerStatus(step=self.calls)


async def _serve(servicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def test_the_service_config_names_every_unary_rpc_and_no_stream():
    config = json.loads(service_config(False))
    (method_config,) = config["methodConfig"]
    names = {(n["service"], n["method"]) for n in method_config["name"]}
    unary = {(s.full_name, m.name) for s in wire_services() for m in s.methods
             if not m.client_streaming and not m.server_streaming}
    assert names == unary and ("libra.v1.Scheduler", "Session") not in names
    assert method_config["retryPolicy"] == RETRY_POLICY and "waitForReady" not in method_config
    assert json.loads(service_config(True))["methodConfig"][0]["waitForReady"] is True


def test_unavailable_is_retried_by_grpc_and_other_codes_are_not(arun):
    async def scenario():
        flaky = FlakyTrainer(failures=2)
        server, port = await _serve(flaky)
        async with channel(f"127.0.0.1:{port}") as chan:
            status = await trainer_pb2_grpc.TrainerStub(chan).GetStatus(trainer_pb2.TrainerStatusRequest(), timeout=10)
        assert status.step == 3 and flaky.calls == 3  # two UNAVAILABLE answers, retried by gRPC
        refused = FlakyTrainer(failures=1, code=grpc.StatusCode.FAILED_PRECONDITION)
        server2, port2 = await _serve(refused)
        async with channel(f"127.0.0.1:{port2}") as chan:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await trainer_pb2_grpc.TrainerStub(chan).GetStatus(trainer_pb2.TrainerStatusRequest(), timeout=10)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION and refused.calls == 1
        await server.stop(0)
        await server2.stop(0)
    arun(scenario())


def test_wait_for_ready_waits_for_a_peer_that_starts_later(arun):
    port = free_port()

    async def scenario():
        async with channel(f"127.0.0.1:{port}", wait_for_ready=True) as chan:
            call = asyncio.ensure_future(trainer_pb2_grpc.TrainerStub(chan).GetStatus(
                trainer_pb2.TrainerStatusRequest(), timeout=20))
            await asyncio.sleep(1.0)
            assert not call.done()  # nothing listens yet: it waits instead of failing
            server, _ = await _serve(FlakyTrainer(failures=0), port)
            assert (await call).step == 1
        async with channel(f"127.0.0.1:{free_port()}") as chan:  # without it: UNAVAILABLE once retries run out
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await trainer_pb2_grpc.TrainerStub(chan).GetStatus(trainer_pb2.TrainerStatusRequest(), timeout=20)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not await peer_serving(f"127.0.0.1:{free_port()}", timeout_s=5)  # health: at once, no retries
        await server.stop(0)
    arun(scenario())


def test_backoff_grows_gives_up_and_starts_over_after_progress(arun):
    async def scenario():
        backoff = Backoff(first_s=0.01, max_s=0.04, factor=2.0, give_up_s=0.3)
        loop = asyncio.get_running_loop()
        delays = []
        for _ in range(4):
            delays.append(backoff.delay_s)
            await backoff.wait("a peer")
        assert delays == [0.01, 0.02, 0.04, 0.04]
        backoff.reset()  # progress: the clock and the delay start over
        assert backoff.delay_s == 0.01
        started = loop.time()
        with pytest.raises(TimeoutError, match="a peer"):
            while True:
                await backoff.wait("a peer")
        assert 0.3 <= loop.time() - started < 2.0
    arun(scenario())
