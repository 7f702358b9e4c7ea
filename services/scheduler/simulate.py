"""A small discrete-event simulator of the rollout side, to evaluate routing policies offline.

It owns a layout of inference instances, a trace of multi-turn trajectories and a clock; it does
not own routing: every model turn is routed by a real `Policy` object (the classes the scheduler
service runs), called exactly like the rollout gateway calls it:

    route(Turn) ──▶ instance batch ──decode──▶ turn_done(output) ─┬─ last turn: finish(total)
        ▲                                                          └─ tool_returned(signature)
        └──────────────── tool latency ◀───────────────────────────┘

Instance model. An instance of tensor parallelism `tp` decodes one token per running sequence per
step; a step takes `base_token_s / tp**tp_exponent * (1 + batch_slowdown * (running - 1))`, and
at most `max_batch` sequences run at once, the rest wait FIFO. With `tp_exponent` < 1 a wider
instance buys per-token speed (latency) at the price of throughput per GPU, the trade-off that
makes routing long trajectories to wide instances and short ones to narrow instances pay. A turn first prefills: the whole context when the trajectory lands on an instance that does
not hold its KV cache (new, or moved), only the new tool payload when it stays; prefill costs
`1 / prefill_tokens_per_step` of a step per token. Between batch changes all running sequences
advance at the same rate, so the simulator jumps from event to event instead of token to token.

Traces. `signal_trace` draws long-tailed trajectories whose first tool outcome predicts the rest
(`search:large:success` → long continuation, `search:small:success` → medium,
`calc:small:failure` → short); `no_signal_trace` keeps the very same lengths but draws every tool
outcome at random, so outcomes carry no information. Learning: policies learn continuously from
`finish`; the benchmark also runs each policy once over a warm-up trace first (same object).

Deterministic: no wall clock; all randomness comes from a seeded `random.Random`.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from libra.errors import InvalidArgument
from libra.services.scheduler.core import Policy, Turn, Worker


@dataclass(frozen=True)
class Tool:
    """One tool call after a model turn: its structured outcome and how long it takes."""

    name: str
    status: str
    payload_tokens: int
    latency_s: float


@dataclass(frozen=True)
class TrajectorySpec:
    """A trajectory of the trace: output tokens per model turn, and a tool between turns."""

    trajectory_id: str
    prompt_id: str
    prompt_tokens: int
    outputs: tuple[int, ...]
    tools: tuple[Tool, ...]  # len(outputs) - 1

    def __post_init__(self) -> None:
        if not self.outputs or len(self.tools) != len(self.outputs) - 1:
            raise InvalidArgument(f"trajectory {self.trajectory_id}: needs >= 1 turn and one tool between "
                                  f"turns, got {len(self.outputs)} turns and {len(self.tools)} tools")


@dataclass(frozen=True)
class Group:
    """`count` identical instances of tensor parallelism `tp` serving `bucket`."""

    bucket: str
    tp: int
    count: int


@dataclass(frozen=True)
class SimParams:
    base_token_s: float = 0.02
    tp_exponent: float = 0.8
    batch_slowdown: float = 0.01
    max_batch: int = 64  # sequences one instance decodes at once, whatever its tp
    prefill_tokens_per_step: int = 512
    turn_budget_tokens: int = 4096  # the max_new_tokens the gateway sends with each turn


@dataclass
class Result:
    makespan_s: float
    trajectories_per_s: float
    tokens_per_s: float
    busy: dict[str, float]  # bucket -> mean fraction of the makespan its instances were decoding
    moves: int
    reasons: Counter = field(default_factory=Counter)


class Instance:
    """One inference instance: running batch, FIFO waiting queue, busy time."""

    def __init__(self, worker: Worker, params: SimParams):
        self.worker, self.params = worker, params
        self.max_batch = params.max_batch
        self.running: dict[str, float] = {}  # trajectory id -> work left, in steps
        self.waiting: deque[tuple[str, float]] = deque()
        self.last, self.busy_s, self.version = 0.0, 0.0, 0

    def step_s(self) -> float:
        p = self.params
        return p.base_token_s / self.worker.tp ** p.tp_exponent * (1 + p.batch_slowdown * (len(self.running) - 1))

    def advance(self, now: float) -> None:
        if self.running:
            done = (now - self.last) / self.step_s()
            for tid in self.running:
                self.running[tid] -= done
            self.busy_s += now - self.last
        self.last = now

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            tid, work = self.waiting.popleft()
            self.running[tid] = work

    def next_completion(self) -> tuple[float, str] | None:
        if not self.running:
            return None
        tid = min(self.running, key=lambda t: (self.running[t], t))
        return self.last + max(0.0, self.running[tid]) * self.step_s(), tid


class Simulator:
    """Replays one trace on one layout, routing every turn through `policy`."""

    def __init__(self, layout: list[Group], trace: list[TrajectorySpec], params: SimParams = SimParams()):
        if not layout or not trace:
            raise InvalidArgument("the simulator needs at least one instance group and one trajectory")
        self.params, self.trace = params, {spec.trajectory_id: spec for spec in trace}
        self.instances: dict[str, Instance] = {}
        for group in layout:
            for i in range(group.count):
                wid = f"{group.bucket}-tp{group.tp}-{i}"
                self.instances[wid] = Instance(Worker(wid, group.bucket, f"sim://{wid}", group.tp), params)
        self.remaining: dict[str, int] = {}

    def remaining_of(self, trajectory_id: str) -> int:
        """True output tokens the trajectory still has to generate (the oracle's crystal ball)."""
        return self.remaining[trajectory_id]

    def run(self, policy: Policy) -> Result:
        for instance in self.instances.values():
            policy.register(Worker(**vars(instance.worker)))
        self.events: list = []
        self.seq, self.moves, self.reasons = 0, 0, Counter()
        self.turn = {tid: 0 for tid in self.trace}
        self.context = {tid: spec.prompt_tokens for tid, spec in self.trace.items()}
        self.kv_on: dict[str, str] = {}
        self.last_finish = 0.0  # not the last event: a stale completion may pop after it
        for tid in self.trace:
            self._route(policy, tid, 0.0, new_tokens=self.trace[tid].prompt_tokens)
        while self.events:
            now, _, kind, key, version = heapq.heappop(self.events)
            if kind == "tool":
                spec, k = self.trace[key], self.turn[key]
                self._route(policy, key, now, new_tokens=spec.tools[k - 1].payload_tokens)
            elif version == self.instances[key].version:
                self._complete(policy, self.instances[key], now)
        return self._result(self.last_finish)

    def _push(self, when: float, kind: str, key: str, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, key, version))

    def _route(self, policy: Policy, tid: str, now: float, new_tokens: int) -> None:
        spec, k = self.trace[tid], self.turn[tid]
        self.remaining[tid] = sum(spec.outputs[k:])
        decision = policy.route(Turn(tid, spec.prompt_id, k, self.context[tid], self.params.turn_budget_tokens))
        self.moves += decision.moved
        self.reasons[decision.reason] += 1
        prefill = new_tokens if self.kv_on.get(tid) == decision.worker_id else self.context[tid]
        self.kv_on[tid] = decision.worker_id
        instance = self.instances[decision.worker_id]
        instance.advance(now)
        instance.waiting.append((tid, spec.outputs[k] + prefill / self.params.prefill_tokens_per_step))
        self._reschedule(instance)

    def _reschedule(self, instance: Instance) -> None:
        instance.admit()
        instance.version += 1
        upcoming = instance.next_completion()
        if upcoming is not None:
            self._push(upcoming[0], "done", instance.worker.worker_id, instance.version)

    def _complete(self, policy: Policy, instance: Instance, now: float) -> None:
        instance.advance(now)
        _, tid = instance.next_completion()
        del instance.running[tid]
        spec, k = self.trace[tid], self.turn[tid]
        policy.turn_done(tid, instance.worker.worker_id, spec.outputs[k])
        self.context[tid] += spec.outputs[k]
        if k + 1 < len(spec.outputs):
            tool = spec.tools[k]
            policy.tool_returned(tid, tool.name, tool.status, tool.payload_tokens)
            self.context[tid] += tool.payload_tokens
            self.turn[tid] = k + 1
            self._push(now + tool.latency_s, "tool", tid)
        else:
            policy.finish(tid, spec.prompt_id, sum(spec.outputs))
            self.last_finish = now
        self._reschedule(instance)

    def _result(self, makespan: float) -> Result:
        busy: dict[str, list[float]] = {}
        for instance in self.instances.values():
            busy.setdefault(instance.worker.bucket, []).append(instance.busy_s / makespan if makespan else 0.0)
        tokens = sum(sum(spec.outputs) for spec in self.trace.values())
        return Result(makespan, len(self.trace) / makespan, tokens / makespan,
                      {bucket: sum(v) / len(v) for bucket, v in busy.items()}, self.moves, self.reasons)


# -- synthetic traces ----------------------------------------------------------------------------
# class -> (first tool, continuation tokens range, further turns range, tool between further turns)
CLASSES = {
    "long": (("search", "success", (3000, 6000)), (8000, 24000), (3, 5), ("search", "success", (400, 1500))),
    "medium": (("search", "success", (60, 250)), (1500, 5000), (2, 3), ("python", "success", (20, 200))),
    "short": (("calc", "failure", (5, 60)), (100, 600), (1, 1), None),
}
RANDOM_TOOLS = [("search", "success", (3000, 6000)), ("search", "success", (60, 250)),
                ("calc", "failure", (5, 60)), ("python", "success", (20, 200)), ("search", "success", (400, 1500))]


def _tool(rng: random.Random, kind: tuple) -> Tool:
    name, status, (low, high) = kind
    return Tool(name, status, rng.randint(low, high), rng.uniform(0.5, 3.0))


def signal_trace(n: int, seed: int, n_prompts: int | None = None, prefix: str = "t") -> list[TrajectorySpec]:
    """Long-tailed trajectories whose first tool outcome predicts how much is left to generate."""
    rng = random.Random(seed)
    prompt_mix = random.Random(f"prompts:{seed // 1000}")  # same prompt pool for seeds of one family
    n_prompts = n_prompts or max(1, n // 4)
    p_long = [prompt_mix.choice((0.03, 0.1, 0.3)) for _ in range(n_prompts)]
    trace = []
    for i in range(n):
        prompt = rng.randrange(n_prompts)
        draw = rng.random()
        cls = "long" if draw < p_long[prompt] else "medium" if draw < p_long[prompt] + 0.35 else "short"
        first, (low, high), (t_low, t_high), between = CLASSES[cls]
        turns = rng.randint(t_low, t_high)
        total = int(low * (high / low) ** rng.random())  # log-uniform: a long tail inside each class
        cuts = sorted(rng.randint(1, total - 1) for _ in range(turns - 1))
        continuation = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        tools = [_tool(rng, first)] + [_tool(rng, between) for _ in range(turns - 1)]
        trace.append(TrajectorySpec(f"{prefix}{i}", f"p{prompt}", rng.randint(200, 1200),
                                    (rng.randint(150, 400), *continuation), tuple(tools)))
    return trace


def no_signal_trace(n: int, seed: int, n_prompts: int | None = None, prefix: str = "t") -> list[TrajectorySpec]:
    """The same trajectories as `signal_trace(n, seed)` with every tool outcome drawn at random."""
    rng = random.Random(f"noise:{seed}")
    return [TrajectorySpec(spec.trajectory_id, spec.prompt_id, spec.prompt_tokens, spec.outputs,
                           tuple(_tool(rng, rng.choice(RANDOM_TOOLS)) for _ in spec.tools))
            for spec in signal_trace(n, seed, n_prompts, prefix)]


def recorded_trace(path: str, n: int, seed: int, prefix: str = "t") -> list[TrajectorySpec]:
    """`n` trajectories drawn (with replacement, by seed) from a trace a real run recorded.

    The run's prompt ids are kept, so prompt trees learn across draws as they did in the run; the
    recorded tool latencies and outcomes are replayed as they happened (libra/trace_record.py).
    """
    records = _recorded(path)
    rng = random.Random(seed)
    trace = []
    for i in range(n):
        record = records[rng.randrange(len(records))]
        tools = tuple(Tool(t["name"], t["status"], t.get("payload_tokens", 0), t.get("latency_s", 0.0))
                      for t in record["tools"])
        trace.append(TrajectorySpec(f"{prefix}{i}", f"p{record['prompt_id']}", record["prompt_tokens"],
                                    tuple(max(1, o) for o in record["outputs"]), tools))
    return trace


_RECORDED: dict[str, list[dict]] = {}


def _recorded(path: str) -> list[dict]:
    if path not in _RECORDED:
        from libra.trace_record import load

        records = list(load(path))
        if not records:
            raise InvalidArgument(f"trace {path} has no completed trajectories")
        _RECORDED[path] = records
    return _RECORDED[path]
