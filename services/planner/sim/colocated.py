"""The plan of a synchronous colocated job (verl's default trainer): every GPU rolls out, then every
GPU trains, so the plan is the best training layout over all the GPUs and the best rollout fleet
over all the GPUs, chosen independently (a step costs their sum, not their max).

A controller (`control.Controller`) for `cluster.Simulator` with `SimConfig(colocated=True)`:

    rollout   one TP degree for every engine (a vLLM fleet of one size, as verl runs it), the
              degree whose fleet the cost model finishes step 0's batch soonest on
    training  the layout over exactly all the GPUs (tp x pp x dp = GPUs, whole GRPO groups per
              replica) with the shortest cost-model step on step 0's batch; the simulator falls
              back to smaller micro-batches and full recompute as the lengths grow

`tp_choices` of the search config bounds both sides, `pp_choices` and `micro_batches` the
training side, as in the planner's search. The plan never changes. Pure: no clock, no events.
"""

from __future__ import annotations

import math

from libra.services.planner import cost_rollout, cost_train
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.cost_train import Layout
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.layout_rules import data_parallel_rule
from libra.services.planner.search import Candidate, SearchConfig
from libra.services.planner.sim.result import StepRecord
from libra.traces.spec import Trace


class Colocated:
    """Every GPU on both sides; the plan is chosen once on step 0's batch (module docstring)."""

    name = "colocated"

    def __init__(self, model: ModelSpec, gpu: GpuSpec, config: SearchConfig):
        self.model, self.gpu, self.config = model, gpu, config
        self.reason = ""

    def initial(self, trace: Trace) -> Candidate:
        pairs = trace.pairs(0)
        train_s, layout = self.best_layout(len(pairs), max(1, round(trace.mean_tokens(0))))
        rollout_s, tp = self.best_fleet(pairs)
        gpus = self.config.total_gpus
        plan = Candidate(layout, ((tp, gpus // tp),), train_s, rollout_s)
        self.reason = (f"colocated on {gpus} GPUs: train {train_s:.1f}s + rollout {rollout_s:.1f}s per step "
                       f"(cost model, step 0)")
        return plan

    def after_step(self, record: StepRecord) -> None:
        return None

    def best_layout(self, batch: int, seq_len: int) -> tuple[float, Layout]:
        gpus, config, best, error = self.config.total_gpus, self.config, (math.inf, None), None
        for tp in config.tp_choices:
            for pp in config.pp_choices:
                dp, rest = divmod(gpus, tp * pp)
                if rest or not dp or data_parallel_rule(dp, batch, config):
                    continue
                for mb in config.micro_batches:
                    try:
                        seconds = cost_train.step_time(self.model, self.gpu, Layout(tp, pp, dp, mb), batch,
                                                       seq_len, config.train, config.group_size).seconds
                    except Infeasible as failure:
                        error = error or failure
                        continue
                    best = min(best, (seconds, Layout(tp, pp, dp, mb)), key=lambda item: item[0])
        if best[1] is None:
            raise Infeasible(f"no training layout of all {gpus} GPUs (tp {list(config.tp_choices)}, pp "
                             f"{list(config.pp_choices)}) runs a batch of {batch} sequences of {seq_len} tokens "
                             f"in groups of {config.group_size}: {error or 'no layout divides the batch'}")
        return best

    def best_fleet(self, pairs: list[tuple[int, int]]) -> tuple[float, int]:
        gpus, best, error = self.config.total_gpus, (math.inf, 0), None
        for tp in self.config.tp_choices:
            if self.gpu.gpus_per_node % tp or gpus < tp:
                continue
            try:
                engine = cost_rollout.instance(self.model, self.gpu, tp, self.config.rollout)
                seconds = cost_rollout.rollout_time(pairs, [engine] * (gpus // tp))
            except Infeasible as failure:
                error = error or failure
                continue
            best = min(best, (seconds, tp))
        if not best[1]:
            raise Infeasible(f"no rollout TP degree in {list(self.config.tp_choices)} serves {self.model.name} on "
                             f"{gpus} x {self.gpu.name}: {error or 'none fits a node'}")
        return best
