"""A true lower bound on the makespan of one rollout window on the simple instance model: no routing
policy, clairvoyant or not, can finish the window sooner.

The model is `simple.SimpleModel`'s, as `rollout.Window` plays it: every trajectory is released at
t=0; its turns run one after another (a trajectory is one sequence, so it runs on at most one
instance at a time), each turn after a tool call that takes the recorded latency. An instance of
tensor parallelism `tp` running `n` sequences (n <= max_batch) advances each of them by one step
every `base_token_s / tp**tp_exponent * (1 + batch_slowdown * (n - 1))` seconds; a turn costs its
output tokens plus its prefill / `prefill_tokens_per_step` steps. The least prefill a trajectory can
pay is its prompt once and each tool payload once (a turn that stays where its KV cache is), so

    work(j) = output tokens of j + (prompt tokens + tool payload tokens of j) / prefill_tokens_per_step

steps, whatever the routing. Two facts then bound every schedule (any assignment of turns to
instances, any order, moves and preemption allowed):

- critical path: a trajectory runs no faster than one step per `base_token_s / tp_max**tp_exponent`
  seconds (the widest instance running it alone), and waits out its tool latencies:
  makespan >= work(j) * base_token_s / tp_max**tp_exponent + latencies(j), for every j;
- capacity over the k longest: at any moment at most k of any k trajectories run, and k running
  sequences make at most C(k) steps per second in all, C(k) being the best spread of k sequences
  over the instances (an instance running n makes n * tp**e / (base * (1 + b(n-1))) steps per
  second, concave in n for b >= 0, so spreading them one at a time where the gain is largest is
  optimal); the k trajectories of most work need makespan >= W_k / C(k) (k = all: total work over
  total capacity).

The bound is the largest of these. It holds for batch_slowdown >= 0 (a model in which batching
speeds every sequence up is refused). Pure arithmetic: no events, no policies.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from libra.errors import InvalidArgument
from libra.services.planner.sim.instance import Group
from libra.services.planner.sim.simple import SimpleParams
from libra.traces.spec import TrajectorySpec, check_spec


@dataclass(frozen=True)
class Bound:
    """The lower bound on a window's makespan and the term that sets it."""

    makespan_s: float  # max(critical_path_s, capacity_s)
    critical_path_s: float  # the slowest trajectory alone on the widest instance, tool latencies included
    critical_trajectory: str
    capacity_s: float  # max over k of (work of the k longest) / (best rate of k sequences)
    capacity_k: int  # the k that sets capacity_s (k = all trajectories: total work over total capacity)

    @property
    def binding(self) -> str:
        """Which term sets the bound, in words."""
        if self.critical_path_s >= self.capacity_s:
            return f"critical path of {self.critical_trajectory}"
        return f"capacity over the {self.capacity_k} longest trajectories"


def trajectory_work(spec: TrajectorySpec, params: SimpleParams) -> float:
    """The fewest decode steps a trajectory costs: its outputs, its prompt and payloads prefilled once."""
    return spec.output_tokens + (spec.prompt_tokens + spec.payload_tokens) / params.prefill_tokens_per_step


def sequence_rate(tp: int, running: int, params: SimpleParams) -> float:
    """Steps per second one instance of `tp` makes in all while it runs `running` sequences."""
    return running * tp ** params.tp_exponent / (params.base_token_s * (1 + params.batch_slowdown * (running - 1)))


def lower_bound(layout: Sequence[Group], trace: Sequence[TrajectorySpec],
                params: SimpleParams = SimpleParams()) -> Bound:
    """The lower bound on the makespan of `trace` released at once on `layout` (module docstring)."""
    tps = _check(layout, trace, params)
    work = {spec.trajectory_id: trajectory_work(spec, params) for spec in trace}
    fastest = params.base_token_s / max(tps) ** params.tp_exponent  # seconds per step, alone, widest
    paths = {spec.trajectory_id: work[spec.trajectory_id] * fastest + sum(t.latency_s for t in spec.turns[:-1])
             for spec in trace}
    critical = max(paths, key=lambda tid: (paths[tid], tid))
    capacity_s, capacity_k = _capacity_bound(sorted(work.values(), reverse=True), tps, params)
    return Bound(max(paths[critical], capacity_s), paths[critical], critical, capacity_s, capacity_k)


def _capacity_bound(works: list[float], tps: list[int], params: SimpleParams) -> tuple[float, int]:
    """max over k of W_k / C(k), with C(k) grown one sequence at a time where it gains most."""
    running = [0] * len(tps)
    gains = [(-sequence_rate(tp, 1, params), i) for i, tp in enumerate(tps)]  # gain of the next sequence
    heapq.heapify(gains)
    rate = total = best = 0.0
    best_k = 0
    for k, work in enumerate(works, start=1):
        total += work
        if gains and -gains[0][0] > 0:  # a gain <= 0 (b >= 1 past one sequence): C(k) = C(k-1)
            gain, i = heapq.heappop(gains)
            rate -= gain
            running[i] += 1
            if running[i] < params.max_batch:
                now = sequence_rate(tps[i], running[i], params)
                heapq.heappush(gains, (now - sequence_rate(tps[i], running[i] + 1, params), i))
        if total / rate > best:
            best, best_k = total / rate, k
    return best, best_k


def _check(layout: Sequence[Group], trace: Sequence[TrajectorySpec], params: SimpleParams) -> list[int]:
    """The tp of every instance of the layout, after checking the layout, the trace and the model."""
    if not trace:
        raise InvalidArgument("the makespan bound needs at least one trajectory; the trace is empty")
    for spec in trace:
        check_spec(spec, f"trajectory {spec.trajectory_id!r}")
        if spec.copies != 1:
            raise InvalidArgument(f"trajectory {spec.trajectory_id!r} stands for {spec.copies} copies; the simple "
                                  f"instance model runs one sequence per trajectory (use copies 1)")
    for group in layout:
        if group.tp < 1 or group.count < 0:
            raise InvalidArgument(f"layout group {group}: tp must be >= 1 and count >= 0")
    tps = [group.tp for group in layout for _ in range(group.count)]
    if not tps:
        raise InvalidArgument("the layout has no instances: give at least one bucket group with count >= 1")
    if params.base_token_s <= 0 or params.max_batch < 1 or params.prefill_tokens_per_step < 1:
        raise InvalidArgument(f"{params}: base_token_s must be > 0, max_batch and prefill_tokens_per_step >= 1")
    if params.batch_slowdown < 0:
        raise InvalidArgument(f"batch_slowdown={params.batch_slowdown}: the bound assumes batching never speeds a "
                              f"sequence up (>= 0)")
    return tps
