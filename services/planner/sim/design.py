"""A run config's design at cluster scale: what `libra sim --config FILE` and
benchmarks/headline_sim.py simulate, so that one YAML is both a job `libra up` runs here and the
design the simulator plays on the cluster its planner section names.

What the simulator takes from the run config:

    planner.cluster.hardware / model / gpus     the cluster (configs/hardware, configs/models)
    planner.cluster.tp_choices, min_train_gpus,  what the plan may use (the search's constraints:
      min_rollout_gpus, whole_nodes                an even split is min_train = min_rollout = gpus/2)
    trainer.group_size                          GRPO group size: whole groups per DP replica
    trainer.max_staleness                       the staleness bound of the asynchronous pipeline;
                                                0 is a synchronous job, simulated colocated
                                                (asynchronous jobs batch as the trainer does: the
                                                first complete fresh groups, `first_complete`)
    planner.mode                                static: the planner's plan for step 0, kept (the
                                                search's shortlist ranked by simulating step 0's
                                                batch, control.static); online: the same start,
                                                then the Replanner after every step (planner.replan)
    scheduler.policy (its type)                 the routing policy, at its default settings
    elastic.core_replicas                       online only: the core of the elastic hybrid pool
                                                (a change of dp alone joins or releases hybrids)

A synchronous job (max_staleness 0) is played colocated, verl's design, as configs/sync-colocated.yaml
runs it on GPUs: every GPU rolls out, then every GPU trains (`colocated.Colocated` plans it; a
synchronous job on separate pools would leave each pool idle while the other works). What sizes
the job on this machine is not carried: planner.training and planner.buckets as written, the
workers' engines, model.*, rollout limits, scheduler.per_worker_cap_tokens (tokens of this
machine's workers): at cluster scale the plan comes from the search and the lengths from the trace.

The trace: `trace_batches(steps)` batches for `steps` training steps: the spare ones supply the
groups that replace those the trainer rejects as stale (batching.py), and generated lengths drift
by 1 + drift at the last trained step (`trace_drift`), whatever the spare. `libra sim --config`
and benchmarks/headline_sim.py build it the same way, so both give the same figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from libra.errors import ConfigError, InvalidArgument
from libra.services.planner.config import ReplanSettings
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.hardware import GpuSpec, ModelSpec, gpu_named, model_named
from libra.services.planner.search import SearchConfig
from libra.services.planner.sim import control
from libra.services.planner.sim.ceiling import Ceiling, ceiling
from libra.services.planner.sim.checkpoint import Checkpoint
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.colocated import Colocated
from libra.services.planner.sim.result import SimResult, StepRecord
from libra.services.planner.sim.usage import Usage
from libra.traces.spec import Trace

if TYPE_CHECKING:
    from libra.config import RunConfig


@dataclass(frozen=True)
class Design:
    """One design at cluster scale, as read from a run config (module docstring)."""

    name: str
    model: ModelSpec
    gpu: GpuSpec
    planner: Literal["colocated", "static", "online"]
    search: SearchConfig
    sim: SimConfig
    replan: ReplanSettings

    def describe(self) -> str:
        elastic = f", elastic core {self.sim.core_replicas}" if self.sim.core_replicas else ""
        return (f"{self.name}: {self.planner} plan on {self.search.total_gpus} x {self.gpu.name}, {self.model.name}; "
                f"policy {self.sim.policy}, staleness {self.sim.staleness}, tp {list(self.search.tp_choices)}"
                f"{elastic}")


@dataclass
class DesignRun:
    """A simulated run of a design: the simulator's result and what the GPUs did (usage.py)."""

    design: Design
    result: SimResult
    usage: Usage
    hybrid_moves: int = 0  # plan changes the elastic pool made without stopping the trainer
    ceiling: Ceiling | None = None  # of the trace's first batches, as many as the run trained (ceiling.py)

    def lines(self) -> list[str]:
        busy = ", ".join(f"{pool} {share:.1%}" for pool, share in self.usage.fractions().items())
        stale = ", ".join(f"{lag}: {share:.1%}" for lag, share in self.usage.staleness_shares().items())
        lines = [f"busy GPU fraction per pool: {busy}",
                 f"staleness (versions behind: share of trajectories trained): {stale}; rejected as stale: "
                 f"{self.usage.rejected:,} trajectories",
                 f"hybrid moves (elastic pool, trainer kept stepping): {self.hybrid_moves}"]
        if self.ceiling is not None:
            share = self.result.trajectories_per_s / self.ceiling.trajectories_per_s
            caveat = ("" if not self.usage.rejected else
                      " (not a strict bound here: groups of later batches were trained in place of rejected ones)")
            lines.append(f"throughput ceiling of these batches (any design, this cost model: ceiling.py): "
                         f"{self.ceiling.trajectories_per_s:.3f} trajectories/s; this run {share:.1%} of it, "
                         f"so no design trains them more than {1 / share:.2f}x faster{caveat}")
        return lines


def design_of(config: "RunConfig", max_workers: int = 256) -> Design:
    """The design a run config describes at the scale of its planner.cluster section."""
    cluster, trainer = config.planner.cluster, config.trainer
    try:
        model, gpu = model_named(cluster.model), gpu_named(cluster.hardware)
    except (ConfigError, InvalidArgument) as error:
        raise ConfigError(f"planner.cluster: {error}") from None
    colocated = trainer.max_staleness == 0
    if colocated and config.planner.mode == "online":
        raise ConfigError("planner.mode online with trainer.max_staleness 0: a synchronous job is simulated "
                          "colocated on a fixed plan; set planner.mode: static (or max_staleness >= 1)")
    planner = "colocated" if colocated else config.planner.mode
    try:
        search = SearchConfig(total_gpus=cluster.gpus, group_size=trainer.group_size, tp_choices=cluster.tp_choices,
                              min_train_gpus=cluster.min_train_gpus, min_rollout_gpus=cluster.min_rollout_gpus,
                              whole_nodes=cluster.whole_nodes,
                              uneven_splits_up_to=cluster.uneven_splits_up_to)
    except ValueError as error:
        raise ConfigError(f"planner.cluster: {error}") from None
    sim = SimConfig(staleness=trainer.max_staleness, policy=config.scheduler.policy.type, max_workers=max_workers,
                    colocated=colocated, batching="in_order" if colocated else "first_complete",
                    core_replicas=config.elastic.core_replicas if planner == "online" else 0)
    return Design(config.run_id, model, gpu, planner, search, sim, config.planner.replan)


def controller_of(design: Design, notes: Callable[[str], None] | None = None) -> control.Controller:
    """The design's plan controller; `notes` is told how the first plan's choice goes (rank.first_plan)."""
    if design.planner == "colocated":
        return Colocated(design.model, design.gpu, design.search)
    # replays (the first plan's ranking, online's decisions) batch in order, as the planner service plays them
    replay = design.sim.model_copy(update={"batching": "in_order", "steps": 0})
    if design.planner == "online":
        return control.Online(design.model, design.gpu, design.search, design.replan, replay, notes=notes)
    return control.static(design.model, design.gpu, design.search, design.replan, replay, notes=notes)


def trace_batches(steps: int) -> int:
    """Batches of the trace for `steps` training steps: 30% spare (and one) for rejected groups (the
    headline's (b) rejects up to ~16% at 4,096 GPUs)."""
    return steps + math.ceil(steps * 0.3) + 1


def design_trace(source: str, steps: int, prompts: int, group_size: int, seed: int, drift: float,
                 max_units: int = 1024) -> Trace:
    """The trace a design is played on for `steps` training steps (`libra sim --config`, the headline
    benchmarks): `trace_batches(steps)` batches whose lengths grow by 1 + `drift` over the steps trained."""
    from libra.services.planner.sim.run import build_trace

    return build_trace(source, trace_batches(steps), prompts, group_size, seed, trace_drift(drift, steps), max_units)


def trace_drift(drift: float, steps: int) -> float:
    """The generator's drift for a trace of `trace_batches(steps)` batches that grows by 1 + `drift`
    over the `steps` trained."""
    return drift * (trace_batches(steps) - 1) / (steps - 1) if steps > 1 else drift


def simulate_design(design: Design, trace: Trace, steps: int = 0,
                    progress: Callable[[StepRecord], None] | None = None,
                    checkpoint: Checkpoint | None = None, notes: Callable[[str], None] | None = None) -> DesignRun:
    """Train `steps` steps (0: one per batch) on `trace` under the design; a trace the design cannot
    run raises `InvalidArgument` naming why. With `checkpoint`, the run saves itself as it goes and,
    where the checkpoint's file exists, goes on from it (checkpoint.py). `notes` is told how the
    first plan's choice goes (a minute of CPU at cluster scale), `progress` of each step."""
    if trace.batch % design.search.group_size:
        raise InvalidArgument(f"the trace's batch of {trace.batch} is not a whole number of GRPO groups of "
                              f"{design.search.group_size} (trainer.group_size)")
    sim = design.sim.model_copy(update={"steps": steps})
    try:
        simulator, result = Simulator.run_or_resume(
            lambda: Simulator(design.model, design.gpu, trace, controller_of(design, notes), design.search, sim),
            progress, checkpoint, design.replan.sim_workers, notes)
    except Infeasible as error:
        raise InvalidArgument(f"{design.name}: {design.search.total_gpus} GPUs cannot run {design.model.name} on "
                              f"{design.gpu.name} for this trace: {error}") from None
    trained = trace.steps[:len(result.steps)]
    bound = ceiling(design.model, design.gpu, design.search, trained) if trained else None
    return DesignRun(design, result, simulator.usage, simulator.trainer.joins, bound)
