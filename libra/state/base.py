"""What every part of the state store shares: the client, the key schema, the clock, Lua scripts.

Owns the schema-version check that guards first use of a run, and the versioned-record script
(generation compare-and-set) that membership and named records both use. Knows no domain; the
modules next to it (trajectories, completed, versions, records) each own one part of the key space.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import redis.asyncio as aioredis

from libra.errors import Conflict, FailedPrecondition, InvalidArgument
from libra.state.keys import SCHEMA_VERSION, Keys

# Compare-and-set of a versioned record hash {generation, payload, updated_at[, role]}.
# KEYS: record [, members set, epoch counter]   ARGV: expected ("" = any), payload, now, id, role
# expected "0" means "must not exist". Returns {1, new generation} or {0, current generation}.
# With the membership keys given, a new member or a changed role bumps the epoch.
CAS_RECORD = """
local current = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= current then
  return {0, current}
end
local generation = current + 1
redis.call('HSET', KEYS[1], 'generation', generation, 'payload', ARGV[2], 'updated_at', ARGV[3])
if #KEYS == 3 then
  local old_role = redis.call('HGET', KEYS[1], 'role')
  redis.call('HSET', KEYS[1], 'role', ARGV[5])
  local added = redis.call('SADD', KEYS[2], ARGV[4])
  if added == 1 or old_role ~= ARGV[5] then
    redis.call('INCR', KEYS[3])
  end
end
return {1, generation}
"""


class VersionedRecord(NamedTuple):
    """A record written by generation compare-and-set (a member or a named blob)."""

    name: str
    generation: int
    payload: bytes
    role: str
    updated_at: float


def text(value: bytes | str | None) -> str:
    """A Redis reply as str ('' for a missing value)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def check_expected_generation(expected: int | None) -> str:
    if expected is None:
        return ""
    if isinstance(expected, bool) or not isinstance(expected, int) or expected < 0:
        raise InvalidArgument(f"expected_generation must be None or an int >= 0; got {expected!r}")
    return str(expected)


class StoreBase:
    """The client, keys and scripts shared by the state store's parts."""

    def __init__(self, redis: aioredis.Redis, run_id: str, *,
                 clock: Callable[[], float] = time.time) -> None:
        if redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise InvalidArgument("the state store needs a Redis client with decode_responses=False")
        self._redis = redis
        self.keys = Keys(run_id)
        self.run_id = run_id
        self._clock = clock
        self._scripts: dict[str, Any] = {}
        self._schema_checked = False

    async def _ready(self) -> aioredis.Redis:
        """The client, after checking (once per store) that the run uses this schema version."""
        if not self._schema_checked:
            found = await self._redis.set(self.keys.schema, SCHEMA_VERSION, nx=True, get=True)
            if found is not None and text(found) != str(SCHEMA_VERSION):
                raise FailedPrecondition(
                    f"run {self.run_id!r} was written with state schema version {text(found)}, this "
                    f"code uses version {SCHEMA_VERSION}; use a new run id or the matching Libra version "
                    f"(see docs/state.md)")
            self._schema_checked = True
        return self._redis

    def _script(self, redis: aioredis.Redis, source: str) -> Any:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = redis.register_script(source)
        return script

    async def _eval(self, source: str, keys: list[str], args: list[Any]) -> Any:
        """Run a Lua script (EVALSHA, loading it on first use)."""
        redis = await self._ready()
        return await self._script(redis, source)(keys=keys, args=args)

    async def _eval_each(self, source: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """Run a Lua script once per (keys, args), in order, in one round trip (a pipeline that is not a
        transaction: each run is atomic, as with `_eval`, and with appendfsync always the server
        syncs its log once for the lot instead of once per run)."""
        if not calls:
            return []
        redis = await self._ready()
        script = self._script(redis, source)
        async with redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                await script(keys=keys, args=args, client=pipe)
            return await pipe.execute()

    async def _cas_record(self, key: str, name: str, payload: bytes, expected: int | None,
                          membership: tuple[str, str, str] | None = None) -> int:
        """Write a versioned record if its generation is `expected`; the new generation."""
        keys = [key]
        role = ""
        if membership is not None:
            members, epoch, role = membership
            keys += [members, epoch]
        args = [check_expected_generation(expected), bytes(payload), self._clock(), name, role]
        applied, generation = await self._eval(CAS_RECORD, keys, args)
        if not applied:
            raise Conflict(f"{name}: expected generation {expected}, found {generation}")
        return int(generation)

    async def _read_record(self, key: str, name: str) -> VersionedRecord | None:
        redis = await self._ready()
        found = await redis.hgetall(key)
        if not found:
            return None
        return VersionedRecord(name=name, generation=int(found[b"generation"]),
                               payload=bytes(found.get(b"payload", b"")), role=text(found.get(b"role")),
                               updated_at=float(found.get(b"updated_at", 0)))
