"""One simulated run from command-line choices: trace, controller, simulator, summary, JSON, plot.

`libra sim` and `benchmarks/grp_eval.py` both go through `simulate()`, so the figures a person
gets from the CLI are the figures the benchmark tabulates. `run_plan()` plays a trace (e.g. the
recent window) under one plan held fixed: one call per candidate plan. Bad input (a trace with
absurd lengths, a GPU budget below one replica, a model the cluster cannot hold) raises
`InvalidArgument`/`ConfigError` with the cause; the CLI turns those into exit code 2.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict
from typing import Callable

from pydantic import ValidationError

from libra.errors import ConfigError, InvalidArgument
from libra.routing.names import POLICY_NAMES
from libra.services.planner.config import ReplanSettings
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.search import Candidate, SearchConfig
from libra.services.planner.sim import control
from libra.services.planner.sim.checkpoint import Checkpoint
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.instance import InstanceModel
from libra.services.planner.sim.result import SimResult, StepRecord
from libra.traces import files, r2e, synthetic
from libra.traces.spec import Trace

PLANNERS = ("static", "tp2", "online")
POLICIES = POLICY_NAMES


def cohort_copies(batch: int, max_units: int) -> int:
    """Smallest divisor of `batch` that leaves at most `max_units` simulated trajectories per step."""
    for copies in range(1, batch + 1):
        if batch % copies == 0 and batch // copies <= max_units:
            return copies
    return batch


def build_trace(source: str, steps: int, prompts: int, group_size: int, seed: int, drift: float,
                max_units: int) -> Trace:
    if steps < 1:
        raise InvalidArgument(f"steps must be >= 1, got {steps}")
    if source == "synthetic":
        copies = cohort_copies(prompts * group_size, max_units)
        return synthetic.drifting(steps, prompts, group_size, seed, drift, copies)
    if source == "r2e":
        return r2e.r2e_like(steps, prompts, group_size, seed, drift, cohort_copies(prompts * group_size, max_units))
    return files.load(source, steps, prompts * group_size)


def make_controller(planner: str, model: ModelSpec, gpu: GpuSpec, config: SearchConfig,
                    replan: ReplanSettings | None = None, sim: SimConfig | None = None,
                    notes: Callable[[str], None] | None = None) -> control.Controller:
    if planner == "static":
        return control.static(model, gpu, config, replan or ReplanSettings(), sim or SimConfig(), notes)
    if planner == "tp2":
        return control.homogeneous_tp2(model, gpu, config)
    if planner == "online":
        return control.Online(model, gpu, config, replan or ReplanSettings(), sim or SimConfig(), notes=notes)
    raise InvalidArgument(f"unknown planner {planner!r}; choose one of {', '.join(PLANNERS)}")


def simulate(model: ModelSpec, gpu: GpuSpec, gpus: int, trace: Trace, planner: str, policy: str,
             sim: SimConfig | None = None, replan: ReplanSettings | None = None,
             progress: Callable[[StepRecord], None] | None = None, group_size: int = 8,
             search_options: dict | None = None, checkpoint: Checkpoint | None = None,
             notes: Callable[[str], None] | None = None) -> SimResult:
    """Run one simulation (with `checkpoint`: saved as it goes, and continued from its file if there is
    one); every bad-input path ends in `InvalidArgument` naming the cause."""
    if gpus < 2:
        raise InvalidArgument(f"gpus must be >= 2 (one to train, one to roll out), got {gpus}")
    try:
        config = SearchConfig(total_gpus=gpus, group_size=group_size, **(search_options or {}))
        sim = (sim or SimConfig()).model_copy(update={"policy": policy})
        SimConfig.model_validate(sim.model_dump())
    except ValidationError as error:
        first = error.errors()[0]
        raise InvalidArgument(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if policy not in POLICIES:
        raise InvalidArgument(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    try:
        return Simulator.run_or_resume(
            lambda: Simulator(model, gpu, trace, make_controller(planner, model, gpu, config, replan, sim, notes), config,
                              sim),
            progress, checkpoint, replan.sim_workers if replan is not None else None, notes)[1]
    except Infeasible as error:
        raise InvalidArgument(f"{gpus} GPUs cannot run {model.name} on {gpu.name} for this trace: {error}") from None


def run_plan(model: ModelSpec, gpu: GpuSpec, trace: Trace, candidate: Candidate, search: SearchConfig,
             sim: SimConfig | None = None, instance_model: InstanceModel | None = None,
             move_to: Candidate | None = None, transition_s: float = 0.0, move_after: int = 0) -> SimResult:
    """Play `trace` (e.g. the recent window of a run) under `candidate`, held for the whole trace:
    what the asynchronous pipeline does with that plan. `search` supplies the efficiencies and the
    TP degrees the engines are built for; `instance_model` replaces the cost model's engines. With
    `move_to`, the plan changes to it after step `move_after`, ready `transition_s` later (the move
    as the simulator plays it: engines drained and started, turns moved, the trainer resharded)."""
    for plan in (candidate, move_to):
        if plan is not None and not any(n > 0 for _, n in plan.rollout):
            l = plan.layout
            raise InvalidArgument(f"the plan with training tp{l.tp} pp{l.pp} dp{l.dp} has no rollout engine (rollout "
                                  f"fleet {list(plan.rollout)}: no bucket with a replica): give at least one "
                                  f"(tp, count >= 1)")
    changes = ({move_after: control.PlanChange(move_to, transition_s, "replay of a move")}
               if move_to is not None else {})
    controller = control.Scripted(candidate, changes)
    try:
        return Simulator(model, gpu, trace, controller, search, sim or SimConfig(), instance_model).run()
    except Infeasible as error:
        raise InvalidArgument(f"plan {candidate.describe()} cannot run {model.name} on {gpu.name} for this trace: "
                              f"{error}") from None


def summary(result: SimResult, label: str = "", decisions: bool = False) -> list[str]:
    """The run in a few lines; with `decisions`, every decision the replanner recorded, one a line."""
    steps = result.steps
    lines = [f"{label}plan at start: {result.first_plan}",
             f"{label}plan at end:   {result.last_plan}",
             f"{label}{len(steps)} steps in {result.makespan_s:,.0f} simulated s: "
             f"{result.trajectories_per_s:.3f} trajectories/s, {result.tokens_per_s:,.0f} output tokens/s",
             f"{label}step time mean {_mean(s.interval_s for s in steps):.1f}s (first 10: "
             f"{_mean(s.interval_s for s in steps[:10]):.1f}s, last 10: {_mean(s.interval_s for s in steps[-10:]):.1f}s); "
             f"train mean {_mean(s.train_s for s in steps):.1f}s, rollout mean {_mean(s.rollout_s for s in steps):.1f}s, "
             f"trainer waited {_mean(s.wait_s for s in steps):.1f}s",
             f"{label}plan changes: {len(result.plan_changes)}"]
    for change in result.plan_changes:
        lines.append(f"{label}  after step {change.step} at {change.time_s:,.0f}s, ready {change.ready_s:,.0f}s "
                     f"(transition {change.transition_s:.0f}s, {change.moved_turns} turns moved): {change.after}")
    if result.decisions:
        applied = sum(1 for _, done, _ in result.decisions if done)
        lines.append(f"{label}replanning decisions: {len(result.decisions)} recorded, {applied} applied"
                     + ("" if decisions else " (--decisions prints them)"))
        if decisions:
            lines += [f"{label}  after step {step}: {'MOVE' if done else 'keep'}: {reason}"
                      for step, done, reason in result.decisions]
    lines.append(f"{label}routes {result.routes:,}, peak KV use {result.peak_kv:.1%}, engines per simulated worker "
                 f"<= {result.pooled}, trajectories per trace entry {result.copies}; "
                 f"wall {result.wall_s:.1f}s, CPU {result.cpu_s:.1f}s")
    if result.notes:
        lines.append(f"{label}notes: {len(result.notes)} (first: {result.notes[0]})")
    return lines


def to_json(result: SimResult, extra: dict | None = None) -> dict:
    return {**(extra or {}), "makespan_s": result.makespan_s, "trajectories": result.trajectories,
            "output_tokens": result.output_tokens, "trajectories_per_s": result.trajectories_per_s,
            "tokens_per_s": result.tokens_per_s, "first_plan": result.first_plan, "last_plan": result.last_plan,
            "plan_changes": [asdict(c) for c in result.plan_changes], "routes": result.routes,
            "reasons": dict(result.reasons), "peak_kv": result.peak_kv, "pooled": result.pooled,
            "copies": result.copies, "wall_s": result.wall_s, "cpu_s": result.cpu_s, "notes": result.notes,
            "decisions": [{"step": step, "applied": applied, "reason": reason}
                          for step, applied, reason in result.decisions],
            "steps": [{"step": s.step, "time_s": s.time_s, "interval_s": s.interval_s, "rollout_s": s.rollout_s,
                       "train_s": s.train_s, "wait_s": s.wait_s, "sequences": s.sequences} for s in result.steps]}


def write_json(path: str | pathlib.Path, payload: dict) -> None:
    try:
        pathlib.Path(path).write_text(json.dumps(payload, indent=1))
    except OSError as error:
        raise ConfigError(f"cannot write {path}: {error.strerror}") from None


def plot(runs: dict[str, SimResult], out: str | pathlib.Path, title: str) -> None:
    """Trajectories/s per step (batch / step wall time, 10-step moving mean: with staleness 1 the
    steps come in pairs, a long one and a short one) for each run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7.5, 4))
    for index, (label, result) in enumerate(runs.items()):
        rates = [s.sequences / s.interval_s for s in result.steps]
        smooth = [_mean(rates[max(0, i - 9):i + 1]) for i in range(len(rates))]
        line, = axis.plot([s.step for s in result.steps], smooth, lw=1.8, ls=("-", "--", ":", "-.")[index % 4],
                          label=f"{label}: {result.trajectories_per_s:.2f} traj/s overall")
        for change in result.plan_changes:
            axis.axvline(change.step, color=line.get_color(), ls=":", lw=1)
    axis.set_xlabel("training step")
    axis.set_ylabel("trajectories / s (10-step mean)")
    axis.set_title(title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=110)
    except OSError as error:
        raise ConfigError(f"cannot write {out}: {error.strerror}") from None
    finally:
        plt.close(fig)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
