"""The scheduler's durable routing state: live trajectories, what finished ones taught, the tree.

Owns `scheduler:live`, `scheduler:learned`, `scheduler:meta` and writes the `scheduler.tree` blob
(`blob:scheduler.tree`, read back with `load_blob`). Payloads are opaque bytes: their meaning is
the scheduler's (services/scheduler/live.py).

```
 each applied batch of routing messages ── save_routing (one MULTI) ──▶ live: HSET changed, HDEL finished
                                                                        learned: XADD 0-N per finish
                                                                        meta: rotation
 every few seconds ── save_tree (one Lua script) ──▶ blob scheduler.tree + meta tree_learned = N
                                                     + learned trimmed to entries after N
 restart ── load_routing ──▶ tree, the learned entries after it, live records, rotation
```
A restarted scheduler replays the learned entries the saved tree does not include yet, so the
tree is exactly what the last one had learned; the live records put back each trajectory's
placement and level.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libra.state.base import StoreBase, text

TREE_BLOB = "scheduler.tree"

# KEYS: tree blob, meta hash, learned stream   ARGV: payload, now, learned (the last entry the tree includes)
SAVE_TREE = """
local generation = redis.call('HINCRBY', KEYS[1], 'generation', 1)
redis.call('HSET', KEYS[1], 'payload', ARGV[1], 'updated_at', ARGV[2])
redis.call('HSET', KEYS[2], 'tree_learned', ARGV[3])
redis.call('XTRIM', KEYS[3], 'MINID', '0-' .. (tonumber(ARGV[3]) + 1))
return generation
"""


@dataclass
class RoutingSnapshot:
    """What `load_routing` returns: everything a restarted scheduler puts back."""

    tree: bytes | None = None
    tree_learned: int = 0  # the last learned entry the tree includes
    learned: list[tuple[int, bytes]] = field(default_factory=list)  # entries after it, in order
    live: dict[str, bytes] = field(default_factory=dict)  # trajectory id -> record
    rotation: int = 0


class SchedulerStore(StoreBase):
    """The scheduler's routing state (mixed into `StateStore`)."""

    async def save_routing(self, changed: dict[str, bytes], finished: list[str],
                           learned: list[tuple[int, bytes]], rotation: int) -> None:
        """One applied batch, atomically: the records of `changed` trajectories, `finished` ones
        dropped, what they taught appended (entry ids 0-N, increasing), the tie-breaking counter."""
        redis = await self._ready()
        async with redis.pipeline(transaction=True) as pipe:
            if changed:
                pipe.hset(self.keys.scheduler_live, mapping=changed)
            if finished:
                pipe.hdel(self.keys.scheduler_live, *finished)
            for number, payload in learned:
                pipe.xadd(self.keys.scheduler_learned, {"data": payload}, id=f"0-{number}")
            pipe.hset(self.keys.scheduler_meta, "rotation", rotation)
            await pipe.execute()

    async def save_tree(self, payload: bytes, learned: int) -> int:
        """Save the tree, which includes learned entries up to `learned`, and drop those entries; the
        blob's new generation."""
        keys = [self.keys.scheduler_tree, self.keys.scheduler_meta, self.keys.scheduler_learned]
        return int(await self._eval(SAVE_TREE, keys, [bytes(payload), repr(self._clock()), learned]))

    async def load_routing(self) -> RoutingSnapshot:
        redis = await self._ready()
        async with redis.pipeline(transaction=True) as pipe:
            pipe.hget(self.keys.scheduler_tree, "payload")
            pipe.hgetall(self.keys.scheduler_meta)
            pipe.xrange(self.keys.scheduler_learned)
            pipe.hgetall(self.keys.scheduler_live)
            tree, meta, rows, live = await pipe.execute()
        snapshot = RoutingSnapshot(tree=bytes(tree) if tree is not None else None,
                                   tree_learned=int(meta.get(b"tree_learned", 0)),
                                   rotation=int(meta.get(b"rotation", 0)))
        for entry, fields in rows:
            number = int(text(entry).split("-", 1)[1])
            if number > snapshot.tree_learned:
                snapshot.learned.append((number, bytes(fields[b"data"])))
        snapshot.live = {text(tid): bytes(record) for tid, record in live.items()}
        return snapshot
