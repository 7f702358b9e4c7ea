"""The gateway's turn records written off the turn's path (services/rollout/history.py), against a real
Redis: every record written once and in order, a flush waits for them, Redis failing for a while
delays them without losing any (up to the limit, past which the oldest are dropped and counted)."""

from __future__ import annotations

import asyncio

import redis.exceptions

from libra.services.rollout.history import HistoryWriter
from libra.v1 import common_pb2


class Flaky:
    """The real store, whose history writes fail `failures` times first (Redis away for a while)."""

    def __init__(self, store, failures: int):
        self.store, self.failures, self.calls = store, failures, 0

    async def append_histories(self, kind, records):
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise redis.exceptions.ConnectionError("Connection refused")
        return await self.store.append_histories(kind, records)


def record(i: int) -> common_pb2.HistoryRecord:
    return common_pb2.HistoryRecord(kind="turn", output_tokens=i)


def test_records_are_written_in_order_and_a_flush_waits_for_them(store, arun):
    async def main():
        writer = HistoryWriter(store)
        for i in range(200):
            writer.add(record(i))
            if i % 50 == 0:
                await asyncio.sleep(0)  # let a round go out while more arrive
        assert await writer.flush(5.0)
        await writer.close()
        return writer
    writer = arun(main())
    assert writer.written == 200 and writer.dropped == 0
    assert [r.output_tokens for r in arun(store.read_history("turn", count=1000))] == list(range(200))


def test_redis_away_delays_the_records_and_past_the_limit_drops_the_oldest(store, arun):
    async def main():
        flaky = Flaky(store, failures=3)
        writer = HistoryWriter(flaky, limit=5, max_backoff_s=0.05)
        for i in range(3):
            writer.add(record(i))
        await asyncio.sleep(0.02)  # the first write has failed: they wait
        for i in range(3, 8):
            writer.add(record(i))
        assert await writer.flush(5.0)
        await writer.close()
        return writer, flaky
    writer, flaky = arun(main())
    assert flaky.calls >= 4 and writer.dropped == 3 and writer.written == 5
    assert [r.output_tokens for r in arun(store.read_history("turn", count=100))] == [3, 4, 5, 6, 7]


def test_records_the_store_refuses_are_dropped_and_counted_not_retried_forever(store, arun):
    async def main():
        writer = HistoryWriter(store)
        writer.add(common_pb2.HistoryRecord(kind="step", output_tokens=1))  # a turn writer given a step record
        assert await writer.flush(2.0)
        writer.add(record(2))
        assert await writer.flush(2.0)
        await writer.close()
        return writer
    writer = arun(main())
    assert (writer.dropped, writer.written) == (1, 1)
    assert [r.output_tokens for r in arun(store.read_history("turn", count=10))] == [2]
