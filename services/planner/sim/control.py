"""Plan controllers of the cluster simulator: who chooses the allocation, and when it changes.

The simulator calls `initial(trace)` once and `after_step(record)` after every training step; a
controller answers with a `PlanChange` (the new candidate and its transition cost) or None.

    static    the planner's plan for the first step's batch, kept for the whole run: the
              search's shortlist ranked by simulating that batch (`rank.first_plan`, as the
              replanner ranks later ones; with `rank: closed_form`, the search's best)
    tp2       the search restricted to TP 2 on both sides (a homogeneous layout), its best; pair
              it with load-balance routing for the usual baseline
    online    the Global Resource Planner's `Replanner` (services/planner/replan.py), fed every
              finished step's measured times (rollout seconds = the batch's rollout span, as the
              trainer reports it), lengths and trajectories; it ranks the search's shortlist by
              replaying the recent steps through this simulator (`rank.SimRanker`, at the
              calibrated speeds) and applies a plan only when the simulated gain over its horizon
              beats the simulated cost of the move
    scripted  a given first plan and fixed changes at given steps (tests; with no changes, one
              plan held for the whole run: `run.run_plan`)

Controllers see only what the real planner would see: finished steps' facts, never the future.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from libra.services.planner.config import ReplanSettings
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.replan import Replanner, StepObservation
from libra.services.planner.search import Candidate, SearchConfig, search
from libra.services.planner.sim.result import StepRecord
from libra.traces.spec import Trace

if TYPE_CHECKING:
    from libra.services.planner.sim.cluster import SimConfig


@dataclass(frozen=True)
class PlanChange:
    candidate: Candidate
    transition_s: float
    reason: str


class Controller(Protocol):
    name: str

    def initial(self, trace: Trace) -> Candidate: ...

    def after_step(self, record: StepRecord) -> PlanChange | None: ...


class SearchOnce:
    """The planner's plan for the first step's batch, never changed: ranked by simulation when given
    the replanner's settings (rank: simulate) and the replay's `SimConfig`, else the search's best."""

    def __init__(self, name: str, model: ModelSpec, gpu: GpuSpec, config: SearchConfig,
                 settings: ReplanSettings | None = None, sim: "SimConfig | None" = None,
                 notes: Callable[[str], None] | None = None):
        self.name, self.model, self.gpu, self.config = name, model, gpu, config
        self.settings, self.sim = settings, sim
        self.notes = notes  # told, a line at a time, how the first plan's choice goes and (online) each decision
        self.reason = ""
        self.first = None  # rank.FirstPlan, when simulated

    def __getstate__(self) -> dict:
        """What a checkpoint keeps (sim/checkpoint.py): all but `notes`, a caller's callback (often
        a lambda, which pickle refuses); `Simulator.run_or_resume` gives a resumed run's controller
        its caller's `notes` again."""
        return {**self.__dict__, "notes": None}

    def initial(self, trace: Trace) -> Candidate:
        if self.settings is not None and self.settings.rank == "simulate" and self.sim is not None:
            from libra.services.planner.sim.rank import first_plan  # (rank imports the simulator, which imports us)

            self.first = first_plan(self.model, self.gpu, self.config, self.sim, trace.steps[0], self.settings,
                                    notes=self.notes)
            self.reason = f"step 0's batch: {self.first.reason}"
            return self.first.chosen
        result = search(self.model, self.gpu, trace.pairs(0), self.config)
        self.reason = f"searched on step 0's batch: {result.best.describe()}"
        return result.best

    def after_step(self, record: StepRecord) -> PlanChange | None:
        return None

    @property
    def worker_cpu_s(self) -> float:
        """CPU seconds of replays run in worker processes (planner.replan.sim_workers > 1)."""
        return self.first.worker_cpu_s if self.first is not None else 0.0


def static(model: ModelSpec, gpu: GpuSpec, config: SearchConfig, settings: ReplanSettings | None = None,
           sim: "SimConfig | None" = None, notes: Callable[[str], None] | None = None) -> SearchOnce:
    return SearchOnce("static", model, gpu, config, settings, sim, notes)


def homogeneous_tp2(model: ModelSpec, gpu: GpuSpec, config: SearchConfig) -> SearchOnce:
    return SearchOnce("tp2", model, gpu, config.model_copy(update={"tp_choices": (2,)}))


class Online(SearchOnce):
    """Starts like `static` (or from `first`), then lets the `Replanner` decide after every step."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, config: SearchConfig, settings: ReplanSettings,
                 sim: "SimConfig", first: Candidate | None = None, notes: Callable[[str], None] | None = None):
        super().__init__("online", model, gpu, config, settings, sim, notes)
        self.given = first
        self.replanner: Replanner | None = None
        self.trace: Trace | None = None
        self.decisions: list[tuple[int, bool, str]] = []  # (step, applied, reason)
        self.changes: list[PlanChange] = []  # the moves made, in order

    def initial(self, trace: Trace) -> Candidate:
        from libra.services.planner.sim.rank import SimRanker  # (rank imports the simulator, which imports us)

        best = self.given if self.given is not None else super().initial(trace)
        settings = self.settings.model_copy(update={"batch_sequences": trace.batch,
                                                    "trace_window": max(self.settings.trace_window, trace.batch),
                                                    "min_history_samples": min(trace.batch,
                                                                               self.settings.min_history_samples)})
        ranker = SimRanker(self.model, self.gpu, self.config, self.sim, settings.sim_window_steps,
                           settings.sim_warmup_steps, workers=settings.sim_workers)
        steps = self.sim.steps or len(trace.steps)
        self.replanner = Replanner(self.model, self.gpu, self.config.total_gpus, settings, self.config, best, ranker,
                                   total_steps=steps)
        self.trace = trace
        return best

    def after_step(self, record: StepRecord) -> PlanChange | None:
        assert self.replanner is not None and self.trace is not None, "initial() first"
        plays, cpu = self._replays_so_far()
        rejected = self.replanner.observe_step(StepObservation(
            record.step, record.interval_s, record.rollout_s, record.train_s, record.queue_depth,
            record.active_rollouts, 0, list(record.lengths), record.sequences, self.trace.steps[record.step]))
        if rejected:
            self.decisions.append((record.step, False, f"observation rejected: {rejected}"))
            return None
        decision = self.replanner.consider(record.time_s)
        if decision.record or decision.applied:
            self.decisions.append((record.step, decision.applied, decision.reason))
            plays_now, cpu_now = self._replays_so_far()
            if self.notes is not None and plays_now > plays:  # a decision that replayed: minutes at cluster scale
                self.notes(f"  decision after step {record.step}: {'MOVE' if decision.applied else 'keep'} "
                           f"({plays_now - plays} replays, {cpu_now - cpu:.1f} CPU-s; --decisions prints why)")
        if decision.applied and decision.chosen is not None:
            self.changes.append(PlanChange(decision.chosen, decision.downtime_s,
                                           decision.reason))
            return self.changes[-1]
        return None

    @property
    def _ranker(self):
        """The replanner's ranker (None before `initial`, or without one)."""
        return self.replanner.ranker if self.replanner is not None else None

    def _replays_so_far(self) -> tuple[int, float]:
        """Replays the replanner has played, and the CPU seconds of this process and its replay workers."""
        ranker = self._ranker
        return (ranker.plays if ranker is not None else 0,
                time.process_time() + (ranker.worker_cpu_s if ranker is not None else 0.0))

    @property
    def worker_cpu_s(self) -> float:
        ranker = self._ranker
        return super().worker_cpu_s + (ranker.worker_cpu_s if ranker is not None else 0.0)

    def close(self) -> None:
        """Stop the replanner's replay workers, if any."""
        if self._ranker is not None:
            self._ranker.close()

    def set_replay_workers(self, workers: int) -> None:
        """Replay in `workers` processes from now on (a resumed run on another machine; the same results)."""
        if self._ranker is not None:
            self._ranker.set_workers(workers)


class Scripted:
    """A given first plan and given changes {step: PlanChange} (tests and what-if runs)."""

    name = "scripted"

    def __init__(self, first: Candidate, changes: dict[int, PlanChange]):
        self.first, self.changes = first, changes

    def initial(self, trace: Trace) -> Candidate:
        return self.first

    def after_step(self, record: StepRecord) -> PlanChange | None:
        return self.changes.get(record.step)
