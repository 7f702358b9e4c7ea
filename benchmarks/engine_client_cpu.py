"""CPU the rollout gateway spends per engine request: Libra's `EngineClient` (aiohttp) against the
same client over httpx (what it used before), side by side in one process.

The gateway sends every turn of every trajectory to an engine worker through
`services/rollout/engines/client.py`; a profile of the quickstart found 45% of the gateway's CPU in
httpx and 28% in its connection pool's bookkeeping. Both clients here run the same `generate` (the
request body, the answer's checks, the token versions); only the transport differs. The worker is a
stand-in in its own process (an aiohttp server answering a 48-token generation after 2 ms), so that
this process's CPU time is the client's alone.

    .venv/bin/python benchmarks/engine_client_cpu.py [--requests 3000] [--concurrency 8 64] [--rounds 2]

Prints microseconds of CPU per request for each client at each concurrency, interleaved rounds,
and the ratio httpx / aiohttp of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from libra.services.rollout.engines.client import GENERATE_PATH, EngineClient, EngineError  # noqa: E402

TOKENS = 48
ANSWER = {"choices": [{"token_ids": list(range(TOKENS)), "finish_reason": "stop",
                       "logprobs": {"content": [{"logprob": -0.5}] * TOKENS},
                       "weight_versions": [{"version": "3", "start": 0, "end": TOKENS}]}]}


def serve(port: int) -> None:
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        await request.json()
        await asyncio.sleep(0.002)
        return web.json_response(ANSWER)

    app = web.Application()
    app.add_routes([web.post(GENERATE_PATH, generate)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


class HttpxEngineClient(EngineClient):
    """`EngineClient` with its transport on httpx, pooled as the gateway's was (keep-alive 64)."""

    def __init__(self, base_url: str):
        super().__init__(base_url)
        self._httpx = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                                        headers=self._headers,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def _request(self, method, path, body, timeout):
        try:
            response = await self._httpx.request(method, self.base_url + path, json=body)
        except httpx.HTTPError as error:
            raise EngineError(f"{self.base_url}{path} unreachable: {error!r}") from error
        return response.status_code, response.content

    async def close(self) -> None:
        await self._httpx.aclose()


async def cpu_per_request(client: EngineClient, requests: int, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)
    prompt = list(range(200))

    async def one() -> None:
        async with gate:
            generation = await client.generate(prompt, TOKENS, seed=1)
            assert len(generation.token_ids) == TOKENS and generation.versions[-1] == 3

    try:
        await asyncio.gather(*(one() for _ in range(min(200, requests))))  # connections open, code warm
        started = time.process_time()
        await asyncio.gather(*(one() for _ in range(requests)))
        return (time.process_time() - started) / requests
    finally:
        await client.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    try:
        for concurrency in args.concurrency:
            seen: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
            for _ in range(args.rounds):
                for name, make in (("httpx", HttpxEngineClient), ("aiohttp", EngineClient)):
                    seconds = asyncio.run(cpu_per_request(make(url), args.requests, concurrency))
                    seen[name].append(seconds)
                    print(f"concurrency {concurrency:3d}  {name:8s} {seconds * 1e6:7.0f} us CPU per request",
                          flush=True)
            base, new = statistics.median(seen["httpx"]), statistics.median(seen["aiohttp"])
            print(f"concurrency {concurrency:3d}  httpx / aiohttp = {base / new:.2f}x  "
                  f"(medians {base * 1e6:.0f} / {new * 1e6:.0f} us)", flush=True)
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
