"""The engine client's HTTP failures, each mapped to the error the gateway acts on, against a real
aiohttp server: a worker that fails (5xx), is unreachable, answers late or answers garbage is
`EngineError` (retry the turn elsewhere); a request it rejects (4xx) is `EngineRequestError`."""

from __future__ import annotations

import asyncio
import pathlib
import socket

import pytest
from aiohttp import web

from libra.services.rollout.engines.client import (GENERATE_PATH, EngineClient, EngineError,
                                                   EngineRequestError)

ANSWER = {"choices": [{"token_ids": [5, 6], "finish_reason": "stop", "logprobs": {"content": [{"logprob": -0.1}] * 2},
                       "weight_versions": [{"version": "4", "start": 0, "end": 2}]}]}


async def serving(mode: dict):
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        mode["seen"] = body
        kind = mode.get("kind", "ok")
        if kind == "slow":
            await asyncio.sleep(5)
        if kind == "timed":  # a request takes as long as its prompt's first id says, in tenths of a second
            await asyncio.sleep(body["token_ids"][0] / 10)
        if kind == "5xx":
            return web.json_response({"error": {"message": "engine died"}}, status=503)
        if kind == "4xx":
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        if kind == "garbage":
            return web.Response(text="<html>proxy error</html>")
        if kind == "batched":  # the hf engine's answer: the batch its tokens were sampled in
            return web.json_response({"choices": [{**ANSWER["choices"][0], "decode_batch": 5.2}]})
        return web.json_response(ANSWER)

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if mode.get("healthy", True) else 503)

    app = web.Application()
    app.add_routes([web.post(GENERATE_PATH, generate), web.get("/health", health)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_each_failure_maps_to_the_error_the_gateway_acts_on():
    async def main():
        mode: dict = {}
        runner, port = await serving(mode)
        try:
            async with EngineClient(f"http://127.0.0.1:{port}", timeout_s=1.0) as client:
                done = await client.generate([1, 2, 3], 2, seed=7)
                assert done.token_ids == [5, 6] and done.versions == [4, 4]
                assert done.engine_batch == 0.0  # vLLM reports no batch
                assert mode["seen"]["token_ids"] == [1, 2, 3] and mode["seen"]["sampling_params"]["seed"] == 7
                mode["kind"] = "batched"
                assert (await client.generate([1, 2, 3], 2)).engine_batch == 5.2
                mode["kind"] = "ok"
                assert await client.health()
                for kind, error, words in (("5xx", EngineError, "failed (503): engine died"),
                                           ("4xx", EngineRequestError, "rejected the request (400): prompt too long"),
                                           ("garbage", EngineError, "answered non-JSON"),
                                           ("slow", EngineError, "timed out")):
                    mode["kind"] = kind
                    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
                        await client.generate([1], 2)
                mode["healthy"] = False
                assert not await client.health()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_an_unreachable_worker_is_an_engine_error_and_a_client_serves_another_loop():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    client = EngineClient(f"http://127.0.0.1:{closed}", timeout_s=2.0, connect_timeout_s=1.0)

    async def refused():
        with pytest.raises(EngineError, match="unreachable"):
            await client.generate([1], 2)
        assert not await client.health()
        await client.close()  # (a session belongs to its loop: close it before the loop ends)

    async def later():  # the same client on a new event loop: a session of that loop
        runner, port = await serving({})
        try:
            client.base_url = f"http://127.0.0.1:{port}"
            assert (await client.generate([1], 2)).token_ids == [5, 6]
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(refused())
    asyncio.run(later())


def test_the_pool_reports_each_turns_mean_batch_over_its_span():
    """Three requests start together on one worker; two end at 0.2 s, one at 0.4 s. The short ones
    saw 3 in flight all along; the long one 3 for half its span and 1 for the other half: 2. The
    worker's busy seconds (a request in flight) grow by the 0.4 s the three overlap in, not 0.8,
    and not at all while it idles."""
    from libra.services.rollout.config import WorkerConfig
    from libra.services.rollout.workers import PoolWorker, WorkerPool
    from libra.v1 import common_pb2

    class Process:
        engine, base_url, alive = "aiohttp", "", True

    async def main():
        runner, port = await serving({"kind": "timed"})
        client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=5.0)
        pool = WorkerPool(WorkerConfig(), pathlib.Path("unused"))
        pool.workers["w"] = PoolWorker("w", "all", 1, Process(), client, state=common_pb2.WORKER_STATE_SERVING)
        sampling = {"temperature": 1.0, "top_p": 1.0}
        try:
            await client.generate([0], 1)  # the session opened before timing
            before = pool.workers["w"].busy_seconds()
            done = await asyncio.gather(*(pool.generate("w", [tenths], 1, 0, sampling, []) for tenths in (4, 2, 2)))
            busy = pool.workers["w"].busy_seconds() - before
            await asyncio.sleep(0.2)
            idle = pool.workers["w"].busy_seconds() - before - busy
        finally:
            await client.close()
            await runner.cleanup()
        return [d.batch for d in done], pool.workers["w"].inflight, busy, idle

    (long, short1, short2), inflight, busy, idle = asyncio.run(main())
    assert inflight == 0 and 0.4 <= busy < 0.6 and idle == 0.0, (busy, idle)
    assert short1 == pytest.approx(3.0, abs=0.3) and short2 == pytest.approx(3.0, abs=0.3)
    assert long == pytest.approx(2.0, abs=0.3)
