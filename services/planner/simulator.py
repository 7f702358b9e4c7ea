"""Cluster simulator (`libra sim`): the whole asynchronous GRPO loop as a discrete-event simulation.

It plays a multi-turn trace (`traces`) on a plan's rollout instances (`sim_instances`, at the
cost model's speeds and KV limits), routes every model turn through the scheduler's own `Policy`
objects (`make_policy`, exactly the classes the scheduler service runs), trains each batch for
`cost_train.step_time` of the plan's layout, syncs weights, and asks a plan controller
(`plan_control`) after every step whether to change the plan; a change costs its transition time.

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

Resolution. Engines are pooled (`sim_instances.pool`) above `max_workers`, and a trace entry may
stand for `copies` trajectories; both are exact at small scale (1) and reported in the result.
Deterministic: no wall clock in the simulated time; randomness lives in the trace. What a run
reports (`SimResult`, `PlanChangeRecord`) is in `sim_result`.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from typing import Callable, Literal

from pydantic import Field

from libra.configbase import Section
from libra.errors import FailedPrecondition, InvalidArgument
from libra.services.planner import cost_rollout, cost_train
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.cost_train import Layout
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.plan_control import Controller, StepRecord
from libra.services.planner.preflight import to_plan
from libra.services.planner.search import Candidate, SearchConfig
from libra.services.planner.sim_instances import SimInstance, Unit, pool
from libra.services.planner.sim_result import PlanChangeRecord, SimResult
from libra.services.planner.traces import Trace
from libra.services.scheduler.config import SchedulerConfig
from libra.services.scheduler.core import Policy, Turn, Worker, make_policy

RELEASE, TOOL, DONE, TRAIN, TRAIN_DONE, UP = range(6)


class SimulationError(InvalidArgument):
    """The run cannot go on as configured (a turn no engine can hold, a layout out of memory)."""


class SimConfig(Section):
    """What the simulated loop does besides the plan (the plan comes from the controller)."""

    staleness: int = Field(1, ge=0, le=64, description="batches rollout may run ahead of training "
                                                        "(0: synchronous)")
    policy: Literal["load_balance", "cmlfq", "length_aware", "la_mlfq"] = Field(
        "cmlfq", description="scheduler routing policy (the scheduler service's own classes)")
    per_worker_cap_tokens: int = Field(1_000_000_000, ge=1, description="the policy's per-worker cap "
                                                                         "(outstanding tokens)")
    turn_budget_tokens: int = Field(8192, ge=1, le=10_000_000, description="max_new_tokens sent with each turn")
    sync_gbps: float = Field(0.0, ge=0, le=100_000, description="weight-sync bandwidth per GPU, GB/s "
                                                                 "(0: the GPU's inter-node figure)")
    sync_latency_s: float = Field(0.5, ge=0, le=3600, description="fixed cost of one weight sync")
    max_workers: int = Field(256, ge=1, le=1_000_000, description="engines simulated one by one; above this "
                                                                  "they are pooled")


class Simulator:
    def __init__(self, model: ModelSpec, gpu: GpuSpec, trace: Trace, controller: Controller,
                 search_config: SearchConfig, config: SimConfig = SimConfig()):
        self.model, self.gpu, self.trace, self.controller = model, gpu, trace, controller
        self.search_config, self.config = search_config, config
        self.scheduler_config = SchedulerConfig(policy=config.policy,
                                                per_worker_cap_tokens=config.per_worker_cap_tokens)
        engines = {tp: self._engine(tp) for tp in search_config.tp_choices if gpu.gpus_per_node % tp == 0}
        self.engines = {tp: engine for tp, engine in engines.items() if engine is not None}
        if not self.engines:
            raise SimulationError(f"no rollout TP degree in {search_config.tp_choices} can hold {model.name} on "
                                  f"{gpu.name}: the model does not fit this cluster's GPUs")
        largest = max(e.kv_capacity_tokens for e in self.engines.values())
        for specs in trace.steps:
            for spec in specs:
                if spec.total_tokens > largest:
                    raise SimulationError(f"trajectory {spec.trajectory_id!r} reaches {spec.total_tokens} tokens; "
                                          f"the largest {model.name} engine on {gpu.name} holds {largest} KV tokens")

    def _engine(self, tp: int):
        try:
            return cost_rollout.instance(self.model, self.gpu, tp, self.search_config.rollout)
        except Infeasible:
            return None

    # -- the run ---------------------------------------------------------------------------------
    def run(self, progress: Callable[[StepRecord], None] | None = None) -> SimResult:
        started, cpu = time.perf_counter(), time.process_time()
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.instances: dict[str, SimInstance] = {}
        self.policy: Policy | None = None
        self.serving: list[SimInstance] = []
        self.floor = (0, 0, 0)
        self.parked: list[Unit] = []
        self.routes, self.reasons = 0, Counter()
        self.steps = len(self.trace.steps)
        self.left = [sum(1 for _ in specs) for specs in self.trace.steps]
        self.released_at: list[float | None] = [None] * self.steps
        self.finished_at = [0.0] * self.steps
        self.version, self.training, self.trainer_free, self.idle_since = 0, False, 0.0, 0.0
        self.records: list[StepRecord] = []
        self.changes: list[PlanChangeRecord] = []
        self.notes: list[str] = []
        self.next_id = 0
        self.peak_kv, self.pooled, self.tokens = 0.0, 1, 0
        self.candidate = self.controller.initial(self.trace)
        self.first_plan = self.candidate.describe()
        self._apply(self.candidate, 0.0, self.trace.pairs(0))
        for step in range(min(self.steps, self.config.staleness + 1)):
            self._push(0.0, RELEASE, step)
        handlers = {RELEASE: self._release, TOOL: self._route, DONE: self._done, TRAIN: self._try_train,
                    TRAIN_DONE: self._train_done, UP: self._up}
        while self.events and self.version < self.steps:
            self.now, _, kind, item, version = heapq.heappop(self.events)
            if kind == DONE:
                if item.alive and version == item.version:
                    self._done(item)
            else:
                handlers[kind](item)
                if progress and kind == TRAIN_DONE:
                    progress(self.records[-1])
        if self.version < self.steps:
            raise SimulationError(f"the simulation stalled at step {self.version}: nothing left to happen "
                                  f"({len(self.parked)} turns wait for an engine)")
        peak = max([self.peak_kv] + [i.peak_kv for i in self.instances.values()])
        copies = max(spec.copies for specs in self.trace.steps for spec in specs)
        trajectories = self.trace.batch * self.steps
        return SimResult(self.records, self.now, trajectories, self.tokens, self.changes, self.first_plan,
                         self.candidate.describe(), self.routes, self.reasons, peak, self.pooled, copies,
                         time.perf_counter() - started, time.process_time() - cpu, self.notes)

    def _push(self, when: float, kind: int, item, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, item, version))

    # -- rollout ---------------------------------------------------------------------------------
    def _release(self, step: int) -> None:
        self.released_at[step] = self.now
        for spec in self.trace.steps[step]:
            self.seq += 1
            unit = Unit(spec, spec.copies, float(spec.prompt_tokens), 0, float(spec.turns[0].output_tokens),
                        float(spec.prompt_tokens), released_s=self.now, seq=self.seq)
            self._route(unit)

    def _route(self, unit: Unit) -> None:
        policy, spec = self.policy, unit.spec
        if unit.policy is not None and unit.policy is not policy:
            Policy.finish(unit.policy, spec.trajectory_id, spec.prompt_id, 0)  # forget it there, learn nothing
            unit.policy = None
        if not self.serving:
            self.parked.append(unit)
            return
        seq_floor, seqs_floor, kv_floor = self.floor
        exclude: frozenset[str] = frozenset()
        if unit.final > seq_floor or unit.copies > seqs_floor or unit.copies * unit.final > kv_floor:
            # rare: some engine cannot hold this turn, check them one by one
            exclude = frozenset(i.wid for i in self.serving if not i.fits(unit))
        if len(exclude) == len(self.serving):
            if any(i.fits(unit) for i in self.instances.values()):
                self.parked.append(unit)  # an engine that can hold it is starting
                return
            raise SimulationError(f"trajectory {spec.trajectory_id!r} turn {unit.turn} needs {unit.final:.0f} KV "
                                  f"tokens per sequence x {unit.copies}; no engine of the plan "
                                  f"({self.candidate.describe()}) can hold it")
        try:
            decision = policy.route(Turn(spec.trajectory_id, spec.prompt_id, unit.turn, int(unit.context),
                                         self.config.turn_budget_tokens, exclude))
        except FailedPrecondition as error:
            raise SimulationError(f"routing failed: {error}") from None
        self.routes += 1
        self.reasons[decision.reason] += 1
        unit.policy = policy
        instance = self.instances[decision.worker_id]
        if unit.kv_on != instance.wid:
            unit.prefill = unit.context  # no prefix cache there: the whole context again
        unit.kv_on = unit.worker = instance.wid
        instance.advance(self.now)
        instance.waiting.append(unit)
        instance.routed += 1
        self._kick(instance)

    def _kick(self, instance: SimInstance) -> None:
        instance.admit()
        instance.version += 1
        when = instance.next_completion()
        if when is not None:
            self._push(when, DONE, instance, instance.version)

    def _done(self, instance: SimInstance) -> None:
        instance.advance(self.now)
        unit = instance.complete()
        spec, k = unit.spec, unit.turn
        turn = spec.turns[k]
        unit.context = unit.final
        unit.turn_left = 0.0
        self.tokens += turn.output_tokens * unit.copies
        unit.policy.turn_done(spec.trajectory_id, instance.wid, turn.output_tokens)
        if k + 1 < len(spec.turns):
            unit.policy.tool_returned(spec.trajectory_id, turn.tool, turn.status, turn.payload_tokens)
            unit.context += turn.payload_tokens
            unit.turn, unit.turn_left = k + 1, float(spec.turns[k + 1].output_tokens)
            unit.prefill = float(turn.payload_tokens)
            self._push(self.now + turn.latency_s, TOOL, unit)
        else:
            unit.policy.finish(spec.trajectory_id, spec.prompt_id, spec.output_tokens)
            self.left[spec.step] -= 1
            if not self.left[spec.step]:
                self.finished_at[spec.step] = self.now
                self._try_train()
        self._kick(instance)

    # -- training --------------------------------------------------------------------------------
    def _try_train(self, _item=None) -> None:
        step = self.version
        if self.training or step >= self.steps or self.left[step] or self.released_at[step] is None:
            return
        if self.trainer_free > self.now:
            self._push(self.trainer_free, TRAIN, None)
            return
        self.training = True
        self.wait_s = max(0.0, self.now - self.idle_since)
        self.train_s = self._train_seconds(step)
        self._push(self.now + self.train_s, TRAIN_DONE, step)

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
        self.training = False
        self.version = step + 1
        previous = self.records[-1].time_s if self.records else 0.0
        record = StepRecord(step, self.now, self.now - previous, self.finished_at[step] - self.released_at[step],
                            self.train_s, self.wait_s, self.trace.batch, self.trace.pairs(step),
                            float(sum(len(i.waiting) for i in self.instances.values())),
                            float(sum(self.left[s] for s in range(step + 1, self.steps)
                                      if self.released_at[s] is not None)))
        self.records.append(record)
        self._sync()
        change = self.controller.after_step(record) if self.version < self.steps else None
        if change is not None:
            ready = self.now + change.transition_s
            before = self.candidate.describe()
            layout_changed = change.candidate.layout != self.candidate.layout
            moved = self._apply(change.candidate, ready, record.lengths)
            self.changes.append(PlanChangeRecord(step, self.now, ready, change.transition_s, before,
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
        for instance in self.instances.values():
            if instance.up:
                instance.advance(self.now)
                instance.stall += self.model.weight_bytes / instance.tp / (gbps * 1e9) + self.config.sync_latency_s
                self._kick(instance)
        self.trainer_free = max(self.trainer_free, self.now + self.model.weight_bytes / self.candidate.layout.tp
                                / self.candidate.layout.pp / (gbps * 1e9) + self.config.sync_latency_s)

    # -- plans -----------------------------------------------------------------------------------
    def _apply(self, candidate: Candidate, ready: float, lengths) -> int:
        """Make `candidate` the plan: keep matching engines, take the others down, start new ones."""
        wanted = pool(candidate.rollout, self.config.max_workers)
        missing = [tp for tp, _ in wanted if tp not in self.engines]
        if missing:
            raise SimulationError(f"plan {candidate.describe()} uses rollout tp {missing}, which cannot hold "
                                  f"{self.model.name} on {self.gpu.name}")
        self.pooled = max([self.pooled] + [n for _, n in wanted])
        spare: dict[tuple[int, int], list[SimInstance]] = {}
        for instance in self.instances.values():
            spare.setdefault((instance.tp, instance.replicas), []).append(instance)
        keep, add = [], []
        for key in wanted:
            (keep if spare.get(key) else add).append(spare[key].pop() if spare.get(key) else key)
        moved = []
        for group in spare.values():
            for instance in group:
                instance.advance(self.now)
                self.peak_kv = max(self.peak_kv, instance.peak_kv)
                moved.extend(instance.evict())
                del self.instances[instance.wid]
        for tp, replicas in add:
            self.next_id += 1
            instance = SimInstance(f"tp{tp}-{self.next_id}", tp, replicas, self.engines[tp], up_at=ready)
            self.instances[instance.wid] = instance
            self._push(ready, UP, instance)
        self.candidate = candidate
        self._serving_changed()
        self._new_policy(candidate, lengths)
        for instance in keep:
            if instance.up:
                self._register(instance)
        for unit in sorted(moved, key=lambda u: u.seq):
            self._route(unit)
        return len(moved)

    def _new_policy(self, candidate: Candidate, lengths) -> None:
        plan = to_plan(candidate, lengths, 0.0)
        buckets, last = [], 0
        for bucket in plan.buckets:  # the quantile rule can repeat a limit; the scheduler wants them distinct
            last = max(int(bucket.max_tokens), last + 1)
            buckets.append((bucket.name, last))
        old, self.policy = self.policy, make_policy(self.scheduler_config, buckets)
        for name in ("forest", "history"):  # what the policy learned survives the plan change
            if old is not None and hasattr(old, name):
                setattr(self.policy, name, getattr(old, name))

    def _serving_changed(self) -> None:
        """Cache the engines that serve and the largest turn every one of them can hold."""
        self.serving = [i for i in self.instances.values() if i.up]
        self.floor = (min((i.seq_capacity for i in self.serving), default=0),
                      min((i.max_seqs for i in self.serving), default=0),
                      min((i.capacity for i in self.serving), default=0))

    def _register(self, instance: SimInstance) -> None:
        self.policy.register(Worker(instance.wid, f"tp{instance.tp}", f"sim://{instance.wid}", instance.tp,
                                    outstanding_tokens=instance.load_tokens(),
                                    outstanding_requests=len(instance.heap) + len(instance.waiting)))

    def _up(self, instance: SimInstance) -> None:
        if not instance.alive or instance.wid not in self.instances:
            return
        instance.up = True
        instance.last = self.now
        self._serving_changed()
        self._register(instance)
        parked, self.parked = self.parked, []
        for unit in parked:
            self._route(unit)
