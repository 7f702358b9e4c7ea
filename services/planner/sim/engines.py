"""The cost-model instance model: engines batching continuously at the planner's cost model's speed.

One `CostModelInstance` is a vLLM-like engine of TP degree `tp`, or a pool of `replicas` identical
ones treated as one worker (the simulator's resolution knob at thousands of GPUs; with replicas = 1
it is exact). It owns a running batch bounded by `max_seqs` and the KV cache, a FIFO waiting queue,
and a clock. It knows nothing of policies, trajectories' futures or training.

Decode speed comes from `cost_rollout.Instance.decode_step_seconds`, which is linear in the
context the batch reads: step(B, C) = a(B) + kv * C. With B sequences the context grows by B per
step, so between two batch changes n steps take exactly

    T(n) = n (a + kv C) + kv B n^2 / 2        (continuous n; kv per replica: kv_s / replicas)

and the simulator jumps from event to event instead of stepping tokens. Prefill (new prompt,
tool payload, or the whole context after a move or a preemption) and weight syncs are a stall that
pauses the whole batch, as a prefill does in an engine without chunked prefill. A step also pays
the calibrated overheads the roofline lacks (`RolloutEfficiency.step_overhead_s` and
`step_per_seq_s`, 0 by default, through `decode_step_seconds`); measured per generated token, they
include the prefill passes an engine interleaves with its steps, so a prefill stall here costs its
tokens only. A turn's time outside the engine (`request_s`) is the rollout loop's (`rollout.py`).

KV: a turn is admitted only when the cache can hold every admitted sequence's context at the end
of its turn (`reserved`), so the context held never exceeds the capacity (`peak_kv` records it).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from libra.services.planner import cost_rollout
from libra.services.planner.cost_rollout import Infeasible, RolloutEfficiency
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.sim.instance import SimulationError, Unit


@dataclass(eq=False, slots=True)
class CostModelInstance:
    """One engine (or a pool of `replicas`) of the cost model's speed; an `instance.Instance`."""

    wid: str
    tp: int
    replicas: int
    engine: cost_rollout.Instance
    up_at: float = 0.0
    bucket: str = ""
    up: bool = False
    alive: bool = True
    heap: list = field(default_factory=list)  # (progress at which the turn ends, seq, unit)
    waiting: deque = field(default_factory=deque)
    progress: float = 0.0  # decode steps done since start
    seqs: int = 0
    context: float = 0.0  # KV tokens held by running sequences
    reserved: float = 0.0  # KV tokens the running sequences will hold at the end of their turns
    stall: float = 0.0
    last: float = 0.0
    version: int = 0
    busy_s: float = 0.0
    peak_kv: float = 0.0  # largest context / capacity seen
    routed: int = 0
    on_start: Callable[[Unit], None] | None = None  # told when a trajectory's first turn is admitted
    # from the engine (__post_init__)
    kv_s: float = field(init=False, default=0.0)  # seconds per step per KV token read
    seq_capacity: float = field(init=False, default=0.0)
    capacity: float = field(init=False, default=0.0)
    max_seqs: int = field(init=False, default=0)
    prefill_per_token: float = field(init=False, default=0.0)
    request_s: float = field(init=False, default=0.0)  # a turn's time outside the engine
    fixed: float = field(init=False, default=0.0)  # the step's cost without KV reads, at `seqs`
    fixed_by_seqs: dict = field(init=False, default_factory=dict)  # that cost by running sequences

    def __post_init__(self) -> None:
        e = self.engine
        bandwidth = e.gpu.hbm_gbps * 1e9 * e.eff.decode_bw
        self.kv_s = e.kv_bytes_per_token_per_gpu / bandwidth / self.replicas
        self.seq_capacity = e.kv_capacity_tokens
        self.capacity = e.kv_capacity_tokens * self.replicas
        self.max_seqs = e.eff.max_seqs * self.replicas
        self.prefill_per_token = e.prefill_seconds(1) / self.replicas
        self.request_s = e.eff.request_s
        self.last = self.up_at

    def fits(self, unit: Unit) -> bool:
        """Could this instance ever run the unit's turn (one sequence per engine, all copies at once)?"""
        return (unit.final <= self.seq_capacity and unit.copies <= self.max_seqs
                and unit.copies * unit.final <= self.capacity)

    def load_tokens(self) -> int:
        return int(self.reserved + sum(u.copies * u.final for u in self.waiting))

    def requests(self) -> int:
        return len(self.heap) + len(self.waiting)

    def enqueue(self, unit: Unit) -> None:
        self.waiting.append(unit)

    def advance(self, now: float) -> None:
        dt = now - self.last
        if dt <= 0:
            return
        self.last = now
        stall = self.stall
        if stall > 0:
            used = min(stall, dt)
            self.stall = stall - used
            dt -= used
            self.busy_s += used
        seqs = self.seqs
        if seqs and dt > 0:
            kv_s = self.kv_s
            q = kv_s * seqs / 2
            b = self.fixed + kv_s * self.context
            n = 2 * dt / (b + math.sqrt(b * b + 4 * q * dt))
            self.progress += n
            self.context += seqs * n
            self.busy_s += dt

    def next_completion(self) -> float | None:
        heap = self.heap
        if not heap:
            return None
        n = max(0.0, heap[0][0] - self.progress)
        kv_s = self.kv_s
        return self.last + self.stall + n * (self.fixed + kv_s * self.context) + kv_s * self.seqs * n * n / 2

    def admit(self) -> None:
        """FIFO admission while the batch and the KV cache have room (vLLM's first-come order)."""
        waiting = self.waiting
        if not waiting:
            return
        seqs, reserved, admitted = self.seqs, self.reserved, False
        while waiting:
            unit = waiting[0]
            k, final = unit.copies, unit.context + unit.turn_left
            if seqs + k > self.max_seqs or reserved + k * final > self.capacity:
                assert seqs, f"{self.wid} cannot admit a unit it was checked to fit"
                break
            waiting.popleft()
            if unit.turn == 0 and self.on_start is not None:
                self.on_start(unit)
            self.stall += self.prefill_per_token * unit.prefill * k
            heapq.heappush(self.heap, (self.progress + unit.turn_left, unit.seq, unit))
            seqs += k
            self.context += k * unit.context
            reserved += k * final
            admitted = True
        if admitted:
            self.seqs, self.reserved = seqs, reserved
            self._refresh()

    def complete(self) -> Unit:
        """Remove the running turn that ends first (the caller advanced the clock to its end)."""
        _, _, unit = heapq.heappop(self.heap)
        context = self.context
        ratio = context / self.capacity
        if ratio > self.peak_kv:
            self.peak_kv = ratio
        k, final = unit.copies, unit.context + unit.turn_left
        self.seqs -= k
        if self.seqs:
            self.context = context - k * final
            self.reserved -= k * final
        else:
            self.context = self.reserved = 0.0
        self._refresh()
        return unit

    def evict(self) -> list[Unit]:
        """Take every unit off (the instance leaves the plan): progress kept, KV lost."""
        out = []
        for target, _, unit in self.heap:
            left = max(0.0, target - self.progress)
            unit.context += unit.turn_left - left
            unit.turn_left = left
            out.append(unit)
        out.extend(self.waiting)
        self.heap, self.waiting = [], deque()
        self.seqs, self.context, self.reserved = 0, 0.0, 0.0
        self.alive, self.version = False, self.version + 1
        for unit in out:
            unit.kv_on = ""
        return out

    def _refresh(self) -> None:
        """The step's cost without KV reads at the running sequences (cached: the same call for the
        same batch size, a hot path at cluster scale)."""
        seqs = self.seqs
        fixed = self.fixed_by_seqs.get(seqs)
        if fixed is None:
            fixed = self.engine.decode_step_seconds(seqs / self.replicas, 0.0) if seqs else 0.0
            self.fixed_by_seqs[seqs] = fixed
        self.fixed = fixed


class CostModelEngines:
    """Builds `CostModelInstance`s: one cost-model engine per TP degree that holds the model."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, tp_choices: tuple[int, ...], eff: RolloutEfficiency):
        self.model, self.gpu = model, gpu
        self.on_start: Callable[[Unit], None] | None = None  # handed to every instance built from now on
        self.engines: dict[int, cost_rollout.Instance] = {}
        for tp in tp_choices:
            if gpu.gpus_per_node % tp == 0:
                try:
                    self.engines[tp] = cost_rollout.instance(model, gpu, tp, eff)
                except Infeasible:
                    continue
        if not self.engines:
            raise SimulationError(f"no rollout TP degree in {tp_choices} can hold {model.name} on "
                                  f"{gpu.name}: the model does not fit this cluster's GPUs")

    def holds(self, tp: int) -> bool:
        return tp in self.engines

    def max_context_tokens(self) -> float:
        return max(e.kv_capacity_tokens for e in self.engines.values())

    def instance(self, wid: str, bucket: str, tp: int, replicas: int, up_at: float) -> CostModelInstance:
        return CostModelInstance(wid, tp, replicas, self.engines[tp], up_at=up_at, bucket=bucket,
                                 on_start=self.on_start)


def pool_size(rollout: tuple[tuple[int, int], ...], max_workers: int) -> int:
    """Engines behind one simulated worker: 1 while the plan has at most `max_workers` engines."""
    return max(1, math.ceil(sum(n for _, n in rollout) / max_workers))


def split(engines: int, per: int) -> list[int]:
    """`engines` of one TP degree as pools of at most `per`, sizes differing by at most one."""
    groups = math.ceil(engines / per) if engines > 0 else 0
    return [engines // groups + (1 if g < engines % groups else 0) for g in range(groups)]


def pool(rollout: tuple[tuple[int, int], ...], max_workers: int) -> list[tuple[int, int]]:
    """(tp, replicas) per simulated worker: every engine its own worker when there are at most
    `max_workers`, else pools of about equal size per TP degree (sizes differ by at most one)."""
    per = pool_size(rollout, max_workers)
    return [(tp, size) for tp, n in sorted(rollout) for size in split(n, per)]
