"""Runtime history, pool membership and resource plans: the planner's and coordinator's state.

Owns `history:*` (capped streams the planner reads), `member:*`, `members`, `members:epoch`,
`plan` and `plan:decisions`. Payloads of members and decisions are opaque bytes: their meaning
belongs to the elastic coordinator and the planner.

Members and the plan are compare-and-set records: a member carries a generation that every write
must name (or 0 to create, None to overwrite), and a plan is accepted only with a generation
strictly above the stored one, so two writers never interleave.
"""

from __future__ import annotations

from typing import Any

from libra.errors import Conflict, InvalidArgument
from libra.state.base import StoreBase, VersionedRecord, check_expected_generation, text
from libra.state.keys import check_history_kind, check_name
from libra.v1 import common_pb2

# KEYS: member, members set, epoch   ARGV: expected ("" = any), member id
# Returns 1 removed, 0 absent, {-1, current} conflict.
REMOVE_MEMBER = """
local current = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= current then return {-1, current} end
if current == 0 then return {0, 0} end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
redis.call('INCR', KEYS[3])
return {1, current}
"""
# KEYS: plan   ARGV: generation, serialized plan, now
# Returns {1, generation} stored, {0, current} identical replay, {-1, current} stale.
PUT_PLAN = """
local current = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
local wanted = tonumber(ARGV[1])
if wanted == current and redis.call('HGET', KEYS[1], 'data') == ARGV[2] then return {0, current} end
if wanted <= current then return {-1, current} end
redis.call('HSET', KEYS[1], 'generation', ARGV[1], 'data', ARGV[2], 'updated_at', ARGV[3])
return {1, wanted}
"""


class RecordStore(StoreBase):
    """History streams, membership and plans (mixed into `StateStore`)."""

    def __init__(self, *args: Any, history_maxlen: int = 10_000, decisions_maxlen: int = 1_000,
                 **options: Any) -> None:
        super().__init__(*args, **options)
        if history_maxlen < 1 or decisions_maxlen < 1:
            raise InvalidArgument("history_maxlen and decisions_maxlen must be >= 1")
        self.history_maxlen = history_maxlen
        self.decisions_maxlen = decisions_maxlen

    # -- runtime history -------------------------------------------------------------------
    async def append_history(self, kind: str, record: common_pb2.HistoryRecord) -> str:
        """Append a turn or step record to its capped stream (about `history_maxlen` kept)."""
        return (await self.append_histories(kind, [record]))[0]

    async def append_histories(self, kind: str, records: list[common_pb2.HistoryRecord]) -> list[str]:
        """Append records of one kind in order, in one round trip (a pipeline); their entry ids."""
        check_history_kind(kind)
        payloads = []
        for record in records:
            if record.kind and record.kind != kind:
                raise InvalidArgument(f"history record of kind {record.kind!r} appended as {kind!r}")
            stored = common_pb2.HistoryRecord()
            stored.CopyFrom(record)
            stored.kind = kind
            payloads.append(stored.SerializeToString())
        if not payloads:
            return []
        redis = await self._ready()
        async with redis.pipeline(transaction=False) as pipe:
            for payload in payloads:
                pipe.xadd(self.keys.history(kind), {"data": payload}, maxlen=self.history_maxlen, approximate=True)
            entries = await pipe.execute()
        return [text(entry) for entry in entries]

    async def read_history(self, kind: str, count: int = 100) -> list[common_pb2.HistoryRecord]:
        """The latest `count` records of a kind, oldest first."""
        redis = await self._ready()
        rows = await redis.xrevrange(self.keys.history(kind), count=count)
        return [common_pb2.HistoryRecord.FromString(fields[b"data"]) for _, fields in reversed(rows)]

    async def read_history_after(self, kind: str, after: str = "", count: int = 1000,
                                 ) -> list[tuple[str, common_pb2.HistoryRecord]]:
        """Records of a kind strictly after stream id `after` ("": from the oldest kept), oldest
        first, with their stream ids: a reader keeps the last id as its cursor."""
        redis = await self._ready()
        rows = await redis.xrange(self.keys.history(kind), min=f"({after}" if after else "-", count=count)
        return [(entry.decode() if isinstance(entry, bytes) else entry, common_pb2.HistoryRecord.FromString(fields[b"data"]))
                for entry, fields in rows]

    async def history_length(self, kind: str) -> int:
        """Records currently kept for a kind (trimming is approximate: may exceed the cap a little)."""
        redis = await self._ready()
        return int(await redis.xlen(self.keys.history(kind)))

    # -- membership ------------------------------------------------------------------------
    async def put_member(self, member_id: str, payload: bytes, expected_generation: int | None = None,
                         role: str = "") -> int:
        """Write a member if its generation is `expected_generation` (0: must be new; None: any).

        Returns the new generation; raises Conflict if another writer got there first. A new
        member or a changed role bumps the membership epoch.
        """
        if role:
            check_name(role, "role")
        membership = (self.keys.members, self.keys.membership_epoch, role)
        return await self._cas_record(self.keys.member(member_id), member_id, payload,
                                      expected_generation, membership)

    async def remove_member(self, member_id: str, expected_generation: int | None = None) -> bool:
        """Remove a member (bumping the epoch); False if it was absent, Conflict on a lost race."""
        keys = [self.keys.member(member_id), self.keys.members, self.keys.membership_epoch]
        outcome, current = await self._eval(
            REMOVE_MEMBER, keys, [check_expected_generation(expected_generation), member_id])
        if outcome < 0:
            raise Conflict(f"member {member_id}: expected generation {expected_generation}, found {current}")
        return outcome == 1

    async def get_member(self, member_id: str) -> VersionedRecord | None:
        """A member's record, or None if it is not a member."""
        return await self._read_record(self.keys.member(member_id), member_id)

    async def list_members(self) -> list[VersionedRecord]:
        """Every current member, ordered by id."""
        redis = await self._ready()
        ids = sorted(text(member) for member in await redis.smembers(self.keys.members))
        records = [await self.get_member(member_id) for member_id in ids]
        return [record for record in records if record is not None]

    async def membership_epoch(self) -> int:
        """Counter bumped on every change of the member set or of a member's role (0: never)."""
        redis = await self._ready()
        return int(await redis.get(self.keys.membership_epoch) or 0)

    # -- plans -----------------------------------------------------------------------------
    async def put_plan(self, plan: common_pb2.Plan) -> bool:
        """Store `plan` if its generation is above the stored one.

        Returns True when stored, False when this exact plan is already stored (a replay);
        raises Conflict for a stale generation.
        """
        if plan.generation < 1:
            raise InvalidArgument("plan.generation must be >= 1")
        data = plan.SerializeToString(deterministic=True)
        outcome, current = await self._eval(PUT_PLAN, [self.keys.plan],
                                            [plan.generation, data, repr(self._clock())])
        if outcome < 0:
            raise Conflict(f"plan generation {plan.generation} is stale: generation {current} is stored")
        return outcome == 1

    async def get_plan(self) -> common_pb2.Plan | None:
        """The current plan, or None before the first one."""
        redis = await self._ready()
        data = await redis.hget(self.keys.plan, "data")
        return common_pb2.Plan.FromString(data) if data is not None else None

    async def append_plan_decision(self, payload: bytes) -> None:
        """Log a planner decision; only the latest `decisions_maxlen` are kept."""
        redis = await self._ready()
        async with redis.pipeline(transaction=True) as pipe:
            pipe.rpush(self.keys.plan_decisions, bytes(payload))
            pipe.ltrim(self.keys.plan_decisions, -self.decisions_maxlen, -1)
            await pipe.execute()

    async def plan_decisions(self, limit: int = 100) -> list[bytes]:
        """The latest `limit` decisions, oldest first."""
        if limit < 1:
            return []
        redis = await self._ready()
        return [bytes(item) for item in await redis.lrange(self.keys.plan_decisions, -limit, -1)]

