"""The cluster simulator (`libra sim`): the whole GRPO loop as a discrete-event simulation, either
asynchronous and disaggregated (rollout and training on their own GPUs) or synchronous colocated.

It plays a multi-turn trace (`libra.traces`) on a plan's rollout instances (`instance.py`: at the
cost model's speeds and KV limits by default), routes every model turn through the scheduler's own
policy classes (`rollout.py`, `libra.routing.registry.make_policy`), trains each batch for
`cost_train.step_time` of the layout in force (`trainer.py`), syncs weights, and asks a plan
controller (`control.py`) after every step whether to change the plan; a change costs its
transition time.

    release batch s ──▶ route(turn) ──▶ engine batch ──decode──▶ turn ends ─┬─ tool latency ─▶ route
     (version >= s - staleness)                                             └─ last turn: finished
    batch s finished & trainer free ──▶ train step s ──▶ weight sync (engines stall) ──▶ version s+1
        └──▶ controller.after_step ──▶ PlanChange? ──▶ engines drained/added, trainer reshards or
                                                      hybrids join/leave (trainer.py)

Rules. Batch s is released when version >= s - `staleness` (0: synchronous, each batch generated
by the latest weights). Step s trains on the whole batch s, in order. A weight sync stalls every
engine for weight bytes / bandwidth. On a plan change, engines of the old plan that the new one
does not keep are taken down at once (their turns keep the tokens generated and move, re-prefilling
their context elsewhere); new engines and a changed training layout are ready after the transition
cost (with the elastic pool, `core_replicas` >= 1, a change of dp alone does not stop the trainer:
trainer.py). The routing policy is rebuilt with the new plan's buckets, keeping what it learned
(C-MLFQ's prefix forest, LA-MLFQ's history); a trajectory in flight starts afresh in it.

Colocated (`colocated`, verl's design; staleness 0): the plan's engines and training layout are
the same GPUs (`colocated.Colocated` plans them). The batch is rolled out to its longest trajectory;
then the trainer moves its state in from the host, trains and moves it out (`host_gbps`), and the
new weights are copied in place into the engines (over NVLink); only then is the next batch
released. Rollout and training never overlap.

Resolution. Engines are pooled (`engines.pool`) above `max_workers`, and a trace entry may
stand for `copies` trajectories; both are exact at small scale (1) and reported in the result.
What the GPUs did per pool and the staleness of every trained trajectory go to `usage` (usage.py).
Deterministic: no wall clock in the simulated time; randomness lives in the trace.
"""

from __future__ import annotations

import gc
import time
from heapq import heappop
from typing import Callable

from pydantic import Field, model_validator

from libra.configbase import Section
from libra.routing.config import RoutingConfig
from libra.routing.names import PolicyName
from libra.routing.registry import make_policy
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.preflight import to_plan
from libra.services.planner.search import Candidate, SearchConfig
from libra.services.planner.sim.batching import Batch, Batching, feeder
from libra.services.planner.sim.control import Controller
from libra.services.planner.sim.engines import CostModelEngines, pool
from libra.services.planner.sim.instance import Instance, InstanceModel, SimulationError, Unit
from libra.services.planner.sim.result import PlanChangeRecord, SimResult, StepRecord
from libra.services.planner.sim.rollout import UP, Events, Rollout
from libra.services.planner.sim.trainer import TrainerSide
from libra.services.planner.sim.usage import Usage
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
    colocated: bool = Field(False, description="every GPU rolls out, then every GPU trains, weights reloaded in "
                                               "place (verl's design; needs staleness 0 and a colocated plan)")
    host_gbps: float = Field(25.0, gt=0, le=10_000, description="colocated: GB/s per GPU between device and host "
                                                                "when the trainer's state moves out and back "
                                                                "(25: PCIe Gen4 x16)")
    core_replicas: int = Field(0, ge=0, le=65_536, description="elastic hybrid pool: the core trainer's "
                                                               "data-parallel replicas; a change of dp alone "
                                                               "(both >= this) joins or releases hybrids "
                                                               "without stopping the trainer (0: no pool)")
    batching: Batching = Field("in_order", description="which trajectories a step trains (batching.py): "
                                                        "in_order: batch s, whole; first_complete: the first "
                                                        "complete fresh groups, as the trainer does")
    steps: int = Field(0, ge=0, le=1_000_000, description="training steps to simulate (0: one per batch of the "
                                                          "trace; first_complete needs spare batches to replace "
                                                          "the groups it rejects)")

    @model_validator(mode="after")
    def _colocated_is_synchronous(self) -> "SimConfig":
        if self.colocated and self.staleness:
            raise ValueError(f"colocated runs are synchronous: set staleness 0 (got {self.staleness}); rollout "
                             "and training take turns on the same GPUs")
        return self


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
        self.collects = gc.isenabled()  # (a replay inside a run finds it paused: the run collects)
        if self.collects:  # the loop makes millions of short-lived objects (events, turns), none in a
            gc.disable()  # cycle: reference counting frees them; the collector runs once a step instead
        try:  # (for the cycles a controller leaves: searches, replays), not every 700 allocations
            return self._run(progress)
        finally:
            if self.collects:
                gc.enable()

    def _run(self, progress: Callable[[StepRecord], None] | None) -> SimResult:
        started, cpu = time.perf_counter(), time.process_time()
        self.events = Events()
        self.rollout = Rollout(self.events, None, self.config.turn_budget_tokens, on_finish=self._finished,
                               gap_s=self.search_config.rollout.turn_gap_s)
        self.usage = Usage(self.config.colocated)
        self.feeder = feeder(self.config.batching, self.trace, self.config.staleness)
        if hasattr(self.instance_model, "on_start"):  # the version of each trajectory's first token
            self.instance_model.on_start = lambda unit: self.feeder.started(unit.spec.trajectory_id, self.version)
        self.steps = self.config.steps or len(self.trace.steps)
        if self.steps > len(self.trace.steps):
            raise SimulationError(f"{self.steps} steps to train from a trace of {len(self.trace.steps)} batches; "
                                  f"give a trace of at least as many batches")
        self.in_flight = 0  # trajectories released and not finished
        self.trained_tokens = 0  # output tokens of the trajectories trained (not of rejected or unfinished ones)
        self.batch: Batch | None = None  # the next step's batch, complete, waiting for the trainer
        self.version, self.training, self.trainer_free, self.idle_since = 0, False, 0.0, 0.0
        self.records: list[StepRecord] = []
        self.changes: list[PlanChangeRecord] = []
        self.notes: list[str] = []
        self.next_id = 0
        self.peak_kv, self.pooled = 0.0, 1
        self.candidate = self.controller.initial(self.trace)
        self._check_plan(self.candidate)
        self.first_plan = self.candidate.describe()
        self.trainer = TrainerSide(self.model, self.gpu, self.trace.batch, self.candidate.layout,
                                   self.config.core_replicas)
        self._apply(self.candidate, 0.0, self.trace.pairs(0))
        self.events.push(0.0, RELEASE, None)
        handlers = {RELEASE: self._release, TRAIN: self._try_train, TRAIN_DONE: self._train_done}
        heap, events, handle = self.events.heap, self.events, self.rollout.handle
        while heap and self.version < self.steps:
            events.now, _, kind, item, version = heappop(heap)  # Events.pop, inlined (millions of events)
            handler = handlers.get(kind)
            if handler is None:  # the rollout loop's
                handle(kind, item, version)
                continue
            handler(item)
            if progress and kind == TRAIN_DONE:
                progress(self.records[-1])
        if self.version < self.steps:
            raise SimulationError(f"the simulation stalled at step {self.version}: nothing left to happen "
                                  f"({len(self.rollout.parked)} turns wait for an engine)")
        for instance in self.rollout.instances.values():
            instance.advance(self.events.now)
            self.usage.engine(instance.busy_s, instance.tp * instance.replicas)
        self.usage.close(self.events.now)
        self.usage.rejected = self.feeder.rejected
        peak = max([self.peak_kv] + [i.peak_kv for i in self.rollout.instances.values()])
        copies = max(spec.copies for specs in self.trace.steps for spec in specs)
        trajectories = self.trace.batch * self.steps  # trained (rejected ones are not counted)
        return SimResult(self.records, self.events.now, trajectories, self.trained_tokens, self.changes,
                         self.first_plan, self.candidate.describe(), self.rollout.routes, self.rollout.reasons,
                         peak, self.pooled, copies, time.perf_counter() - started, time.process_time() - cpu,
                         self.notes)

    @property
    def left(self) -> list[int]:
        """Trajectories not finished, per group of the batch rule (in order: per batch of the trace)."""
        return self.feeder.groups.left

    def _check_plan(self, candidate: Candidate) -> None:
        gpus, colocated = self.search_config.total_gpus, self.config.colocated
        used = max(candidate.layout.gpus, candidate.rollout_gpus) if colocated else \
            candidate.layout.gpus + candidate.rollout_gpus
        if used > gpus:
            raise SimulationError(f"plan {candidate.describe()} uses {used} GPUs "
                                  f"{'on either side' if colocated else 'in all'}; the cluster has {gpus}")

    # -- rollout ---------------------------------------------------------------------------------
    def _release(self, _item=None) -> None:
        """Start what the batch rule lets out at this version (batching.py)."""
        for spec in self.feeder.due(self.version, self.events.now):
            self.in_flight += 1
            self.rollout.start(spec)

    def _finished(self, unit: Unit) -> None:
        self.in_flight -= 1
        if self.feeder.finished(unit.spec.trajectory_id, self.events.now):
            self._try_train()

    # -- training --------------------------------------------------------------------------------
    def _try_train(self, _item=None) -> None:
        step, now = self.version, self.events.now
        if self.training or step >= self.steps:
            return
        self.batch = self.batch or self.feeder.take(step)
        if self.batch is None:
            return
        if self.trainer_free > now:
            self.events.push(self.trainer_free, TRAIN, None)
            return
        self.training, self.trained, self.batch = True, self.batch, None
        for lag, copies in self.trained.lags:
            self.usage.staleness[lag] += copies
        self.trained_tokens += sum(spec.output_tokens * spec.copies for spec in self.trained.specs)
        self.wait_s = max(0.0, now - self.idle_since)
        layout = self.trainer.in_force(now)
        seq_len = max(1, round(self.trained.mean_tokens))
        self.train_s = self.trainer.step_seconds(layout, seq_len, self.search_config.train, self.notes, step)
        if self.config.colocated:  # the state comes in from the host before the step and goes out after it
            self.train_s += 2 * self.trainer.offload_seconds(layout, self.config.host_gbps)
        self.usage.trained(self.train_s, layout.gpus)
        self.events.push(now + self.train_s, TRAIN_DONE, step)

    def _train_done(self, step: int) -> None:
        now, instances = self.events.now, self.rollout.instances.values()
        self.training = False
        self.version = step + 1
        previous = self.records[-1].time_s if self.records else 0.0
        batch = self.trained
        record = StepRecord(step, now, now - previous, batch.finished_s - batch.released_s, self.train_s,
                            self.wait_s, self.trace.batch, batch.lengths,
                            float(sum(len(i.waiting) for i in instances)), float(self.in_flight))
        self.records.append(record)
        self._sync()
        change = self.controller.after_step(record) if self.version < self.steps else None
        if change is not None:
            ready = now + change.transition_s
            before = self.candidate.describe()
            self._check_plan(change.candidate)
            moved = self._apply(change.candidate, ready, record.lengths)
            self.changes.append(PlanChangeRecord(step, now, ready, change.transition_s, before,
                                                 change.candidate.describe(), change.reason, moved))
            self.trainer_free = max(self.trainer_free, self.trainer.change(change.candidate.layout, now, ready))
        self.idle_since = self.trainer_free
        if self.collects:
            gc.collect(1)  # what the step left (the young generations: the old one holds the trace)
        self._release()
        self._try_train()

    def _sync(self) -> None:
        """New weights to every engine: each stalls for its shard's bytes over the sync bandwidth
        (colocated: copied in place over NVLink; the trainer waits for the copy)."""
        gbps = self.config.sync_gbps or self.gpu.internode_gbps
        now, latency = self.events.now, self.config.sync_latency_s
        reload = self.trainer.reload_seconds if self.config.colocated else None
        for instance in self.rollout.instances.values():
            if instance.up:
                instance.advance(now)
                instance.stall += (reload(instance.tp, latency) if reload else
                                   self.model.weight_bytes / instance.tp / (gbps * 1e9) + latency)
                self.rollout.kick(instance)
        layout = self.trainer.layout
        send = (max(reload(tp, latency) for tp, _ in self.candidate.rollout) if reload else
                self.model.weight_bytes / layout.tp / layout.pp / (gbps * 1e9) + latency)
        self.trainer_free = max(self.trainer_free, now + send)

    # -- plans -----------------------------------------------------------------------------------
    def _apply(self, candidate: Candidate, ready: float, lengths) -> int:
        """Make `candidate` the plan: keep matching engines, take the others down, start new ones."""
        wanted = pool(candidate.rollout, self.config.max_workers)
        missing = [tp for tp, _ in wanted if not self.instance_model.holds(tp)]
        if missing:
            raise SimulationError(f"plan {candidate.describe()} uses rollout tp {missing}, which cannot hold "
                                  f"{self.model.name} on {self.gpu.name}")
        self.pooled = max([self.pooled] + [n for _, n in wanted])
        self.usage.plan(self.events.now, candidate.layout.gpus, candidate.rollout_gpus)
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
                self.usage.engine(instance.busy_s, instance.tp * instance.replicas)
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
