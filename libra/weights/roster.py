"""Who is in the weights group, generation by generation, and how each worker gets a version.

The trainer decides, the rollout gateway follows. The decision travels in the UpdateWeights RPC
(its `group`: this module's GroupRecord); Redis keeps the durable record (blob `weights.group`,
written by the trainer only, compare-and-set, its generation number = the group's generation, so
generations keep counting up across trainer restarts):

```
 trainer, version v (weights: group)                          (services/trainer/publisher.py)
   roster = the serving workers of rollout's last UpdateWeights reply, one rank per TP rank
   new generation when: none yet │ the roster changed │ the last one failed a version
     └▶ blob weights.group = {version: v, workers: roster}   (compare-and-set: generation G+1)
   send v on generation G (forming it first when new)  ‖  rollout UpdateWeights(v, group G)
   rollout's reply ─▶ stop waiting for ranks that never came (the version was aborted for all)
                   ─▶ a worker not ok and v not on disk: write v, UpdateWeights(v, path)

 rollout gateway, UpdateWeights(v, group G)               (delivery(), below)
   its members are ranks of G                          ─▶ "group": they receive v
   G was formed for v and every member is here         ─▶ "join": they join G, then receive v
   otherwise (a member is gone, G formed without us)   ─▶ "disk": every worker loads v from disk
                                                           (or waits for the trainer's disk copy);
                                                           the trainer forms a new generation next
   a worker outside the roster (started or caught up since) loads v from disk, and is a rank of
   the next generation
```

A member that misses a version in the group loads it from disk in the same update; one that
cannot is marked unhealthy and leaves routing until a later version reaches it (weight_delivery.py).
Pure: no Redis, RPC or torch; the trainer's publisher and the gateway call it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Literal

from libra.v1 import rollout_pb2

BLOB = "weights.group"  # the Redis blob of the current generation (docs/state.md)


@dataclass(frozen=True)
class Roster:
    """The workers of one generation, in rank order: (worker_id, tp), sorted by worker id."""

    workers: tuple[tuple[str, int], ...]

    @staticmethod
    def of(workers: Iterable[tuple[str, int]]) -> "Roster":
        return Roster(tuple(sorted((str(w), max(1, int(tp))) for w, tp in workers)))

    def __bool__(self) -> bool:
        return bool(self.workers)

    @property
    def ids(self) -> list[str]:
        return [w for w, _ in self.workers]

    @property
    def world_size(self) -> int:
        """The trainer (rank 0) and one rank per TP rank of every worker."""
        return 1 + sum(tp for _, tp in self.workers)

    def first_ranks(self) -> dict[str, int]:
        """Worker id -> its first rank (its TP rank t is first + t)."""
        ranks, next_rank = {}, 1
        for worker_id, tp in self.workers:
            ranks[worker_id] = next_rank
            next_rank += tp
        return ranks

    def to_proto(self) -> list[rollout_pb2.GroupMember]:
        return [rollout_pb2.GroupMember(worker_id=w, tp=tp) for w, tp in self.workers]

    @staticmethod
    def from_proto(members: Iterable[rollout_pb2.GroupMember]) -> "Roster":
        return Roster.of((m.worker_id, m.tp) for m in members)

    def change(self, newer: "Roster") -> str:
        """What changed from this roster to `newer`, for the log."""
        mine, theirs = dict(self.workers), dict(newer.workers)
        added = sorted(w for w in theirs if mine.get(w) != theirs[w])
        removed = sorted(w for w in mine if theirs.get(w) != mine[w])
        return f"workers added {added}, removed {removed}"


@dataclass(frozen=True)
class GroupRecord:
    """One generation as Redis holds it: its number, the version it was formed for, its roster."""

    generation: int
    version: int
    roster: Roster

    @staticmethod
    def payload(version: int, roster: Roster) -> bytes:
        return json.dumps({"version": int(version), "workers": [list(w) for w in roster.workers]}).encode()

    @staticmethod
    def from_blob(generation: int, payload: bytes) -> "GroupRecord":
        raw = json.loads(payload)
        return GroupRecord(int(generation), int(raw["version"]), Roster.of(tuple(w) for w in raw["workers"]))

    def to_proto(self) -> rollout_pb2.WeightsGeneration:
        return rollout_pb2.WeightsGeneration(generation=self.generation, formed_for=self.version,
                                             members=self.roster.to_proto())

    @staticmethod
    def from_proto(message: rollout_pb2.WeightsGeneration) -> "GroupRecord":
        return GroupRecord(int(message.generation), int(message.formed_for), Roster.from_proto(message.members))


def reform_reason(current: Roster | None, roster: Roster) -> str | None:
    """Why the trainer must form a new generation for `roster` (None: keep the current one).

    `current` is None when there is no usable generation (none yet, or the last one failed)."""
    if current is None:
        return "no usable generation (first version, or the last one failed a version)"
    if current != roster:
        return current.change(roster)
    return None


@dataclass(frozen=True)
class Delivery:
    """How the gateway's workers get one version: over the group as it is, after joining a new
    generation, or every one of them from disk."""

    how: Literal["group", "join", "disk"]
    why: str = ""


def delivery(record: GroupRecord | None, joined: int | None, present: Iterable[str], version: int) -> Delivery:
    """The gateway's decision for `version` sent over the group (see the module diagram).

    `joined`: the generation the gateway's workers are ranks of (None: none); `present`: the
    workers of this gateway whose engine is alive."""
    if record is None:
        return Delivery("disk", "the trainer announced no weights-group generation")
    missing = sorted(set(record.roster.ids) - set(present))
    if missing:
        return Delivery("disk", f"workers {missing} of generation {record.generation} are not here; "
                                "the generation cannot deliver")
    if joined == record.generation:
        return Delivery("group")
    if record.version == version:
        return Delivery("join", f"generation {record.generation} is formed for version {version}")
    return Delivery("disk", f"this gateway's workers are not ranks of generation {record.generation} "
                            f"(formed for version {record.version}; they are in {joined})")
