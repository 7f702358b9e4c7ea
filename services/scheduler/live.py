"""What the scheduler keeps in Redis so that a restart routes as if it had never stopped.

For every routed, unfinished trajectory: its placement (worker, tokens in flight, turns), its
level state (C-MLFQ's progress; LA-MLFQ's level and output so far) and the replies to its latest
requests. For every finished one, until the saved tree includes it: its state just before the
finish, so a restart replays the finish and learns exactly what was learned. Worker loads are
not stored: they are the sum of the placements (`rebuild_loads`).

```
 a batch of Route / reports ─▶ policy (memory) ─▶ LiveState: changed, finished, learned
                                                   └─ take() ─▶ store.save_routing (one MULTI)
                                                                 ─▶ only then answers and acks
 restart ─▶ store.load_routing ─▶ tree + replayed finishes ─▶ live records ─▶ loads, replies
```
Why replies too: a message applied and saved but not yet acknowledged when the scheduler died is
sent again by the gateway; the restarted scheduler must answer it with the first reply, not apply
it twice. Its replay window (`libra.replay.MemoryReplies`) is memory, so it is filled at restart
from these records (the last RECENT_REPLIES requests of each live trajectory: more than a gateway
ever has unacknowledged for one trajectory). A report for a trajectory that finished is answered
NOT_FOUND, which the gateway expects.

The policy internals it reads and writes (placements, `CMLFQ.progress`, `LAMLFQ.levels`) are the
only per-trajectory state a policy has; the policies themselves stay pure (libra/routing).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

from google.protobuf.message import Message

from libra.routing.baselines import LAMLFQ
from libra.routing.cmlfq import CMLFQ, Progress
from libra.routing.policy import Placement, Policy
from libra.v1 import common_pb2, scheduler_pb2

RECENT_REPLIES = 8
REPLY_TYPES = {"Scheduler.Route": scheduler_pb2.RouteDecision}  # the reports answer common.Ack


def export_trajectory(policy: Policy, tid: str) -> dict[str, Any] | None:
    """The routing state of live trajectory `tid` (None: the policy does not know it)."""
    placement = policy.state.placements.get(tid)
    if placement is None:
        return None
    record: dict[str, Any] = {"placement": [placement.worker_id, placement.inflight_tokens, placement.turns]}
    if isinstance(policy, CMLFQ) and tid in policy.progress:
        record["progress"] = dataclasses.asdict(policy.progress[tid])
    if isinstance(policy, LAMLFQ) and tid in policy.levels:
        record["level"] = [policy.levels[tid], policy.produced.get(tid, 0)]
    return record


def import_trajectory(policy: Policy, tid: str, record: dict[str, Any]) -> None:
    """Put `record` (from `export_trajectory`) back as the state of `tid` (loads: `rebuild_loads`)."""
    worker_id, inflight, turns = record["placement"]
    policy.state.placements[tid] = Placement(worker_id, int(inflight), int(turns))
    if isinstance(policy, CMLFQ) and "progress" in record:
        policy.progress[tid] = Progress(**record["progress"])
    if isinstance(policy, LAMLFQ) and "level" in record:
        policy.levels[tid], policy.produced[tid] = (int(v) for v in record["level"])


def forget(policy: Policy, tid: str) -> None:
    """Drop `tid` without learning from it (it is played again from its first turn), releasing its load."""
    placement = policy.state.placements.pop(tid, None)
    if placement is not None:
        policy._release(placement)
    if isinstance(policy, CMLFQ):
        policy.progress.pop(tid, None)
    if isinstance(policy, LAMLFQ):
        policy.levels.pop(tid, None)
        policy.produced.pop(tid, None)


def rebuild_loads(policy: Policy) -> None:
    """Each worker's outstanding tokens and requests: what the placements on it hold in flight."""
    for worker in policy.state.workers.values():
        worker.outstanding_tokens = worker.outstanding_requests = 0
    for placement in policy.state.placements.values():
        worker = policy.state.workers.get(placement.worker_id or "")
        if worker is not None and placement.inflight_tokens:
            worker.outstanding_tokens += placement.inflight_tokens
            worker.outstanding_requests += 1


def reply_of(scope: str, payload: str) -> Message:
    return REPLY_TYPES.get(scope, common_pb2.Ack).FromString(base64.b64decode(payload))


class LiveState:
    """The changes since the last save, and the replies to keep with each live trajectory."""

    def __init__(self, policy: Policy, learns: bool):
        self.policy, self.learns = policy, learns
        self.learned_count = 0  # number of the last learned entry written (0: none)
        self._changed: set[str] = set()
        self._finished: set[str] = set()
        self._learned: list[tuple[int, bytes]] = []
        self._replies: dict[str, list[list[str]]] = {}

    def touch(self, tid: str) -> None:
        self._changed.add(tid)
        self._finished.discard(tid)

    def replied(self, tid: str, scope: str, request_id: str, reply: Message) -> None:
        """Keep the reply to a request of `tid` (a replay after a restart answers it)."""
        if tid not in self.policy.state.placements:
            return  # finished (or never routed): nothing to keep it with
        kept = self._replies.setdefault(tid, [])
        if not any(rid == request_id and sc == scope for sc, rid, _ in kept):
            kept.append([scope, request_id, base64.b64encode(reply.SerializeToString()).decode()])
            del kept[:-RECENT_REPLIES]
        self.touch(tid)

    def forget(self, tid: str) -> None:
        forget(self.policy, tid)
        self._replies.pop(tid, None)
        self._changed.discard(tid)
        self._finished.add(tid)

    def finished(self, tid: str, prompt_id: str, output_tokens: int, before: dict[str, Any] | None) -> None:
        """`tid` finished; `before` is its state just before (what the finish learned from)."""
        self._replies.pop(tid, None)
        self._changed.discard(tid)
        self._finished.add(tid)
        if self.learns and before is not None:
            self.learned_count += 1
            event = {"tid": tid, "prompt_id": prompt_id, "output_tokens": output_tokens, "state": before}
            self._learned.append((self.learned_count, json.dumps(event).encode()))

    def mark_all(self) -> None:
        """Everything is to be written again (Redis came back without it)."""
        self._changed |= set(self.policy.state.placements)

    def take(self) -> tuple[dict[str, bytes], list[str], list[tuple[int, bytes]]] | None:
        """The changes since the last take (None: nothing changed)."""
        if not (self._changed or self._finished or self._learned):
            return None
        changed = {}
        for tid in self._changed:
            record = export_trajectory(self.policy, tid)
            if record is not None:
                record["replies"] = self._replies.get(tid, [])
                changed[tid] = json.dumps(record).encode()
        taken = changed, sorted(self._finished - set(changed)), self._learned
        self._changed, self._finished, self._learned = set(), set(), []
        return taken

    def restore(self, tree_learned: int, learned: list[tuple[int, bytes]], live: dict[str, bytes]) -> list:
        """Replay the finishes the saved tree lacks, put the live trajectories back; the replies to
        keep for replays, as (scope, request id, reply)."""
        self.learned_count = tree_learned
        for number, payload in learned:
            event = json.loads(payload)
            import_trajectory(self.policy, event["tid"], event["state"])
            self.policy.finish(event["tid"], event["prompt_id"], event["output_tokens"])
            self.learned_count = number
        replies = []
        for tid, payload in live.items():
            record = json.loads(payload)
            import_trajectory(self.policy, tid, record)
            self._replies[tid] = record.get("replies", [])
            replies += [(scope, rid, reply_of(scope, reply)) for scope, rid, reply in self._replies[tid]]
        rebuild_loads(self.policy)
        return replies
