"""The completed-trajectory stream as the trainer consumes it, through one consumer group.

Owns reading, acknowledging and reclaiming entries of `completed` (appending is done by
`complete_trajectory` in `trajectories.py`, atomically with the trajectory write).

    rollout ──complete_trajectory──▶ completed stream ──XREADGROUP──▶ trainer consumer
                                          ▲    │ pending (delivered, unacked)
                 claim_stale (XAUTOCLAIM) ┘    └─ ack_completed after the step commits
                                                  (XACK + status CONSUMED, one script)

Delivery is at least once across crashes and exactly once within one store object: a consumer's
store remembers what it delivered and not yet acked, so it never hands out an entry twice, while
a new store (a restarted process) first re-delivers the consumer's pending entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from redis.exceptions import ResponseError

from libra.state.base import StoreBase, text
from libra.state.keys import check_name

# KEYS: stream, trajectories...   ARGV: group, now, entry ids...
ACK_COMPLETED = """
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'status') == 'COMPLETED' then
    redis.call('HSET', KEYS[i], 'status', 'CONSUMED', 'updated_at', ARGV[2])
  end
end
return acked
"""


ACK_CHUNK = 1000
"""Entries acknowledged per script call: each call is atomic (its acks and CONSUMED marks together);
one call for thousands of entries would exceed what Lua's unpack can hold."""


class CompletedEntry(NamedTuple):
    """One entry of the completed stream."""

    entry_id: str
    trajectory_id: str
    group_id: str


@dataclass
class _Cursor:
    """What one consumer of this store has been handed: the pending scan position and unacked ids."""

    pending_from: str | None = "0"  # None once this consumer's pending entries have been read
    delivered: set[str] = field(default_factory=set)


def _stream_entries(reply: Any) -> list[tuple[Any, Any]]:
    """The (id, fields) pairs of an XREADGROUP reply on one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        (entries,) = reply.values()
        return list(entries[0] if entries and isinstance(entries[0], list) else entries)
    return list(reply[0][1])


class CompletedStream(StoreBase):
    """The trainer's side of the completed stream (mixed into `StateStore`)."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self._group_ready = False
        self._cursors: dict[str, _Cursor] = {}

    async def ensure_consumer_group(self) -> None:
        """Create the stream and its consumer group (reading from the start) if missing."""
        if self._group_ready:
            return
        redis = await self._ready()
        try:
            await redis.xgroup_create(self.keys.completed, self.keys.completed_group, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._group_ready = True

    async def read_completed(self, consumer: str, count: int = 100,
                             block_ms: int | None = None) -> list[CompletedEntry]:
        """Entries for `consumer`: first its pending ones (after a restart), then new ones.

        `block_ms` > 0 waits up to that long for new entries; None or 0 returns at once.
        """
        cursor = self._cursors.setdefault(check_name(consumer, "consumer"), _Cursor())
        await self.ensure_consumer_group()
        while cursor.pending_from is not None:
            page, last_id = await self._read_group(consumer, cursor.pending_from, count, None)
            cursor.pending_from = last_id
            fresh = [entry for entry in page if entry.entry_id not in cursor.delivered]
            if fresh:
                cursor.delivered.update(entry.entry_id for entry in fresh)
                return fresh
        entries, _ = await self._read_group(consumer, ">", count, block_ms or None)
        cursor.delivered.update(entry.entry_id for entry in entries)
        return entries

    async def _read_group(self, consumer: str, from_id: str, count: int,
                          block_ms: int | None) -> tuple[list[CompletedEntry], str | None]:
        """Entries read after `from_id`, and the last id read (None when nothing was read)."""
        redis = await self._ready()
        try:
            reply = await redis.xreadgroup(self.keys.completed_group, consumer, {self.keys.completed: from_id},
                                           count=count, block=block_ms)
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            # Redis came back without the group (it lost its data): make it again, read from the start
            self._group_ready = False
            await self.ensure_consumer_group()
            return [], None
        entries, trimmed, last_id = [], [], None
        for entry_id, fields in _stream_entries(reply):
            last_id = text(entry_id)
            if not fields:  # trimmed from the stream while pending: nothing left to deliver
                trimmed.append(entry_id)
                continue
            entries.append(CompletedEntry(text(entry_id), text(fields[b"trajectory_id"]),
                                          text(fields[b"group_id"])))
        if trimmed:
            await redis.xack(self.keys.completed, self.keys.completed_group, *trimmed)
        return entries, last_id

    async def ack_completed(self, entry_ids: list[str]) -> int:
        """Acknowledge entries and mark their trajectories CONSUMED, atomically per ACK_CHUNK entries;
        how many acked."""
        if not entry_ids:
            return 0
        redis = await self._ready()
        acked = 0
        for start in range(0, len(entry_ids), ACK_CHUNK):  # Lua's unpack holds a few thousand values
            chunk = entry_ids[start:start + ACK_CHUNK]
            async with redis.pipeline(transaction=False) as pipe:
                for entry_id in chunk:
                    pipe.xrange(self.keys.completed, entry_id, entry_id, count=1)
                found = await pipe.execute()
            trajectories = [self.keys.trajectory(text(rows[0][1][b"trajectory_id"])) for rows in found if rows]
            args = [self.keys.completed_group, repr(self._clock()), *chunk]
            acked += int(await self._eval(ACK_COMPLETED, [self.keys.completed, *trajectories], args))
            for cursor in self._cursors.values():
                cursor.delivered.difference_update(chunk)
        return acked

    async def claim_stale(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[CompletedEntry]:
        """Take over entries idle for `min_idle_ms` in any consumer (a dead one); return the new ones."""
        cursor = self._cursors.setdefault(check_name(consumer, "consumer"), _Cursor())
        await self.ensure_consumer_group()
        redis = await self._ready()
        claimed: list[CompletedEntry] = []
        start = "0-0"
        while True:
            reply = await redis.xautoclaim(self.keys.completed, self.keys.completed_group, consumer,
                                           min_idle_ms, start, count=count)
            start = text(reply[0])
            for entry_id, fields in reply[1]:
                if fields and text(entry_id) not in cursor.delivered:
                    claimed.append(CompletedEntry(text(entry_id), text(fields[b"trajectory_id"]),
                                                  text(fields[b"group_id"])))
            if start == "0-0":
                break
        cursor.delivered.update(entry.entry_id for entry in claimed)
        return claimed

    async def pending_count(self) -> int:
        """Entries delivered to some consumer and not yet acknowledged."""
        await self.ensure_consumer_group()
        redis = await self._ready()
        summary = await redis.xpending(self.keys.completed, self.keys.completed_group)
        return int(summary["pending"])

    async def completed_length(self) -> int:
        """Entries in the completed stream (acknowledged or not)."""
        redis = await self._ready()
        return int(await redis.xlen(self.keys.completed))
