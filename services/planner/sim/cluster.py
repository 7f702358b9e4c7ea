"""The cluster simulator (`libra sim`): the whole asynchronous GRPO loop as a discrete-event simulation.

It plays a multi-turn trace (`libra.traces`) on a plan's rollout instances (`instance.py`: at the
cost model's speeds and KV limits by default), routes every model turn through the scheduler's own
policy classes (`rollout.py`, `libra.routing.registry.make_policy`), trains each batch for
`cost_train.step_time` of the plan's layout, syncs weights, and asks a plan controller
(`control.py`) after every step whether to change the plan; a change costs its transition time.

    release batch s ──▶ route(turn) ──▶ engine batch ──decode──▶ turn ends ─┬─ tool latency ─▶ route
     (version >= s - staleness)                                             └─ last turn: finished
    batch s finished & trainer free ──▶ train step s ──▶ weight sync (engines stall) ──▶ version s+1
        └──▶ controller.after_step ──▶ PlanChange? ──▶ engines drained/added, trainer reshards
                                                      (both ready after the transition cost)

Rules. Batch s is released when version >= s - `staleness` (0: synchronous, each batch generated
by the latest weights). Step s trains on the whole batch s, in order. A weight sync stalls every
engine for weight bytes / bandwidth. On a plan change, engines of the old plan that the new one
does not keep are taken down at once (their turns keep the tokens generated and move, re-prefilling
their context elsewhere); new engines and a changed training layout are ready after the transition
cost. The routing policy is rebuilt with the new plan's buckets, keeping what it learned (C-MLFQ's
prefix forest, LA-MLFQ's history); a trajectory in flight starts afresh in it.

Resolution. Engines are pooled (`engines.pool`) above `max_workers`, and a trace entry may
stand for `copies` trajectories; both are exact at small scale (1) and reported in the result.
Deterministic: no wall clock in the simulated time; randomness lives in the trace.
"""

from __future__ import annotations

import time
from typing import Callable

from pydantic import Field

from libra.configbase import Section
from libra.routing.config import PolicyName, RoutingConfig
from libra.routing.registry import make_policy
from libra.services.planner import cost_train
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.cost_train import Layout
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.preflight import to_plan
from libra.services.planner.search import Candidate, SearchConfig
from libra.services.planner.sim.control import Controller
from libra.services.planner.sim.engines import CostModelEngines, pool
from libra.services.planner.sim.instance import Instance, InstanceModel, SimulationError, Unit
from libra.services.planner.sim.result import PlanChangeRecord, SimResult, StepRecord
from libra.services.planner.sim.rollout import UP, Events, Rollout
from libra.traces.spec import Trace

RELEASE, TRAIN, TRAIN_DONE = "release", "train", "train_done"


class SimConfig(Section):
    """What the simulated loop does besides the plan (the plan comes from the controller)."""

    staleness: int = Field(1, ge=0, le=64, description="batches rollout may run ahead of training "
                                                        "(0: synchronous)")
    policy: PolicyName = Field("cmlfq", description="routing policy (libra.routing: the scheduler service's classes)")
    per_worker_cap_tokens: int = Field(1_000_000_000, ge=1, description="the policy's per-worker cap "
                                                                         "(outstanding tokens)")
    turn_budget_tokens: int = Field(8192, ge=1, le=10_000_000, description="max_new_tokens sent with each turn")
    sync_gbps: float = Field(0.0, ge=0, le=100_000, description="weight-sync bandwidth per GPU, GB/s "
                                                                 "(0: the GPU's inter-node figure)")
    sync_latency_s: float = Field(0.5, ge=0, le=3600, description="fixed cost of one weight sync")
    max_workers: int = Field(256, ge=1, le=1_000_000, description="engines simulated one by one; above this "
                                                                  "they are pooled")


class Simulator:
    """One run of the loop: a trace, a plan controller and an instance model (the cost model's
    engines unless another is given)."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, trace: Trace, controller: Controller,
                 search_config: SearchConfig, config: SimConfig = SimConfig(),
                 instance_model: InstanceModel | None = None):
        self.model, self.gpu, self.trace, self.controller = model, gpu, trace, controller
        self.search_config, self.config = search_config, config
        self.routing = RoutingConfig(policy=config.policy, per_worker_cap_tokens=config.per_worker_cap_tokens)
        self.instance_model = instance_model if instance_model is not None else CostModelEngines(
            model, gpu, search_config.tp_choices, search_config.rollout)
        largest = self.instance_model.max_context_tokens()
        for specs in trace.steps:
            for spec in specs:
                if spec.total_tokens > largest:
                    raise SimulationError(f"trajectory {spec.trajectory_id!r} reaches {spec.total_tokens} tokens; "
                                          f"the largest {model.name} engine on {gpu.name} holds {largest} KV tokens")

    # -- the run ---------------------------------------------------------------------------------
    def run(self, progress: Callable[[StepRecord], None] | None = None) -> SimResult:
        started, cpu = time.perf_counter(), time.process_time()
        self.events = Events()
        self.rollout = Rollout(self.events, None, self.config.turn_budget_tokens, on_finish=self._finished)
        self.steps = len(self.trace.steps)
        self.left = [sum(1 for _ in specs) for specs in self.trace.steps]
        self.released_at: list[float | None] = [None] * self.steps
        self.finished_at = [0.0] * self.steps
        self.version, self.training, self.trainer_free, self.idle_since = 0, False, 0.0, 0.0
        self.records: list[StepRecord] = []
        self.changes: list[PlanChangeRecord] = []
        self.notes: list[str] = []
        self.next_id = 0
        self.peak_kv, self.pooled = 0.0, 1
        self.candidate = self.controller.initial(self.trace)
        self.first_plan = self.candidate.describe()
        self._apply(self.candidate, 0.0, self.trace.pairs(0))
        for step in range(min(self.steps, self.config.staleness + 1)):
            self.events.push(0.0, RELEASE, step)
        handlers = {RELEASE: self._release, TRAIN: self._try_train, TRAIN_DONE: self._train_done}
        while self.events and self.version < self.steps:
            kind, item, version = self.events.pop()
            handler = handlers.get(kind)
            if handler is None:
                self.rollout.handle(kind, item, version)
                continue
            handler(item)
            if progress and kind == TRAIN_DONE:
                progress(self.records[-1])
        if self.version < self.steps:
            raise SimulationError(f"the simulation stalled at step {self.version}: nothing left to happen "
                                  f"({len(self.rollout.parked)} turns wait for an engine)")
        peak = max([self.peak_kv] + [i.peak_kv for i in self.rollout.instances.values()])
        copies = max(spec.copies for specs in self.trace.steps for spec in specs)
        trajectories = self.trace.batch * self.steps
        return SimResult(self.records, self.events.now, trajectories, self.rollout.tokens, self.changes,
                         self.first_plan, self.candidate.describe(), self.rollout.routes, self.rollout.reasons,
                         peak, self.pooled, copies, time.perf_counter() - started, time.process_time() - cpu,
                         self.notes)

    # -- rollout ---------------------------------------------------------------------------------
    def _release(self, step: int) -> None:
        self.released_at[step] = self.events.now
        for spec in self.trace.steps[step]:
            self.rollout.start(spec)

    def _finished(self, unit: Unit) -> None:
        step = unit.spec.step
        self.left[step] -= 1
        if not self.left[step]:
            self.finished_at[step] = self.events.now
            self._try_train()

    # -- training --------------------------------------------------------------------------------
    def _try_train(self, _item=None) -> None:
        step, now = self.version, self.events.now
        if self.training or step >= self.steps or self.left[step] or self.released_at[step] is None:
            return
        if self.trainer_free > now:
            self.events.push(self.trainer_free, TRAIN, None)
            return
        self.training = True
        self.wait_s = max(0.0, now - self.idle_since)
        self.train_s = self._train_seconds(step)
        self.events.push(now + self.train_s, TRAIN_DONE, step)

    def _train_seconds(self, step: int) -> float:
        """The layout's step time. When the lengths have grown past its memory, what a trainer does
        without new GPUs: a smaller micro-batch, then full activation recompute (activations of
        the layer inputs only, one more forward pass: 4/3 of the compute); an error when none fits."""
        layout, batch = self.candidate.layout, self.trace.batch
        seq_len = max(1, round(self.trace.mean_tokens(step)))
        base = self.search_config.train
        full_recompute = base.model_copy(update={"activation_bytes_per_token_layer": 2.0, "mfu": base.mfu * 0.75})
        error = None
        for eff, how in ((base, ""), (full_recompute, "full activation recompute")):
            for mb in [m for m in range(layout.micro_batch, 0, -1) if (batch // layout.dp) % m == 0]:
                try:
                    seconds = cost_train.step_time(self.model, self.gpu, Layout(layout.tp, layout.pp, layout.dp, mb),
                                                   batch, seq_len, eff).seconds
                except Infeasible as failure:
                    error = error or failure
                    continue
                if mb != layout.micro_batch or how:
                    self.notes.append(f"step {step}: micro_batch {mb}{', ' + how if how else ''} to fit "
                                      f"{seq_len}-token sequences")
                return seconds
        raise SimulationError(f"step {step}: the training layout cannot run a batch of {batch} sequences of "
                              f"{seq_len} tokens on {self.gpu.name}: {error}")

    def _train_done(self, step: int) -> None:
        now, instances = self.events.now, self.rollout.instances.values()
        self.training = False
        self.version = step + 1
        previous = self.records[-1].time_s if self.records else 0.0
        record = StepRecord(step, now, now - previous, self.finished_at[step] - self.released_at[step],
                            self.train_s, self.wait_s, self.trace.batch, self.trace.pairs(step),
                            float(sum(len(i.waiting) for i in instances)),
                            float(sum(self.left[s] for s in range(step + 1, self.steps)
                                      if self.released_at[s] is not None)))
        self.records.append(record)
        self._sync()
        change = self.controller.after_step(record) if self.version < self.steps else None
        if change is not None:
            ready = now + change.transition_s
            before = self.candidate.describe()
            layout_changed = change.candidate.layout != self.candidate.layout
            moved = self._apply(change.candidate, ready, record.lengths)
            self.changes.append(PlanChangeRecord(step, now, ready, change.transition_s, before,
                                                 change.candidate.describe(), change.reason, moved))
            if layout_changed:
                self.trainer_free = max(self.trainer_free, ready)
        self.idle_since = self.trainer_free
        upcoming = self.version + self.config.staleness
        if upcoming < self.steps and self.released_at[upcoming] is None:
            self._release(upcoming)
        self._try_train()

    def _sync(self) -> None:
        """New weights to every engine: each stalls for its shard's bytes over the sync bandwidth."""
        gbps = self.config.sync_gbps or self.gpu.internode_gbps
        now = self.events.now
        for instance in self.rollout.instances.values():
            if instance.up:
                instance.advance(now)
                instance.stall += self.model.weight_bytes / instance.tp / (gbps * 1e9) + self.config.sync_latency_s
                self.rollout.kick(instance)
        self.trainer_free = max(self.trainer_free, now + self.model.weight_bytes / self.candidate.layout.tp
                                / self.candidate.layout.pp / (gbps * 1e9) + self.config.sync_latency_s)

    # -- plans -----------------------------------------------------------------------------------
    def _apply(self, candidate: Candidate, ready: float, lengths) -> int:
        """Make `candidate` the plan: keep matching engines, take the others down, start new ones."""
        wanted = pool(candidate.rollout, self.config.max_workers)
        missing = [tp for tp, _ in wanted if not self.instance_model.holds(tp)]
        if missing:
            raise SimulationError(f"plan {candidate.describe()} uses rollout tp {missing}, which cannot hold "
                                  f"{self.model.name} on {self.gpu.name}")
        self.pooled = max([self.pooled] + [n for _, n in wanted])
        spare: dict[tuple[int, int], list[Instance]] = {}
        for instance in self.rollout.instances.values():
            spare.setdefault((instance.tp, instance.replicas), []).append(instance)
        keep, add = [], []
        for key in wanted:
            (keep if spare.get(key) else add).append(spare[key].pop() if spare.get(key) else key)
        moved = []
        for group in spare.values():
            for instance in group:
                moved.extend(self.rollout.remove(instance))
                self.peak_kv = max(self.peak_kv, instance.peak_kv)
        for tp, replicas in add:
            self.next_id += 1
            instance = self.instance_model.instance(f"tp{tp}-{self.next_id}", f"tp{tp}", tp, replicas, ready)
            self.rollout.add(instance)
            self.events.push(ready, UP, instance)
        self.candidate = candidate
        self.rollout.plan = candidate.describe()
        self.rollout.serving_changed()
        self._new_policy(candidate, lengths)
        for instance in keep:
            if instance.up:
                self.rollout.register(instance)
        self.rollout.reroute(moved)
        return len(moved)

    def _new_policy(self, candidate: Candidate, lengths) -> None:
        plan = to_plan(candidate, lengths, 0.0)
        buckets, last = [], 0
        for bucket in plan.buckets:  # the quantile rule can repeat a limit; the scheduler wants them distinct
            last = max(int(bucket.max_tokens), last + 1)
            buckets.append((bucket.name, last))
        old, self.rollout.policy = self.rollout.policy, make_policy(self.routing, buckets)
        for name in ("forest", "history"):  # what the policy learned survives the plan change
            if old is not None and hasattr(old, name):
                setattr(self.rollout.policy, name, getattr(old, name))
