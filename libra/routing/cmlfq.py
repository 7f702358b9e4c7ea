"""C-MLFQ: causality-aware multi-level feedback queue routing, as a deterministic step function.

Buckets are levels ordered by `max_tokens`. A trajectory starts in the shortest bucket that has a
serving worker. Each tool return adds a signature (`signatures`) to the trajectory and looks up
the causal prefix tree (`prefix_tree`) for the output it still has to generate; the mean and the
p90 of that prediction each map to the smallest bucket whose `max_tokens` covers them. The
trajectory moves (up or down) on its next turn only when both agree and the node has enough
visits. Without a confident prediction (no node, or mean and p90 disagree) the signal left is work
done: a trajectory that has already produced more than its bucket's `max_tokens` moves up one
level ("move:work"). Between moves it keeps its worker (KV/prefix cache affinity) unless that
worker is over the per-worker cap. Finished trajectories teach the tree.

    route(turn) ──▶ new? shortest bucket (or "fallback:spill" to an idling bucket) ── pending move?
                    target bucket ── else affinity
                          │                         │
                          └──── least outstanding tokens under the cap in the bucket
                                 └─ none: nearest other bucket with room ("fallback:bucket")
                                    └─ none: any serving worker ("fallback:any")
    tool_returned ──▶ signature ──▶ tree lookup ──▶ mean & p90 agree? ──▶ pending move
    turn_done(output_tokens) ──▶ output so far;  finish ──▶ tree insert (remaining after each signature)

"Aging" without a queue: Route is synchronous, so the scheduler never holds a request; a request
"waits" only by landing behind others on a busy worker. Nothing starves because (1) a request is
never refused while any worker serves: a saturated bucket overflows to the nearest bucket with
room, then to any worker; and (2) hysteresis: after `max_moves` moves a trajectory is pinned to
its bucket, so a trajectory whose predictions flip-flop stops paying cache misses and requeueing.

No network, no Redis, no clock: the service wraps this and persists `forest.to_bytes()`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from libra.errors import InvalidArgument
from libra.routing.policy import Placement, Policy, Turn, Worker, ordered_buckets
from libra.routing.prefix_tree import PrefixForest
from libra.routing.signatures import SizeThresholds, signature


@dataclass
class Progress:
    """What C-MLFQ knows of one live trajectory."""

    prompt_id: str
    level: int
    signatures: list[str] = field(default_factory=list)
    produced_at: list[int] = field(default_factory=list)  # output tokens before each signature
    output_tokens: int = 0
    target: int | None = None  # level of a pending move, applied on the next route
    moves: int = 0


class CMLFQ(Policy):
    """Bucket levels from predicted remaining output, learned from tool-outcome prefixes."""

    name = "cmlfq"

    def __init__(self, per_worker_cap_tokens: int, affinity: bool = True,
                 buckets: list[tuple[str, int]] = (("short", 4000),),  # type: ignore[assignment]
                 forest: PrefixForest | None = None, thresholds: SizeThresholds | None = None,
                 max_moves: int = 4, start_spill_factor: float = 2.0):
        super().__init__(per_worker_cap_tokens, affinity)
        ordered = ordered_buckets(list(buckets))
        self.buckets = [name for name, _ in ordered]
        self.limits = [limit for _, limit in ordered]
        self.level_of = {name: level for level, name in enumerate(self.buckets)}
        self.nearest = [self._nearest_levels(level) for level in range(len(self.buckets))]
        self.forest = forest if forest is not None else PrefixForest()
        self.thresholds = thresholds if thresholds is not None else SizeThresholds()
        if max_moves < 0:
            raise InvalidArgument(f"max_moves must be >= 0, got {max_moves}")
        self.max_moves = max_moves
        if start_spill_factor and start_spill_factor < 1:
            raise InvalidArgument(f"start_spill_factor must be 0 (off) or >= 1, got {start_spill_factor}")
        self.start_spill_factor = start_spill_factor
        self.progress: dict[str, Progress] = {}
        self.signals: Counter = Counter()  # what tool returns concluded: move, stay, disagree, ...

    # -- routing -------------------------------------------------------------------------------
    def choose(self, turn: Turn, placement: Placement, candidates: list[Worker]) -> tuple[Worker, str]:
        record = self.progress.get(turn.trajectory_id)
        if record is None:
            by_level = self._by_level(candidates)
            start = next((level for level, workers in enumerate(by_level) if workers), 0)
            self.progress[turn.trajectory_id] = Progress(turn.prompt_id, start)
            return self._in_level(start, by_level, candidates, "new:shortest")
        if record.target is not None:
            direction = "up" if record.target > record.level else "down"
            record.level, record.target = record.target, None
            record.moves += 1
            return self._in_level(record.level, self._by_level(candidates), candidates,
                                  f"move:{direction}:{self.buckets[record.level]}")
        current = next((w for w in candidates if w.worker_id == placement.worker_id), None)
        if self.affinity and current is not None:
            if current.outstanding_tokens < self.cap or all(w.outstanding_tokens >= self.cap for w in candidates):
                return current, "affinity"
        reason = "reroute:worker_gone" if current is None else "least_loaded"
        return self._in_level(record.level, self._by_level(candidates), candidates, reason)

    def _by_level(self, candidates: list[Worker]) -> list[list[Worker]]:
        """Candidates grouped by bucket level (workers of unknown buckets serve only as "any")."""
        by_level: list[list[Worker]] = [[] for _ in self.buckets]
        for worker in candidates:
            level = self.level_of.get(worker.bucket)
            if level is not None:
                by_level[level].append(worker)
        return by_level

    def _in_level(self, level: int, by_level: list[list[Worker]], candidates: list[Worker],
                  reason: str) -> tuple[Worker, str]:
        """Least loaded under the cap in `level`, else in the nearest level with room, else anywhere."""
        for nearest in self.nearest[level]:
            room = [w for w in by_level[nearest] if w.outstanding_tokens < self.cap]
            if room:
                best = self.least_loaded(room)
                if nearest == level and self.start_spill_factor and reason == "new:shortest":
                    return self._spill(level, best, by_level) or (best, reason)
                return best, reason if nearest == level else "fallback:bucket"
        return self.least_loaded(candidates), "fallback:any"

    def _spill(self, level: int, best: Worker, by_level: list[list[Worker]]) -> tuple[Worker, str] | None:
        """Work conservation at admission: a new trajectory starts in the shortest bucket unless even
        that bucket's least loaded worker carries more than `start_spill_factor` times the load of
        another bucket's least loaded worker (that bucket idles while this one queues); then it
        starts there (nearest bucket first). Only starts spill: once the tree has spoken, a
        trajectory goes where its prediction says (spilling those would mix long and short again)."""
        if best.outstanding_tokens == 0:
            return None
        for other in self.nearest[level][1:]:
            room = [w for w in by_level[other] if w.outstanding_tokens < self.cap]
            if room:
                candidate = self.least_loaded(room)
                if candidate.outstanding_tokens * self.start_spill_factor < best.outstanding_tokens:
                    return candidate, "fallback:spill"
        return None

    def _nearest_levels(self, level: int) -> list[int]:
        """`level`, then the others by distance; on a tie the longer bucket first (it fits)."""
        return sorted(range(len(self.buckets)), key=lambda other: (abs(other - level), other < level))

    def level_for(self, remaining_tokens: float) -> int:
        """The smallest bucket whose max_tokens covers `remaining_tokens` (the longest if none)."""
        level = bisect.bisect_left(self.limits, remaining_tokens)
        return level if level < len(self.limits) else len(self.limits) - 1

    # -- reports -------------------------------------------------------------------------------
    def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int = 0) -> None:
        if output_tokens < 0:
            raise InvalidArgument(f"output_tokens must be >= 0, got {output_tokens}")
        super().turn_done(trajectory_id, worker_id, output_tokens)
        record = self.progress.get(trajectory_id)
        if record is not None:
            record.output_tokens += output_tokens

    def tool_returned(self, trajectory_id: str, tool: str, status: str, payload_tokens: int) -> None:
        super().tool_returned(trajectory_id, tool, status, payload_tokens)
        sig = signature(tool, status, payload_tokens, self.thresholds)
        record = self.progress.get(trajectory_id)
        if record is None:  # routed before this policy knew it (e.g. restored placements)
            return
        record.signatures.append(sig)
        record.produced_at.append(record.output_tokens)
        self.signals[self._decide_move(record)] += 1

    def _decide_move(self, record: Progress) -> str:
        """Set or clear the trajectory's pending move; return what was concluded."""
        if record.moves >= self.max_moves:
            return "pinned"
        stats, _source, _depth = self.forest.lookup(record.prompt_id, record.signatures)
        if stats is None:
            return self._by_work_done(record, "no_signal")
        by_mean, by_p90 = self.level_for(stats.mean), self.level_for(stats.p90)
        if by_mean != by_p90:
            return self._by_work_done(record, "disagree")
        record.target = by_mean if by_mean != record.level else None
        return "stay" if record.target is None else "move"

    def _by_work_done(self, record: Progress, verdict: str) -> str:
        """Without a confident prediction, work done is the causal signal left: a trajectory that
        has already produced more than its bucket's max_tokens goes up one level."""
        if record.level + 1 < len(self.limits) and record.output_tokens > self.limits[record.level]:
            record.target = record.level + 1
            return "move:work"
        return verdict

    def finish(self, trajectory_id: str, prompt_id: str, output_tokens: int) -> None:
        super().finish(trajectory_id, prompt_id, output_tokens)
        record = self.progress.pop(trajectory_id, None)
        if record is None:
            return
        total = max(output_tokens, record.output_tokens)
        remaining = [total] + [max(0, total - produced) for produced in record.produced_at]
        self.forest.insert(prompt_id or record.prompt_id, record.signatures, remaining)

