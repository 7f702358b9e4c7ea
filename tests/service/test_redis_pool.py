"""A service's Redis client under more concurrent commands than it has connections (a gateway playing
hundreds of trajectories at once, each awaiting its own command): the commands wait for a free
connection; none fails with redis-py's "Too many connections"."""

from __future__ import annotations

import asyncio

from libra.state.redis_store import MAX_CONNECTIONS, retrying_client


def test_commands_beyond_the_pool_wait_for_a_connection_instead_of_failing(redis_url, run_id, arun):
    async def storm() -> tuple[list, int, int]:
        client, probe = retrying_client(redis_url), retrying_client(redis_url, max_connections=2)
        try:
            before = (await probe.info("clients"))["connected_clients"]
            # each BLPOP holds its connection for 0.3 s: 1.5x the pool's connections at once
            calls = [client.blpop([f"{run_id}:empty"], timeout=0.3) for _ in range(MAX_CONNECTIONS * 3 // 2)]
            gathered = asyncio.gather(*calls)
            await asyncio.sleep(0.15)
            during = (await probe.info("clients"))["connected_clients"]
            return await gathered, before, during
        finally:
            await client.aclose()
            await probe.aclose()

    results, before, during = arun(storm())
    assert results == [None] * (MAX_CONNECTIONS * 3 // 2)  # every call ran to its timeout: none failed
    assert during - before <= MAX_CONNECTIONS  # the client never held more than its pool
