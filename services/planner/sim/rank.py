"""The replanner's `Ranker` (evaluate.py): the recent window of a run replayed through the cluster
simulator, under one plan or across a move from one plan to another.

    window(observations) ─▶ the last finished batches as a `Trace`: `warmup_steps` that warm the
        replay up (the pipeline fills, the routing policy learns), then `window_steps` measured,
        rounded down to 1 + a whole number of pipeline periods (staleness + 1 steps), since rates
        run from the end of the last warm-up step
        (their trajectories with turns and tool calls when the observations carry them; else their
         (prompt, output) lengths as single-turn trajectories, grouped into cohorts of identical
         copies beyond `max_units` per step, the simulator's resolution knob)
    play(window, plan, efficiencies[, move_to, transition_s]) ─▶ Played(steps' ends, batch rollout spans)
        the window from an empty pipeline under `plan` (`run.run_plan`), or under `plan` until the
        end of the warm-up and `move_to` after it, ready `transition_s` later
    play_all(window, [Replay]) ─▶ [Played]
        several at once, in `workers` processes when there are more than one (replays.py)

The efficiencies are the calibrated ones, so the replay runs at the speeds the run has shown. A
plan that cannot run the window (a trajectory no engine holds, a layout out of memory) plays as
steps that never end: it is never chosen, and a plan in force that cannot run it is moved off.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

from libra.errors import InvalidArgument
from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.cost_train import TrainEfficiency
from libra.services.planner.evaluate import Played, Replay
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.config import ReplanSettings
from libra.services.planner.search import Candidate, SearchConfig, search
from libra.services.planner.shortlist import shortlist, split_neighbours
from libra.services.planner.sim.cluster import SimConfig
from libra.services.planner.sim.replays import Context, ReplayPool, resolve_workers
from libra.services.planner.transition import same_plan
from libra.traces.spec import Trace, TrajectorySpec, TurnSpec, check, pairs


class SimRanker:
    """Replays of the recent window on the cluster simulator (one `Simulator` run per `play`)."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, search: SearchConfig, sim: SimConfig,
                 window_steps: int = 9, warmup_steps: int = 4, max_units: int = 1024, workers: int = 1):
        period = sim.staleness + 1
        if window_steps < 1 + period or warmup_steps < 0:
            raise InvalidArgument(f"window_steps must be >= {1 + period} (one step, then a whole pipeline period "
                                  f"of staleness + 1 steps) and warmup_steps >= 0, got {window_steps} and "
                                  f"{warmup_steps}")
        self.model, self.gpu, self.search, self.sim = model, gpu, search, sim
        self.warm = warmup_steps  # index of the step whose end the rates start from
        self.window_steps = warmup_steps + 1 + (window_steps - 1) // period * period
        self.max_units = max_units
        self.plays = 0
        self.pool = ReplayPool(workers)

    def window(self, observations: Sequence) -> Trace | None:
        recent = list(observations)[-self.window_steps:]
        if len(recent) < self.window_steps:
            return None
        if all(o.trajectories for o in recent) and len({sum(s.copies for s in o.trajectories) for o in recent}) == 1:
            steps = [[dataclasses.replace(spec, trajectory_id=f"w{i}-{spec.trajectory_id}", step=i)
                      for spec in o.trajectories] for i, o in enumerate(recent)]
        else:
            batch = min(len(o.lengths) for o in recent)
            if batch < 1:
                return None
            steps = [_cohorts(list(o.lengths)[-batch:], i, self.max_units) for i, o in enumerate(recent)]
        return check(Trace(tuple(tuple(step) for step in steps), "replay window"))

    def repeated(self, batch: Sequence[TrajectorySpec]) -> Trace:
        """A window of one batch played again at every step (a run's start: its first batch is all
        there is to go by), each step's trajectories and prompts named apart so that no routing
        policy learns a prompt's lengths from an earlier copy of it."""
        steps = [[dataclasses.replace(spec, trajectory_id=f"w{i}-{spec.trajectory_id}",
                                      prompt_id=f"w{i}-{spec.prompt_id}", step=i) for spec in batch]
                 for i in range(self.window_steps)]
        return check(Trace(tuple(tuple(step) for step in steps), "first batch, repeated"))

    def play(self, window: Trace, plan: Candidate, rollout: RolloutEfficiency, train: TrainEfficiency,
             move_to: Candidate | None = None, transition_s: float = 0.0) -> Played:
        return self.play_all(window, [Replay(plan, rollout, train, move_to, transition_s)])[0]

    def play_all(self, window: Trace, replays: Sequence[Replay]) -> list[Played]:
        """Every replay of `window`, in order: in worker processes when `workers` > 1 (replays.py)."""
        self.plays += len(replays)
        return self.pool.map(Context(self.model, self.gpu, self.search, self.sim, self.warm), window, replays)

    @property
    def workers(self) -> int:
        return self.pool.workers

    @property
    def worker_cpu_s(self) -> float:
        """CPU seconds spent in worker processes (0 with one worker: the replays ran here)."""
        return self.pool.worker_cpu_s

    def close(self) -> None:
        """Stop the worker processes, if any (they start again when needed)."""
        self.pool.close()

    def set_workers(self, workers: int) -> None:
        self.pool.close()
        self.pool.workers = resolve_workers(workers)


@dataclasses.dataclass(frozen=True)
class FirstPlan:
    """The plan a run starts from, and the replays that chose it."""

    chosen: Candidate
    searched: Candidate  # the closed-form search's best
    ranked: tuple[tuple[Candidate, float], ...]  # (candidate, simulated seconds per step), fastest first
    reason: str
    worker_cpu_s: float = 0.0  # CPU seconds of the replays run in worker processes
    workers: int = 1  # processes that played the replays (1: this one)


def first_plan(model: ModelSpec, gpu: GpuSpec, config: SearchConfig, sim: SimConfig, batch: Sequence[TrajectorySpec],
               settings: ReplanSettings, notes: Callable[[str], None] | None = None) -> FirstPlan:
    """The plan for a run's start, chosen as the replanner chooses later ones (evaluate.by_simulation).

    The closed-form search on the first batch prunes: its best `settings.shortlist` + 1 distinct
    splits (two fleets each), the best plan's engine exchanges (`shortlist.py`) and the best plan at
    other training data-parallel degrees, ¼× to 4× (`split_neighbours`: the search's shortlist often
    holds a single split). Each is played on the simulator over a window of that batch repeated, at
    `config`'s efficiencies (the uncalibrated defaults a run starts with); the fastest per step in
    the pipeline, once filled, is chosen (`ranking`: plans within `TIE` of the fastest tie, and a
    tie goes to the plan whose rollout finishes its batches soonest, then the search's order). The
    closed form ranks one synchronous step and knows every length in advance, so its own best is
    often not the fastest asynchronous plan (docs/benchmarks.md, the headline).

    `notes`, if given, is told what is being done as it goes (a line per replay when they are
    played here, one after the other): at cluster scale the choice takes a minute of CPU."""
    say = notes or (lambda line: None)
    started = time.process_time()
    lengths = pairs(batch)
    say(f"first plan: the closed-form search on step 0's batch of {len(lengths):,} trajectories")
    wide = config.model_copy(update={"distinct_splits": True, "fleets_per_split": 2, "top_k": settings.shortlist + 1})
    result = search(model, gpu, lengths, wide)
    candidates = [result.best] + shortlist(result, model, gpu, lengths, wide, result.best, settings.shortlist,
                                           settings.neighbours, settings.whole_exchanges)
    whole = result.placement.startswith("whole nodes on")
    for candidate in split_neighbours(model, gpu, lengths, config, result.best, whole):
        if not any(same_plan(candidate, c) for c in candidates):
            candidates.append(candidate)
    ranker = SimRanker(model, gpu, config, sim, settings.sim_window_steps, settings.sim_warmup_steps,
                       workers=settings.sim_workers)
    window = ranker.repeated(batch)
    say(f"first plan: {len(candidates)} candidate plans replayed on that batch, {len(window.steps)} steps each"
        + (f", in {ranker.workers} processes" if ranker.workers > 1 else "")
        + f" ({time.process_time() - started:.1f} CPU-s so far)")
    plays = [Replay(candidate, config.rollout, config.train) for candidate in candidates]
    try:
        if ranker.workers > 1:
            replays = ranker.play_all(window, plays)
        else:  # one at a time, each reported as it ends
            replays = []
            for index, play in enumerate(plays, start=1):
                replays.append(ranker.play_all(window, [play])[0])
                say(f"  replay {index}/{len(plays)}: {replays[-1].per_step_s:8.1f}s per step  "
                    f"{play.plan.describe()}")
    finally:
        ranker.close()
    order = ranking(replays)
    ranked = tuple((candidates[index], replays[index].per_step_s) for index in order)
    chosen, per_step = ranked[0]
    if not math.isfinite(per_step):
        raise InvalidArgument(f"no candidate plan can run the first batch on the simulator "
                              f"(closed-form best: {result.best.describe()})")
    searched_s = next(s for c, s in ranked if c is result.best)
    if chosen is result.best:
        reason = (f"the search's best on the batch, also the fastest of {len(ranked)} simulated on it "
                  f"({per_step:.1f}s per step): {chosen.describe()}")
    else:
        reason = (f"the fastest of {len(ranked)} plans simulated on the batch: {per_step:.1f}s per step "
                  f"against {searched_s:.1f}s for the closed form's best ({result.best.describe()}): "
                  f"{chosen.describe()}")
    fastest = min(replays[index].per_step_s for index in order)
    tied = [index for index in order if replays[index].per_step_s <= fastest * (1 + TIE)]
    if len(tied) > 1:
        reason += (f" (tied with {len(tied) - 1} other(s) within {TIE:.1%} per step; its rollout finishes a batch "
                   f"soonest: {_span(replays[order[0]]):.1f}s against {_span(replays[tied[1]]):.1f}s)")
    say(f"first plan: {chosen.describe()} ({per_step:.1f}s per step; "
        f"{time.process_time() - started + ranker.worker_cpu_s:.1f} CPU-s to choose)")
    return FirstPlan(chosen, result.best, ranked, reason, ranker.worker_cpu_s, ranker.workers)


TIE = 1e-3  # replays within this share of the fastest per step tie (e.g. training-bound: the trainer sets the pace)


def ranking(replays: Sequence[Played]) -> list[int]:
    """The replays' indices, fastest per step first. Those within `TIE` of the fastest are a tie the
    pace cannot settle (a training-bound pipeline steps at the trainer's pace whatever the fleet):
    among them the plan whose rollout finishes a batch soonest comes first, since its slack absorbs
    the growth of lengths a run's first batch does not show (docs/benchmarks.md, the headline's
    first plan); then the given order (the search's)."""
    order = sorted(range(len(replays)), key=lambda index: (replays[index].per_step_s, index))
    if not order or not math.isfinite(fastest := replays[order[0]].per_step_s):
        return order
    tied = [index for index in order if replays[index].per_step_s <= fastest * (1 + TIE)]
    tied.sort(key=lambda index: (_span(replays[index]), index))
    return tied + order[len(tied):]


def _span(replay: Played) -> float:
    """The mean rollout span of the batches a replay measured (after its warm-up)."""
    spans = replay.rollout_spans[replay.warm + 1:] or replay.rollout_spans
    return sum(spans) / len(spans) if spans else math.inf


def _cohorts(lengths: list[tuple[int, int]], step: int, max_units: int) -> list[TrajectorySpec]:
    """Single-turn trajectories of one step's lengths: sorted, and merged into cohorts of `copies`
    consecutive ones (their mean lengths) when there are more than `max_units`."""
    lengths = sorted(lengths, key=lambda pair: pair[0] + pair[1])
    copies = next(c for c in range(1, len(lengths) + 1) if len(lengths) % c == 0 and len(lengths) // c <= max_units)
    out = []
    for index in range(0, len(lengths), copies):
        group = lengths[index:index + copies]
        prompt = max(1, round(sum(p for p, _ in group) / copies))
        output = max(1, round(sum(o for _, o in group) / copies))
        out.append(TrajectorySpec(f"w{step}-r{index}", f"w{step}-r{index}", step, prompt, (TurnSpec(output),), copies))
    return out
