"""The gateway's turn records (Redis history:turn, what the planner calibrates from), written off the turn's path.

A turn used to wait for its record's XADD before its tool ran (8 ms a turn in the quickstart on
2 cores). Now `add` queues the record and returns; one task writes what has queued, in order, one
pipeline per round, so under load many turns share a round trip. `flush` (the gateway's drain and
close) waits until everything queued is written. While Redis is unreachable the records wait and the
task retries with a backoff; past `limit` waiting records the oldest are dropped and counted
(`libra_rollout_history_dropped_total`): the history is the planner's sample of the run, not work,
and no trajectory waits for it. A gateway killed outright loses what had not been written yet
(at most a round's worth: milliseconds).
"""

from __future__ import annotations

import asyncio

from prometheus_client import Counter

from libra import log as liblog
from libra.errors import LibraError
from libra.rpc import Backoff
from libra.v1 import common_pb2

_log = liblog.get("libra.rollout.history")
DROPPED = Counter("libra_rollout_history_dropped_total", "turn records dropped while Redis could not take them")


class HistoryWriter:
    def __init__(self, store, kind: str = "turn", limit: int = 100_000, max_backoff_s: float = 5.0):
        self.store, self.kind, self.limit, self.max_backoff_s = store, kind, limit, max_backoff_s
        self._pending: list[common_pb2.HistoryRecord] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self.written = self.dropped = 0

    def add(self, record: common_pb2.HistoryRecord) -> None:
        """Queue a record (never waits)."""
        self._pending.append(record)
        self._drop_oldest(len(self._pending) - self.limit)
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"history-{self.kind}")

    async def _run(self) -> None:
        backoff = Backoff(first_s=0.05, max_s=self.max_backoff_s, factor=2.0)
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await self.store.append_histories(self.kind, batch)
                except LibraError as error:  # a record the store refuses: retrying cannot help
                    self._count_dropped(len(batch))
                    _log.error("turn records refused; dropped", records=len(batch), error=str(error))
                    continue
                except Exception as error:  # noqa: BLE001 - Redis away: keep them, in order, and retry
                    self._pending[:0] = batch
                    self._drop_oldest(len(self._pending) - self.limit)
                    _log.warning("turn records not written; retrying", waiting=len(self._pending),
                                 retry_in_s=backoff.delay_s, error=str(error))
                    await backoff.wait("Redis to take the turn records")
                    continue
                backoff.reset()
                self.written += len(batch)
            self._idle.set()

    def _drop_oldest(self, count: int) -> None:
        """Past `limit` waiting records: the oldest `count` go (none when count <= 0)."""
        if count > 0:
            del self._pending[:count]
            self._count_dropped(count)

    def _count_dropped(self, count: int) -> None:
        self.dropped += count
        DROPPED.inc(count)

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued record is written; False if `timeout_s` passed first."""
        if self._task is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self, timeout_s: float = 5.0) -> None:
        """Flush, then stop the task; what could not be written in time is logged as lost."""
        if not await self.flush(timeout_s):
            _log.warning("turn records lost at close", records=len(self._pending))
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
