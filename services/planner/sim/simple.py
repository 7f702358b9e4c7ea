"""The simple instance model: what the scheduler evaluation measures routing on.

An instance of tensor parallelism `tp` decodes one token per running sequence per step; a step
takes `base_token_s / tp**tp_exponent * (1 + batch_slowdown * (running - 1))`, and at most
`max_batch` sequences run at once, the rest wait FIFO. With `tp_exponent` < 1 a wider instance
buys per-token speed (latency) at the price of throughput per GPU, the trade-off that makes
routing long trajectories to wide instances and short ones to narrow instances pay. A turn first
prefills (the whole context when it lands where its KV cache is not, only the new tool payload
when it stays); prefill costs `1 / prefill_tokens_per_step` of a step per token, added to that
sequence's own work. Between batch changes all running sequences advance at the same rate, so
the simulator jumps from event to event instead of token to token.

No memory limit, no partial progress kept when an instance is taken down (the turn starts again
elsewhere), one sequence per trajectory (`copies` must be 1). A weight sync's `stall` pauses the
batch. Deterministic: ties between sequences finishing together go by trajectory id.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from libra.services.planner.sim.instance import SimulationError, Unit


@dataclass(frozen=True)
class SimpleParams:
    base_token_s: float = 0.02
    tp_exponent: float = 0.8
    batch_slowdown: float = 0.01
    max_batch: int = 64  # sequences one instance decodes at once, whatever its tp
    prefill_tokens_per_step: int = 512


class SimpleInstance:
    """One instance of the simple model: running batch, FIFO waiting queue, busy time."""

    replicas = 1
    seq_capacity = capacity = math.inf
    peak_kv = 0.0

    def __init__(self, wid: str, bucket: str, tp: int, params: SimpleParams, up_at: float = 0.0):
        self.wid, self.bucket, self.tp, self.params = wid, bucket, tp, params
        self.max_seqs = params.max_batch
        self.running: dict[Unit, float] = {}  # unit -> work left, in steps
        self.waiting: deque[Unit] = deque()
        self.last, self.busy_s, self.stall, self.version, self.routed = up_at, 0.0, 0.0, 0, 0
        self.request_s = 0.0
        self.up, self.alive = False, True

    def fits(self, unit: Unit) -> bool:
        return unit.copies == 1

    def load_tokens(self) -> int:
        return int(sum(u.final for u in self.running) + sum(u.final for u in self.waiting))

    def requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def step_s(self) -> float:
        p = self.params
        return p.base_token_s / self.tp ** p.tp_exponent * (1 + p.batch_slowdown * (len(self.running) - 1))

    def advance(self, now: float) -> None:
        if self.stall > 0:  # a weight sync: no progress while it lasts
            used = min(self.stall, max(0.0, now - self.last))
            self.stall -= used
            self.busy_s += used
            self.last += used
        if self.running:
            done = (now - self.last) / self.step_s()
            for unit in self.running:
                self.running[unit] -= done
            self.busy_s += now - self.last
        self.last = now

    def enqueue(self, unit: Unit) -> None:
        if unit.copies != 1:
            raise SimulationError(f"the simple instance model runs one sequence per trajectory; "
                                  f"{unit.spec.trajectory_id!r} stands for {unit.copies} (use copies 1)")
        self.waiting.append(unit)

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_seqs:
            unit = self.waiting.popleft()
            self.running[unit] = unit.turn_left + unit.prefill / self.params.prefill_tokens_per_step

    def _first(self) -> Unit:
        return min(self.running, key=lambda u: (self.running[u], u.spec.trajectory_id))

    def next_completion(self) -> float | None:
        if not self.running:
            return None
        return self.last + self.stall + max(0.0, self.running[self._first()]) * self.step_s()

    def complete(self) -> Unit:
        """Remove the running turn that ends first (the caller advanced the clock to its end)."""
        unit = self._first()
        del self.running[unit]
        return unit

    def evict(self) -> list[Unit]:
        """Take every unit off (the instance leaves the plan); their turns start again elsewhere."""
        out = list(self.running) + list(self.waiting)
        self.running, self.waiting = {}, deque()
        self.alive, self.version = False, self.version + 1
        for unit in out:
            unit.kv_on = ""
        return out


@dataclass(frozen=True)
class SimpleModel:
    """Builds `SimpleInstance`s of any TP degree; engines are never pooled (replicas must be 1)."""

    params: SimpleParams = SimpleParams()

    def holds(self, tp: int) -> bool:
        return tp >= 1

    def max_context_tokens(self) -> float:
        return math.inf

    def instance(self, wid: str, bucket: str, tp: int, replicas: int, up_at: float) -> SimpleInstance:
        if replicas != 1:
            raise SimulationError(f"the simple instance model simulates engines one by one, got a pool of "
                                  f"{replicas} for {wid}; raise max_workers")
        return SimpleInstance(wid, bucket, tp, self.params, up_at)
