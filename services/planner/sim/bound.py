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

- relaxation (a linear programme, `relaxation_bound`): the two facts above each let the longest
  trajectories run fast together, which they cannot all do at once: a sequence that advances at
  rate r on an instance of alone-rate R shares it with at most n(r) = 1 + (R / r - 1) / b
  sequences, so it holds at least g(r) = 1 / n(r) of that instance while it runs (at least
  1 / max_batch in any case), and the shares of one instance's sequences sum to at most 1 at any
  moment. For every trajectory j and instance group k, let t(j,k) be the seconds j runs there, w(j,k)
  the steps it makes there, s(j,k) the instance-seconds it holds; then in every schedule
      sum_k w(j,k) = work(j);  w(j,k) <= R_k t(j,k);  sum_k t(j,k) + latencies(j) <= makespan;
      s(j,k) >= a t(j,k) + c w(j,k) for every tangent a + c r of the convex g_k (under g_k at every moment);
      s(j,k) >= w(j,k) / (R_k max_batch);  sum_j s(j,k) <= count_k makespan.
  The least makespan of this programme (HiGHS, through scipy) bounds every schedule, and is at
  least the two terms above up to the tangents' spacing.

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


TANGENTS = 24  # lines under each group's share curve g (more: a tighter relaxation, a larger programme)
RELAXATION_SLACK = 1e-6  # the solver's optimum is exact to its tolerances (1e-7); this keeps it under the truth


@dataclass(frozen=True)
class Bound:
    """The lower bound on a window's makespan and the term that sets it."""

    makespan_s: float  # max(critical_path_s, capacity_s, relaxation_s)
    critical_path_s: float  # the slowest trajectory alone on the widest instance, tool latencies included
    critical_trajectory: str
    capacity_s: float  # max over k of (work of the k longest) / (best rate of k sequences)
    capacity_k: int  # the k that sets capacity_s (k = all trajectories: total work over total capacity)
    relaxation_s: float = 0.0  # the linear programme's least makespan (0: not computed)

    @property
    def binding(self) -> str:
        """Which term sets the bound, in words."""
        if self.relaxation_s > max(self.critical_path_s, self.capacity_s):
            return "relaxation: the longest trajectories share the fast instances"
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
                params: SimpleParams = SimpleParams(), relaxation: bool = True) -> Bound:
    """The lower bound on the makespan of `trace` released at once on `layout` (module docstring);
    `relaxation=False` leaves out the linear programme (two closed-form terms only)."""
    tps = _check(layout, trace, params)
    work = {spec.trajectory_id: trajectory_work(spec, params) for spec in trace}
    fastest = params.base_token_s / max(tps) ** params.tp_exponent  # seconds per step, alone, widest
    paths = {spec.trajectory_id: work[spec.trajectory_id] * fastest + latencies(spec) for spec in trace}
    critical = max(paths, key=lambda tid: (paths[tid], tid))
    capacity_s, capacity_k = _capacity_bound(sorted(work.values(), reverse=True), tps, params)
    relaxation_s = _relaxation(layout, trace, params, [work[spec.trajectory_id] for spec in trace],
                               TANGENTS) if relaxation else 0.0
    return Bound(max(paths[critical], capacity_s, relaxation_s), paths[critical], critical, capacity_s, capacity_k,
                 relaxation_s)


def latencies(spec: TrajectorySpec) -> float:
    """Seconds a trajectory spends in its tool calls (every turn but the last ends in one)."""
    return sum(t.latency_s for t in spec.turns[:-1])


def relaxation_bound(layout: Sequence[Group], trace: Sequence[TrajectorySpec], params: SimpleParams = SimpleParams(),
                     tangents: int = TANGENTS) -> float:
    """The linear programme's least makespan (module docstring): instances of one group pooled,
    every trajectory free to split its work over the groups at any rates. It has (3 + tangents)
    rows per trajectory and group: a second or two for a window of 400 trajectories on three
    groups, more for much larger windows."""
    _check(layout, trace, params)
    return _relaxation(layout, trace, params, [trajectory_work(spec, params) for spec in trace], tangents)


def _relaxation(layout: Sequence[Group], trace: Sequence[TrajectorySpec], params: SimpleParams,
                works: list[float], tangents: int) -> float:
    """`relaxation_bound` on checked input, each trajectory's work given."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import csr_matrix

    groups = [(group.tp, group.count) for group in layout if group.count > 0]
    n_groups, b = len(groups), params.batch_slowdown
    alone = [tp ** params.tp_exponent / params.base_token_s for tp, _ in groups]  # steps per second, alone
    lines = [_share_tangents(rate, b, tangents) for rate in alone]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    upper: list[float] = []

    def row(entries: list[tuple[int, float]], bound: float) -> None:
        for col, value in entries:
            rows.append(len(upper))
            cols.append(col)
            vals.append(value)
        upper.append(bound)

    def var(j: int, k: int, what: int) -> int:  # column 0 is the makespan; then (t, w, s) per (j, k)
        return 1 + 3 * (j * n_groups + k) + what

    for j, spec in enumerate(trace):
        row([(var(j, k, 0), 1.0) for k in range(n_groups)] + [(0, -1.0)], -latencies(spec))
        for k, rate in enumerate(alone):
            t, w, s = var(j, k, 0), var(j, k, 1), var(j, k, 2)
            row([(w, 1.0), (t, -rate)], 0.0)
            row([(w, 1.0 / (rate * params.max_batch)), (s, -1.0)], 0.0)
            for a, c in lines[k]:
                row([(t, a), (w, c), (s, -1.0)], 0.0)
    for k, (_, count) in enumerate(groups):
        row([(var(j, k, 2), 1.0) for j in range(len(trace))] + [(0, -float(count))], 0.0)
    columns = 1 + 3 * len(trace) * n_groups
    equal = csr_matrix(([1.0] * (len(trace) * n_groups),
                        ([j for j in range(len(trace)) for _ in range(n_groups)],
                         [var(j, k, 1) for j in range(len(trace)) for k in range(n_groups)])),
                       shape=(len(trace), columns))
    cost = np.zeros(columns)
    cost[0] = 1.0
    solved = linprog(cost, A_ub=csr_matrix((vals, (rows, cols)), shape=(len(upper), columns)), b_ub=upper,
                     A_eq=equal, b_eq=works, bounds=(0, None),
                     method="highs")
    if solved.status != 0:
        raise RuntimeError(f"the makespan relaxation did not solve: {solved.message}")
    return float(solved.x[0]) * (1 - RELAXATION_SLACK)


def _share_tangents(alone: float, b: float, count: int) -> list[tuple[float, float]]:
    """Lines a + c r under the share g(r) = b r / (R - (1 - b) r) that a sequence advancing at rate r
    holds of an instance of alone-rate R (convex in r, so each tangent lies under it), touching it
    at `count` rates that crowd towards R, where it bends."""
    lines = []
    for k in range(1, count + 1):
        r = alone * (k / count) ** 0.5
        room = alone - (1 - b) * r  # 0 at r = R when b = 0: no slowdown, no share to bound
        if room > 0:
            slope = b * alone / room ** 2
            lines.append((b * r / room - slope * r, slope))
    return lines


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
