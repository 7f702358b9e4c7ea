"""C-MLFQ: causality-aware multi-level feedback queue routing, as a deterministic step function.

Buckets are levels ordered by `max_tokens` (the remaining output each is for; longer buckets hold
wider, faster instances). Every decision uses only what a trajectory has causally shown so far,
and its reason names which:

- start: a new trajectory starts where its prompt's history points: the bucket covering the p90
  of the total output of the prompt's recent samples (the root of the prompt's prefix tree),
  "new:history:<bucket>". A prompt never seen starts in the shortest bucket ("new:shortest"),
  unless that bucket queues while another idles ("fallback:spill", `start_spill_factor`).
- work done: a trajectory that has produced more than its bucket's `max_tokens` goes up to the
  bucket that covers what it produced ("move:work:up:<bucket>"), never down. This is LA-MLFQ's
  rule (with the prompt's history at the start, it is all the length history LA-MLFQ has), and
  C-MLFQ's fallback wherever tool outcomes say nothing.
- tool outcomes: each tool return adds a signature (`signatures`); the deepest node of the causal
  prefix tree (`prefix_tree`) that at least one signature leads to and that has >= min_visits
  visits predicts the output still to come. When its mean and p90 map to one bucket the
  trajectory moves there ("move:signal:up|down:<bucket>"), never below what its work done covers.
  A move *down* needs >= `min_visits_down` visits: a long trajectory wrongly sent to a slow bucket
  costs the makespan far more than a short one wrongly sent to a fast bucket. Where outcomes carry
  no signal, nodes disagree (or are too thin to move anything down) and work done decides.

    route(turn) ──▶ new? history / shortest (/ spill) ── pending move? its bucket
                          │                                  │
                          └──── in its bucket already? keep the worker (affinity, under the cap)
                                 └─ else least outstanding tokens under the cap in the bucket
                                    └─ none: nearest other bucket with room ("fallback:bucket")
                                       └─ none: any serving worker ("fallback:any")
    turn_done(output_tokens) ──▶ work done
    tool_returned ──▶ signature ──▶ tree node confident? ──▶ max(its bucket, work floor)
                                             └─ no ──────▶ max(current bucket, work floor)
    finish ──▶ tree insert (total at the root, remaining after each signature)

A trajectory keeps its worker between turns (KV/prefix cache affinity) while that worker is in the
trajectory's bucket and under the per-worker cap; one that overflowed (or spilled) into another
bucket goes back to its own when it has room. Nothing starves: Route never holds a request (a
saturated bucket overflows to the nearest bucket with room, then to any worker), and after
`max_moves` signal moves a trajectory is pinned against the tree (work done still moves it up,
which cannot flip-flop).

No network, no Redis, no clock: the service wraps this and persists `forest.to_bytes()`.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

from libra.errors import InvalidArgument
from libra.routing.policy import Placement, Policy, Turn, Worker, ordered_buckets
from libra.routing.prefix_tree import PrefixForest, Walk
from libra.routing.signatures import SizeThresholds, signature


@dataclass
class Progress:
    """What C-MLFQ knows of one live trajectory (plain fields: the scheduler stores it as JSON)."""

    prompt_id: str
    level: int
    signatures: list[str] = field(default_factory=list)
    produced_at: list[int] = field(default_factory=list)  # output tokens before each signature
    output_tokens: int = 0
    target: int | None = None  # level of a pending move, applied on the next route
    why: str = ""  # what set the pending move: "signal" (tool outcomes) or "work" (work done)
    moves: int = 0  # signal moves so far (hysteresis)
    walk: ClassVar[Walk | None] = None  # the forest's memo of `signatures` (not a field: not stored)


class CMLFQ(Policy):
    """Bucket levels from the prompt's history, work done and tool-outcome prefixes."""

    name = "cmlfq"

    def __init__(self, per_worker_cap_tokens: int, affinity: bool = True,
                 buckets: list[tuple[str, int]] = (("short", 4000),),  # type: ignore[assignment]
                 forest: PrefixForest | None = None, thresholds: SizeThresholds | None = None,
                 max_moves: int = 4, start_spill_factor: float = 2.0, min_visits_down: int = 20):
        super().__init__(per_worker_cap_tokens, affinity)
        ordered = ordered_buckets(list(buckets))
        self.buckets = [name for name, _ in ordered]
        self.limits = [limit for _, limit in ordered]
        self.level_of = {name: level for level, name in enumerate(self.buckets)}
        self.nearest = [self._nearest_levels(level) for level in range(len(self.buckets))]
        self.forest = forest if forest is not None else PrefixForest()
        self.thresholds = thresholds if thresholds is not None else SizeThresholds()
        if max_moves < 0 or min_visits_down < 1:
            raise InvalidArgument(f"max_moves must be >= 0 and min_visits_down >= 1, got {max_moves}, "
                                  f"{min_visits_down}")
        self.max_moves, self.min_visits_down = max_moves, min_visits_down
        if start_spill_factor and start_spill_factor < 1:
            raise InvalidArgument(f"start_spill_factor must be 0 (off) or >= 1, got {start_spill_factor}")
        self.start_spill_factor = start_spill_factor
        self.progress: dict[str, Progress] = {}
        self._levels_of: list[Worker] | None = None  # the serving list `_levels` groups by level
        self._levels: list[list[Worker]] = []
        self.signals: Counter = Counter()  # what tool returns concluded: move:signal, move:work, stay, ...

    # -- routing -------------------------------------------------------------------------------
    def choose(self, turn: Turn, placement: Placement, candidates: list[Worker]) -> tuple[Worker, str]:
        record = self.progress.get(turn.trajectory_id)
        if record is None:
            return self._start(turn, candidates)
        current = self.current(turn, placement)
        if record.target is not None:
            direction = "up" if record.target > record.level else "down"
            record.level, record.target = record.target, None
            reason = f"move:{record.why}:{direction}:{self.buckets[record.level]}"
        elif current is None:
            reason = "reroute:worker_gone"
        else:
            reason = "affinity"
        if self.affinity and current is not None and self.level_of.get(current.bucket) == record.level:
            if current.outstanding_tokens < self.cap or all(w.outstanding_tokens >= self.cap for w in candidates):
                return current, reason  # already in its bucket (e.g. it had overflowed there)
        if reason == "affinity":  # over the cap, or back from an overflow into another bucket
            reason = "least_loaded"
        return self._in_level(record.level, self._by_level(candidates), candidates, reason)

    def _start(self, turn: Turn, candidates: list[Worker]) -> tuple[Worker, str]:
        """The prompt's history, else the shortest bucket with a serving worker (or a spill)."""
        by_level = self._by_level(candidates)
        history = self.forest.prompt_trees.get(turn.prompt_id)
        if history is not None and history.visits[0]:
            level = self.level_for(history.stats(0).p90)
            worker, reason = self._in_level(level, by_level, candidates, f"new:history:{self.buckets[level]}")
        else:
            level = next((level for level, workers in enumerate(by_level) if workers), 0)
            worker, reason = self._in_level(level, by_level, candidates, "new:shortest")
            if reason == "new:shortest" and self.start_spill_factor:
                worker, reason = self._spill(level, worker, by_level) or (worker, reason)
        # a spilled or overflowed start keeps its level: its next turn goes back there if it has room
        self.progress[turn.trajectory_id] = Progress(turn.prompt_id, level)
        return worker, reason

    def _by_level(self, candidates: list[Worker]) -> list[list[Worker]]:
        """Candidates grouped by bucket level (workers of unknown buckets serve only as "any"); for
        all the serving workers (no exclusion), grouped once per change of membership."""
        if candidates is self._levels_of:
            return self._levels
        by_level: list[list[Worker]] = [[] for _ in self.buckets]
        for worker in candidates:
            level = self.level_of.get(worker.bucket)
            if level is not None:
                by_level[level].append(worker)
        if candidates is self._serving:
            self._levels_of, self._levels = candidates, by_level
        return by_level

    def _in_level(self, level: int, by_level: list[list[Worker]], candidates: list[Worker],
                  reason: str) -> tuple[Worker, str]:
        """Least loaded under the cap in `level`, else in the nearest level with room, else anywhere."""
        for nearest in self.nearest[level]:
            worker = self.least_loaded_under_cap(by_level[nearest])
            if worker is not None:
                return worker, reason if nearest == level else "fallback:bucket"
        return self.least_loaded(candidates), "fallback:any"

    def _spill(self, level: int, best: Worker, by_level: list[list[Worker]]) -> tuple[Worker, str] | None:
        """Work conservation at admission: a trajectory of a prompt never seen starts in the shortest
        bucket unless even that bucket's least loaded worker carries more than `start_spill_factor`
        times the load of another bucket's least loaded worker (that bucket idles while this one
        queues); then it starts there (nearest bucket first)."""
        if best.outstanding_tokens == 0:
            return None
        for other in self.nearest[level][1:]:
            candidate = self.least_loaded_under_cap(by_level[other])
            if candidate is not None:
                if candidate.outstanding_tokens * self.start_spill_factor < best.outstanding_tokens:
                    return candidate, "fallback:spill"
        return None

    def _nearest_levels(self, level: int) -> list[int]:
        """`level`, then the others by distance; on a tie the longer bucket first (it fits)."""
        return sorted(range(len(self.buckets)), key=lambda other: (abs(other - level), other < level))

    def level_for(self, tokens: float) -> int:
        """The smallest bucket whose max_tokens covers `tokens` (the longest if none)."""
        level = bisect.bisect_left(self.limits, tokens)
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
        work = self.level_for(record.output_tokens)  # the floor: what it has already produced
        tree, verdict = self._tree_level(record)
        if tree is None:
            target, why = max(record.level, work), "work"
        elif tree >= work:
            target, why = tree, "signal"
        else:  # the tree says less than work done covers: no lower than the floor
            target, why = work, "work" if work > record.level else "signal"
        if target == record.level:
            record.target, record.why = None, ""
            return verdict
        record.target, record.why = target, why
        record.moves += why == "signal"
        return f"move:{why}"

    def _tree_level(self, record: Progress) -> tuple[int | None, str]:
        """The level the tree confidently predicts for what remains, or None and why not."""
        if record.moves >= self.max_moves:
            return None, "pinned"
        walk = record.walk
        if walk is None:
            walk = record.walk = Walk()
        stats, _source, depth = self.forest.lookup(record.prompt_id, record.signatures, walk)
        if stats is None or depth == 0:  # a root knows totals, not what any tool outcome led to
            return None, "no_signal"
        level = self.level_for(stats.mean)
        if level != self.level_for(stats.p90):
            return None, "disagree"
        if level < record.level and stats.visits < self.min_visits_down:
            return None, "weak_down"
        return level, "stay"

    def finish(self, trajectory_id: str, prompt_id: str, output_tokens: int) -> None:
        super().finish(trajectory_id, prompt_id, output_tokens)
        record = self.progress.pop(trajectory_id, None)
        if record is None:
            return
        total = max(output_tokens, record.output_tokens)
        remaining = [total] + [max(0, total - produced) for produced in record.produced_at]
        self.forest.insert(prompt_id or record.prompt_id, record.signatures, remaining)
