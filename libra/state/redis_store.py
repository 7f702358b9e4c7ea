"""`StateStore`: the one async client of a run's Redis state, used by all five services.

Owns the connection lifecycle and small named records (the scheduler's tree and loads); the rest
of the key space is owned by the parts it is assembled from:

    StateStore ─┬─ TrajectoryStore  (trajectories.py)  trajectories, groups, completed-stream append
                ├─ CompletedStream  (completed.py)     consumer group: read, ack, reclaim
                ├─ VersionStore     (versions.py)      policy versions, weight paths, trainer progress
                ├─ RecordStore      (records.py)       runtime history, membership, plans
                ├─ ReplyStore       (replies.py)       request-id idempotency: claims, stored replies
                └─ StoreBase        (base.py)          client, keys, schema check, Lua, CAS records

Mutating RPCs get their once-per-request-id answer from the RPC boundary (`libra.boundary`, over
`ReplyStore`); see docs/rpc.md.

Redis outages: a store opened by `connect` retries every command on a lost connection, with
backoff (50 ms growing to 2 s), for as long as Redis is away: a call made during an outage waits
for Redis to come back instead of failing, so a restarted Redis (AOF: nothing acknowledged is
lost) is a pause, not a crash. `reachable()` is the quick check the service runtime uses to show
NOT_SERVING meanwhile; `after_outage()` re-checks the schema on the next call. Lua scripts are
loaded again by redis-py when a restarted Redis no longer knows them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libra.errors import Unavailable
from libra.state.base import VersionedRecord
from libra.state.completed import CompletedStream
from libra.state.keys import check_run_id
from libra.state.records import RecordStore
from libra.state.replies import ReplyStore
from libra.state.trajectories import TrajectoryStore
from libra.state.scheduler import SchedulerStore
from libra.state.versions import VersionStore

RETRY_BACKOFF = (0.05, 2.0)
"""First and longest wait between retries of a command while Redis is away (seconds)."""
PING_TIMEOUT_S = 2.0
"""How long `ping` (used when connecting) waits for an answer before saying Redis is not reachable."""
MAX_CONNECTIONS = 128
"""Connections one service's client opens at most; a command beyond them waits for a free one."""


def retrying_client(url: str, max_connections: int = MAX_CONNECTIONS) -> aioredis.Redis:
    """A client that retries every command on a lost connection, with backoff, without limit, over a
    pool of at most `max_connections` in which a command waits for a free connection.

    redis-py's default pool raises "Too many connections" past its 100th connection in use: a
    gateway playing more than ~100 trajectories at once (each awaiting its own Redis command) died
    of it. A blocking pool makes the limit a queue instead of an error."""
    first, longest = RETRY_BACKOFF
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, decode_responses=False,
        retry=Retry(ExponentialBackoff(cap=longest, base=first), -1),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, OSError])
    return aioredis.Redis.from_pool(pool)


class StateStore(TrajectoryStore, CompletedStream, VersionStore, RecordStore, ReplyStore, SchedulerStore):
    """All durable state of one run, over a `redis.asyncio.Redis` client (decode_responses=False)."""

    def __init__(self, redis: aioredis.Redis, run_id: str, *, clock: Callable[[], float] = time.time,
                 history_maxlen: int = 10_000, decisions_maxlen: int = 1_000) -> None:
        super().__init__(redis, run_id, clock=clock, history_maxlen=history_maxlen,
                         decisions_maxlen=decisions_maxlen)
        self._owns_client = False

    @classmethod
    async def connect(cls, url: str, run_id: str, **options: Any) -> StateStore:
        """Open a client for `url`, check the run's schema version, and return the store."""
        check_run_id(run_id)
        client = retrying_client(url)
        store = cls(client, run_id, **options)
        store._owns_client = True
        try:
            await store.ping()
        except BaseException:
            await client.aclose()
            raise
        return store

    async def ping(self, timeout_s: float = PING_TIMEOUT_S) -> None:
        """Check that Redis answers (within `timeout_s`) and the run's schema version matches;
        Unavailable if not reachable."""
        try:
            await asyncio.wait_for(self._ping_and_check(), timeout_s)
        except asyncio.TimeoutError as error:
            raise Unavailable(f"Redis is not reachable for run {self.run_id!r}: no answer within {timeout_s}s") from error
        except (RedisConnectionError, RedisTimeoutError, OSError) as error:
            raise Unavailable(f"Redis is not reachable for run {self.run_id!r}: {error}") from error

    async def _ping_and_check(self) -> None:
        await self._redis.ping()
        await self._ready()

    async def reachable(self, timeout_s: float = 1.0) -> bool:
        """Whether Redis answers a PING within `timeout_s` (never raises)."""
        try:
            return bool(await asyncio.wait_for(self._redis.ping(), timeout_s))
        except Exception:  # noqa: BLE001 - any failure means "not now"
            return False

    def after_outage(self) -> None:
        """Redis came back: check the run's schema again (it may have come back empty) and create
        the completed stream's consumer group again if it is gone."""
        self._schema_checked = False
        self._group_ready = False

    async def close(self) -> None:
        """Close the client if `connect` opened it (a client passed in belongs to the caller)."""
        if self._owns_client:
            await self._redis.aclose()

    async def __aenter__(self) -> StateStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- small named records ---------------------------------------------------------------
    async def save_blob(self, name: str, payload: bytes, expected_generation: int | None = None) -> int:
        """Write a named record (e.g. `scheduler.tree`); compare-and-set when a generation is given.

        `expected_generation` None overwrites, 0 requires that the record is new, n requires that
        generation n is stored. Returns the new generation; Conflict if the comparison fails.
        """
        return await self._cas_record(self.keys.blob(name), name, payload, expected_generation)

    async def load_blob(self, name: str) -> bytes | None:
        """The payload of a named record, or None if it was never saved."""
        record = await self.blob_record(name)
        return record.payload if record is not None else None

    async def blob_record(self, name: str) -> VersionedRecord | None:
        """A named record with its generation (to compare-and-set the next write)."""
        return await self._read_record(self.keys.blob(name), name)
