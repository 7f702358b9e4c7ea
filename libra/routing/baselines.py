"""The baseline routing policies that C-MLFQ is measured against, behind the same `Policy` interface.

`LoadBalance` ("load_balance") sends each model turn to the serving worker with the fewest
outstanding tokens, rotating among ties, and keeps a trajectory on its worker between turns
(prefix-cache affinity) unless that worker is over its cap while another has room.

The three bucket policies map a length to a bucket level (the smallest bucket whose `max_tokens`
covers it, the longest if none does) and differ only in *which* length they trust:

- `LengthAware` ("length_aware"): the prompt length of the turn (`Turn.prompt_tokens`);
- `LAMLFQ` ("la_mlfq"): length-based demotion. A trajectory starts in the shortest bucket (or,
  for a prompt seen before, in the bucket of that prompt's last observed total output) and is
  demoted one bucket each time its output so far exceeds its bucket's `max_tokens`;
- `Clairvoyant` ("clairvoyant"): the true remaining output of the trajectory, from a
  `remaining_of` callable. For evaluation only (the simulator knows the future; the service does
  not). It is a heuristic that knows the future, not an optimal schedule: it bounds nothing (the
  evaluation's bound is `services/planner/sim/bound.py`), and other policies may beat it.

    route(turn) ──▶ target level (per policy) ──▶ same level as the worker? keep it (affinity)
                         └─ else least outstanding tokens under the cap in that bucket
                            └─ none: nearest other bucket with room ("fallback:bucket")
                               └─ none: any serving worker ("fallback:any")

Pure logic: no network, no Redis, no clock, no randomness.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Callable

from libra.errors import InvalidArgument
from libra.routing.policy import Placement, Policy, Turn, Worker, ordered_buckets


class LoadBalance(Policy):
    """Least outstanding tokens with rotating ties, and worker affinity under the cap."""

    name = "load_balance"

    def choose(self, turn: Turn, placement: Placement, candidates: list[Worker]) -> tuple[Worker, str]:
        current = self.current(turn, placement)
        if self.affinity and current is not None:
            if current.outstanding_tokens < self.cap or all(w.outstanding_tokens >= self.cap for w in candidates):
                return current, "affinity"
        reason = "new:least_loaded" if placement.worker_id is None else "least_loaded"
        if placement.worker_id is not None and current is None:
            reason = "reroute:worker_gone"
        # the least loaded under the cap if any is (it is the least loaded of all), else of all
        return self.least_loaded(candidates), reason


class BucketPolicy(Policy):
    """A policy that picks a bucket level per turn, then a worker inside it (shared mechanics)."""

    name = "bucket_policy"

    def __init__(self, per_worker_cap_tokens: int, affinity: bool = True,
                 buckets: list[tuple[str, int]] = (("short", 4000),)):  # type: ignore[assignment]
        super().__init__(per_worker_cap_tokens, affinity)
        ordered = ordered_buckets(list(buckets))
        self.buckets = [name for name, _ in ordered]
        self.limits = [limit for _, limit in ordered]
        self.level_of = {name: level for level, name in enumerate(self.buckets)}

    def level_for(self, tokens: float) -> int:
        """The smallest bucket whose max_tokens covers `tokens` (the longest if none)."""
        level = bisect.bisect_left(self.limits, tokens)
        return min(level, len(self.limits) - 1)

    def choose(self, turn: Turn, placement: Placement, candidates: list[Worker]) -> tuple[Worker, str]:
        level, reason = self.target_level(turn, placement)
        current = self.current(turn, placement)
        if self.affinity and current is not None and self.level_of.get(current.bucket) == level:
            if current.outstanding_tokens < self.cap or all(w.outstanding_tokens >= self.cap for w in candidates):
                return current, "affinity"
        return self.in_level(level, candidates, reason)

    def target_level(self, turn: Turn, placement: Placement) -> tuple[int, str]:
        """The level this turn should run in, and the reason to report if it lands there."""
        raise NotImplementedError

    def in_level(self, level: int, candidates: list[Worker], reason: str) -> tuple[Worker, str]:
        """Least loaded under the cap in `level`, else in the nearest level with room, else anywhere."""
        by_level: list[list[Worker]] = [[] for _ in self.buckets]
        for worker in candidates:
            if worker.bucket in self.level_of:
                by_level[self.level_of[worker.bucket]].append(worker)
        # `level` first, then the others by distance; on a tie the longer bucket (it fits)
        for nearest in sorted(range(len(self.buckets)), key=lambda other: (abs(other - level), other < level)):
            worker = self.least_loaded_under_cap(by_level[nearest])
            if worker is not None:
                return worker, reason if nearest == level else "fallback:bucket"
        return self.least_loaded(candidates), "fallback:any"


class LengthAware(BucketPolicy):
    """The bucket that fits the turn's prompt length."""

    name = "length_aware"

    def target_level(self, turn: Turn, placement: Placement) -> tuple[int, str]:
        level = self.level_for(turn.prompt_tokens)
        return level, f"prompt_length:{self.buckets[level]}"


class LAMLFQ(BucketPolicy):
    """Start short (or where the prompt's history says), demote when output outgrows the bucket."""

    name = "la_mlfq"

    def __init__(self, per_worker_cap_tokens: int, affinity: bool = True,
                 buckets: list[tuple[str, int]] = (("short", 4000),),  # type: ignore[assignment]
                 max_history: int = 10_000):
        super().__init__(per_worker_cap_tokens, affinity, buckets)
        if max_history < 1:
            raise InvalidArgument(f"max_history must be >= 1, got {max_history}")
        self.max_history = max_history
        self.history: OrderedDict[str, int] = OrderedDict()  # prompt id -> last total output
        self.levels: dict[str, int] = {}
        self.produced: dict[str, int] = {}

    def target_level(self, turn: Turn, placement: Placement) -> tuple[int, str]:
        tid = turn.trajectory_id
        if tid not in self.levels:
            known = self.history.get(turn.prompt_id)
            self.levels[tid], self.produced[tid] = (0, 0) if known is None else (self.level_for(known), 0)
            return self.levels[tid], "new:shortest" if known is None else "new:history"
        level, demoted = self.levels[tid], False
        while level < len(self.limits) - 1 and self.produced[tid] > self.limits[level]:
            level, demoted = level + 1, True
        self.levels[tid] = level
        return level, f"demote:{self.buckets[level]}" if demoted else "least_loaded"

    def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int = 0) -> None:
        if output_tokens < 0:
            raise InvalidArgument(f"output_tokens must be >= 0, got {output_tokens}")
        super().turn_done(trajectory_id, worker_id, output_tokens)
        if trajectory_id in self.produced:
            self.produced[trajectory_id] += output_tokens

    def finish(self, trajectory_id: str, prompt_id: str, output_tokens: int) -> None:
        super().finish(trajectory_id, prompt_id, output_tokens)
        self.levels.pop(trajectory_id, None)
        total = max(output_tokens, self.produced.pop(trajectory_id, 0))
        self.history.pop(prompt_id, None)
        self.history[prompt_id] = total  # most recent last; the oldest prompt is evicted first
        while len(self.history) > self.max_history:
            self.history.popitem(last=False)


class Clairvoyant(BucketPolicy):
    """The bucket that fits the trajectory's true remaining output (evaluation only)."""

    name = "clairvoyant"

    def __init__(self, per_worker_cap_tokens: int, affinity: bool = True,
                 buckets: list[tuple[str, int]] = (("short", 4000),),  # type: ignore[assignment]
                 remaining_of: Callable[[str], int] | None = None):
        super().__init__(per_worker_cap_tokens, affinity, buckets)
        if remaining_of is None:
            raise InvalidArgument("the clairvoyant policy needs remaining_of(trajectory_id) -> int: it is for "
                                  "evaluation (benchmarks/scheduler_eval.py), not for the service")
        self.remaining_of = remaining_of

    def target_level(self, turn: Turn, placement: Placement) -> tuple[int, str]:
        level = self.level_for(self.remaining_of(turn.trajectory_id))
        return level, f"clairvoyant:{self.buckets[level]}"

