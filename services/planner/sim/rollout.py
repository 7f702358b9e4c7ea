"""The rollout loop of the simulator: trajectories' turns routed through a real `Policy` and run on
simulated instances, and `Window`, one window of trajectories played to its end.

Every model turn is routed by a `libra.routing` policy object (the classes the scheduler service
runs), called exactly as the rollout gateway calls it:

    start(spec) ─▶ route(Turn) ─▶ instance queue ─▶ batch ─decode─▶ done: turn_done(output)
                      ▲                                                  │
                      └─ tool latency (TOOL event) ◀─ tool_returned ◀────┤ another turn follows
                                                       finish(total) ◀───┘ the last turn

A turn's reply reaches the gateway the instance's `request_s` after its last token (the time a turn
spends outside the engine: HTTP, the routing call; 0 unless calibrated; with a calibrated
distribution, `request_s` times the turn's draw, taken as it is sent: `gaps.ReplySampler`), before
the tool runs or the trajectory finishes. Every turn, the first included, is routed a gap after the
trajectory's previous turn and tool call ended (or its start): the gateway's time between turns
(routing, reports, records), each turn's drawn from the calibrated distribution or the mean
(`gaps.py`; none unless calibrated). Draws are correlated within a moment as calibrated
(`gaps.Moments`): the reply factors of turns sent to one engine together, the gaps after turns that
came back from one engine together, the first gaps of trajectories released together. A turn
prefills its whole context where its KV cache is not (new trajectory, or moved), only the tool
payload where it stays. A turn that no serving instance can hold waits
("parked") until one that can comes up. The loop owns the instances in force and the routing
counters; it does not own the clock's other events (releases, training: `cluster.py`) nor the speed
of an instance (`instance.py`). Deterministic: events at the same time run in the order they were
scheduled.

A plan change replaces the policy while turns it routed still run on the instances the new plan
keeps. Those instances register with the new policy carrying the load the new policy would have
counted for those turns (context + turn budget each, as `Policy.route` counts), and each such turn
releases its share there when it ends: the new policy sees the kept instances' real load, neither
idle (it would pile new turns on them) nor loaded forever (it would starve them).
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Callable, Sequence

from libra.errors import FailedPrecondition, InvalidArgument
from libra.routing.policy import Policy, Turn, Worker
from libra.services.planner.gaps import GapSampler, ReplySampler
from libra.services.planner.sim.instance import Group, Instance, InstanceModel, SimulationError, Unit
from libra.services.planner.sim.result import RolloutResult
from libra.services.planner.sim.simple import SimpleModel
from libra.traces.spec import TrajectorySpec, check_spec

TOOL, DONE, UP, FINISH, PARKED = "tool", "done", "up", "finish", "parked"
NONE: frozenset[str] = frozenset()


class Events:
    """The simulated clock: a heap of (time, sequence, kind, item, version); ties go in push order."""

    def __init__(self) -> None:
        self.heap: list = []
        self.seq = 0
        self.now = 0.0

    def __bool__(self) -> bool:
        return bool(self.heap)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def push(self, when: float, kind: str, item, version: int = 0) -> None:
        self.seq = seq = self.seq + 1
        heapq.heappush(self.heap, (when, seq, kind, item, version))

    def pop(self) -> tuple[str, object, int]:
        self.now, _, kind, item, version = heapq.heappop(self.heap)
        return kind, item, version


class Rollout:
    """The instances in force, the policy that routes onto them, and every turn in flight."""

    def __init__(self, events: Events, policy: Policy | None, turn_budget_tokens: int,
                 on_finish: Callable[[Unit], None] | None = None, gaps: GapSampler | None = None,
                 replies: ReplySampler | None = None):
        self.events, self.policy, self.turn_budget_tokens = events, policy, turn_budget_tokens
        self.gaps, self.replies = gaps, replies
        self.on_finish = on_finish
        self.instances: dict[str, Instance] = {}
        self.running: dict[str, set[Unit]] = {}  # instance -> the units whose turn it runs or queues
        self.serving: list[Instance] = []
        self.floor: tuple[float, float, float] = (0, 0, 0)
        self.fit_classes: list[tuple[Instance, tuple[str, ...]]] = []  # (one instance, the wids alike)
        self.excluded: dict[tuple[int, ...], frozenset[str]] = {}  # failing classes -> their wids
        self.parked: list[Unit] = []
        self.flush_pending = False  # a PARKED event is queued
        self.routes, self.moves, self.tokens, self.reasons = 0, 0, 0, Counter()
        self.last_finish = 0.0  # not the last event: a stale completion may pop after it
        self.plan = ""  # how errors name the instances in force

    # -- instances -------------------------------------------------------------------------------
    def add(self, instance: Instance) -> None:
        """A new instance; it serves once `up` (an UP event, or a direct call at the start)."""
        self.instances[instance.wid] = instance

    def up(self, instance: Instance) -> None:
        if not instance.alive or instance.wid not in self.instances:
            return
        instance.up = True
        instance.last = self.events.now
        self.serving_changed()
        self.register(instance)
        if self.parked and not self.flush_pending:  # routed once every instance up at this instant is:
            self.flush_pending = True  # (a plan that replaced every engine starts them together, and
            self.events.push(self.events.now, PARKED, None)  # the first one up must not get them all)

    def route_parked(self) -> None:
        self.flush_pending = False
        parked, self.parked = self.parked, []
        for unit in parked:
            self.route(unit)

    def remove(self, instance: Instance) -> list[Unit]:
        """Take an instance down now; its turns (progress kept where the model can) come back."""
        instance.advance(self.events.now)
        moved = instance.evict()
        del self.instances[instance.wid]
        self.running.pop(instance.wid, None)
        return moved

    def register(self, instance: Instance) -> None:
        """Make the instance a worker of the policy in force, with the turns another policy routed
        there counted as this one would have (module docstring); a new instance has none."""
        carried = [u for u in self.running.get(instance.wid, ()) if u.policy is not self.policy]
        for unit in carried:
            unit.carried = int(unit.context) + self.turn_budget_tokens
        self.policy.register(Worker(instance.wid, instance.bucket, f"sim://{instance.wid}", instance.tp,
                                    outstanding_tokens=sum(u.carried for u in carried),
                                    outstanding_requests=len(carried)))

    def serving_changed(self) -> None:
        """Cache the instances that serve, the largest turn every one of them can hold, and the
        serving instances grouped by what `fits` reads (alike instances hold the same turns)."""
        self.serving = [i for i in self.instances.values() if i.up]
        self.floor = (min((i.seq_capacity for i in self.serving), default=0),
                      min((i.max_seqs for i in self.serving), default=0),
                      min((i.capacity for i in self.serving), default=0))
        classes: dict[tuple, list[Instance]] = {}
        for instance in self.serving:
            key = (type(instance), instance.seq_capacity, instance.max_seqs, instance.capacity)
            classes.setdefault(key, []).append(instance)
        self.fit_classes = [(alike[0], tuple(i.wid for i in alike)) for alike in classes.values()]
        self.excluded = {}

    def unfit(self, unit: Unit) -> frozenset[str]:
        """The serving instances that cannot hold the unit's turn (one `fits` per class of alike ones)."""
        failing = tuple(k for k, (probe, _) in enumerate(self.fit_classes) if not probe.fits(unit))
        found = self.excluded.get(failing)
        if found is None:
            found = self.excluded[failing] = frozenset(wid for k in failing for wid in self.fit_classes[k][1])
        return found

    def kick(self, instance: Instance) -> None:
        """Admit what fits and schedule the instance's next completion (older ones become void)."""
        instance.admit()
        instance.version += 1
        when = instance.next_completion()
        if when is not None:
            self.events.push(when, DONE, instance, instance.version)

    # -- turns -----------------------------------------------------------------------------------
    def handle(self, kind: str, item, version: int) -> None:
        if kind == DONE:
            if item.alive and version == item.version:
                self.done(item)
        elif kind == TOOL:
            self.route(item)
        elif kind == UP:
            self.up(item)
        elif kind == PARKED:
            self.route_parked()
        elif kind == FINISH:
            self.finish(item)
        else:
            raise AssertionError(f"unknown event {kind!r}")

    def start(self, spec: TrajectorySpec) -> Unit:
        """A trajectory starts now: route its first turn (a gap later)."""
        unit = self.new_unit(spec)
        if self.gaps is not None:
            now = self.events.now  # (the release's moment: trajectories released together draw together)
            self.events.push(now + self.gaps.draw(spec.trajectory_id, 0, "", now), TOOL, unit)
        else:
            self.route(unit)
        return unit

    def new_unit(self, spec: TrajectorySpec) -> Unit:
        """A trajectory released now, before its first turn (its whole prompt to prefill)."""
        return Unit(spec, spec.copies, float(spec.prompt_tokens), 0, float(spec.turns[0].output_tokens),
                    float(spec.prompt_tokens), released_s=self.events.now, seq=self.events.next_seq())

    def route(self, unit: Unit) -> None:
        policy, spec = self.policy, unit.spec
        if unit.policy is not None and unit.policy is not policy:
            Policy.finish(unit.policy, spec.trajectory_id, spec.prompt_id, 0)  # forget it there, learn nothing
            unit.policy = None
        if not self.serving:
            self.parked.append(unit)
            return
        seq_floor, seqs_floor, kv_floor = self.floor
        final, copies = unit.final, unit.copies
        exclude = NONE
        if final > seq_floor or copies > seqs_floor or copies * final > kv_floor:
            exclude = self.unfit(unit)  # some instance cannot hold this turn
        if len(exclude) == len(self.serving):
            if any(i.fits(unit) for i in self.instances.values()):
                self.parked.append(unit)  # an instance that can hold it is starting
                return
            raise SimulationError(f"trajectory {spec.trajectory_id!r} turn {unit.turn} needs {unit.final:.0f} KV "
                                  f"tokens per sequence x {unit.copies}; no engine of the plan "
                                  f"({self.plan}) can hold it")
        try:
            decision = policy.route(Turn(spec.trajectory_id, spec.prompt_id, unit.turn, int(unit.context),
                                         self.turn_budget_tokens, exclude))
        except FailedPrecondition as error:
            raise SimulationError(f"routing failed: {error}") from None
        self.routes += 1
        self.moves += decision.moved
        self.reasons[decision.reason] += 1
        unit.policy, unit.carried = policy, 0
        instance = self.instances[decision.worker_id]
        running = self.running.get(instance.wid)
        if running is None:
            running = self.running[instance.wid] = set()
        running.add(unit)
        if unit.kv_on != instance.wid:
            unit.prefill = unit.context  # no prefix cache there: the whole context again
        unit.kv_on = unit.worker = instance.wid
        if self.replies is not None:  # drawn as the turn is sent: the turns sent together are one moment
            unit.reply = self.replies.factor(spec.trajectory_id, unit.turn, instance.wid, self.events.now)
        instance.advance(self.events.now)
        instance.enqueue(unit)
        instance.routed += 1
        self.kick(instance)

    def reroute(self, units: list[Unit]) -> None:
        for unit in sorted(units, key=lambda u: u.seq):
            self.route(unit)

    def done(self, instance: Instance) -> None:
        now = self.events.now
        instance.advance(now)
        unit = instance.complete()
        running = self.running.get(instance.wid)
        if running is not None:
            running.discard(unit)
        if unit.carried:  # routed by an older policy: release what the policy in force counted for it
            worker = self.policy.state.workers.get(instance.wid)
            if worker is not None:
                worker.outstanding_tokens = max(0, worker.outstanding_tokens - unit.carried)
                worker.outstanding_requests = max(0, worker.outstanding_requests - 1)
            unit.carried = 0
        spec, k = unit.spec, unit.turn
        turn = spec.turns[k]
        back = instance.request_s * unit.reply
        unit.context = unit.final
        unit.turn_left = 0.0
        self.tokens += turn.output_tokens * unit.copies
        unit.policy.turn_done(spec.trajectory_id, instance.wid, turn.output_tokens)
        if k + 1 < len(spec.turns):
            unit.policy.tool_returned(spec.trajectory_id, turn.tool, turn.status, turn.payload_tokens)
            unit.context += turn.payload_tokens
            unit.turn, unit.turn_left = k + 1, float(spec.turns[k + 1].output_tokens)
            unit.prefill = float(turn.payload_tokens)
            gap = self.gaps.draw(spec.trajectory_id, k + 1, instance.wid, now) if self.gaps is not None else 0.0
            self.events.push(now + back + turn.latency_s + gap, TOOL, unit)
        elif back > 0:
            self.events.push(now + back, FINISH, unit)
        else:
            self.finish(unit)
        self.kick(instance)

    def finish(self, unit: Unit) -> None:
        """The trajectory's last turn is back at the gateway."""
        spec = unit.spec
        unit.policy.finish(spec.trajectory_id, spec.prompt_id, spec.output_tokens)
        self.last_finish = self.events.now
        if self.on_finish is not None:
            self.on_finish(unit)

    def busy(self, makespan_s: float) -> dict[str, float]:
        """Per bucket: the mean fraction of `makespan_s` its instances were busy."""
        fractions: dict[str, list[float]] = {}
        for instance in self.instances.values():
            fractions.setdefault(instance.bucket, []).append(instance.busy_s / makespan_s if makespan_s else 0.0)
        return {bucket: sum(v) / len(v) for bucket, v in fractions.items()}


class Window:
    """One window of trajectories, all released at t=0 on a fixed layout, played until the last one
    finishes: the scheduler evaluation's experiment. Instances are named `{bucket}-tp{tp}-{i}`."""

    def __init__(self, layout: Sequence[Group], trace: Sequence[TrajectorySpec], model: InstanceModel | None = None,
                 turn_budget_tokens: int = 4096):
        if not layout or not trace:
            raise InvalidArgument("the simulator needs at least one instance group and one trajectory")
        if sum(group.count for group in layout) < 1:
            raise InvalidArgument(f"the layout {list(layout)} has no instances: give a group a count >= 1")
        for spec in trace:
            check_spec(spec, f"trajectory {spec.trajectory_id!r}")
        self.layout, self.trace = list(layout), list(trace)
        self.model = model if model is not None else SimpleModel()
        self.turn_budget_tokens = turn_budget_tokens
        self.units: dict[str, Unit] = {}

    def remaining_of(self, trajectory_id: str) -> int:
        """True output tokens the trajectory still has to generate (the clairvoyant heuristic asks)."""
        unit = self.units[trajectory_id]
        return round(unit.turn_left) + sum(unit.spec.outputs[unit.turn + 1:])

    def run(self, policy: Policy) -> RolloutResult:
        events = Events()
        rollout = Rollout(events, policy, self.turn_budget_tokens)
        rollout.plan = " + ".join(f"{g.bucket} TP{g.tp}x{g.count}" for g in self.layout)
        for group in self.layout:
            for i in range(group.count):
                instance = self.model.instance(f"{group.bucket}-tp{group.tp}-{i}", group.bucket, group.tp, 1, 0.0)
                rollout.add(instance)
                rollout.up(instance)
        self.units = {}
        for spec in self.trace:  # registered before routing: the clairvoyant heuristic asks during route
            self.units[spec.trajectory_id] = unit = rollout.new_unit(spec)
            rollout.route(unit)
        while events:
            rollout.handle(*events.pop())
        makespan = rollout.last_finish
        return RolloutResult(makespan, sum(s.copies for s in self.trace), rollout.tokens, rollout.busy(makespan),
                             rollout.moves, rollout.routes, rollout.reasons)
