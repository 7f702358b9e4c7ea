"""The training side of the cluster simulator: the layout in force, elastic hybrid replicas joining
and leaving it, and what a step, a weight sync and a colocated phase switch cost.

`cluster.Simulator` owns the clock and asks this module for seconds; nothing here schedules an
event. Pure arithmetic over the planner's cost model (`cost_train`), no randomness.

Plan changes (`TrainerSide.change`):

    same layout                          nothing happens
    hybrid move (elastic pool on):       the core keeps stepping on the old layout;
      same tp and pp, dp changes,          dp grows:   the hybrids join at the first step that
      both dp >= core_replicas                         starts once they are ready (snapshot
                                                       fetched while the core steps)
                                           dp shrinks: released at this step boundary
    anything else                        the whole trainer reshards: it stops until the move is
                                         ready (the transition cost)

Colocated (verl's design): every GPU trains after every GPU rolled out. A phase switch moves the
trainer's state (bf16 weights, fp32 grads, fp32 master + Adam shards) out to the host after the
step and back before the next (`host_gbps`), and the new weights are copied in place into the
engines on the same GPUs (resharded over NVLink from the training layout to the engines' TP).
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.services.planner import cost_train
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.cost_train import Layout, TrainEfficiency
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.sim.instance import SimulationError


def hybrid_move(old: Layout, new: Layout, core_replicas: int) -> bool:
    """Can the elastic pool make this change without stopping the core (module docstring)?"""
    return (core_replicas >= 1 and old.tp == new.tp and old.pp == new.pp and old.dp != new.dp
            and min(old.dp, new.dp) >= core_replicas)


def state_bytes_per_gpu(model: ModelSpec, layout: Layout) -> float:
    """The trainer's state on its busiest GPU: bf16 weights, fp32 grads, fp32 master + Adam over dp."""
    shard = model.total_params / (layout.tp * layout.pp)
    return shard * (model.bytes_per_param + 4.0 + 12.0 / layout.dp)


@dataclass
class TrainerSide:
    """The layout in force and a hybrid join waiting for its replicas (`pending`: layout, ready at)."""

    model: ModelSpec
    gpu: GpuSpec
    batch: int
    layout: Layout
    core_replicas: int = 0
    group_size: int = 1  # GRPO samples per prompt: a DP replica trains whole groups
    pending: tuple[Layout, float] | None = None
    joins: int = 0  # hybrid moves made (joins and releases)

    def change(self, new: Layout, now: float, ready: float) -> float:
        """Move to `new`, decided at `now`, ready at `ready`; returns when the trainer can step again."""
        current = self.pending[0] if self.pending else self.layout
        if new == current:
            return now
        if hybrid_move(self.layout, new, self.core_replicas):
            self.joins += 1
            if new.dp > self.layout.dp:
                self.pending = (new, ready)  # the core steps on; the hybrids join once ready
            else:
                self.layout, self.pending = new, None  # released at this step boundary
            return now
        self.layout, self.pending = new, None
        return ready

    def in_force(self, now: float) -> Layout:
        """The layout a step starting at `now` runs on (a ready join takes effect here)."""
        if self.pending and self.pending[1] <= now:
            self.layout, self.pending = self.pending[0], None
        return self.layout

    def step_seconds(self, layout: Layout, seq_len: int, eff: TrainEfficiency, notes: list[str], step: int) -> float:
        """The layout's step time. When the lengths have grown past its memory, what a trainer does
        without new GPUs: a smaller micro-batch, then full activation recompute (activations of
        the layer inputs only, one more forward pass: 4/3 of the compute); an error when none fits."""
        full_recompute = eff.model_copy(update={"activation_bytes_per_token_layer": 2.0, "mfu": eff.mfu * 0.75})
        error = None
        for how_eff, how in ((eff, ""), (full_recompute, "full activation recompute")):
            for mb in range(layout.micro_batch, 0, -1):
                try:
                    seconds = cost_train.step_time(self.model, self.gpu, Layout(layout.tp, layout.pp, layout.dp, mb),
                                                   self.batch, seq_len, how_eff, self.group_size).seconds
                except Infeasible as failure:
                    error = error or failure
                    continue
                if mb != layout.micro_batch or how:
                    notes.append(f"step {step}: micro_batch {mb}{', ' + how if how else ''} to fit "
                                 f"{seq_len}-token sequences")
                return seconds
        raise SimulationError(f"step {step}: the training layout cannot run a batch of {self.batch} sequences of "
                              f"{seq_len} tokens on {self.gpu.name}: {error}")

    def offload_seconds(self, layout: Layout, host_gbps: float) -> float:
        """Colocated: the trainer's state to the host or back, once."""
        return state_bytes_per_gpu(self.model, layout) / (host_gbps * 1e9)

    def reload_seconds(self, engine_tp: int, latency_s: float) -> float:
        """Colocated: the new weights into an engine of `engine_tp` on the same GPUs (over NVLink)."""
        link = self.gpu.nvlink_gbps / 2 or self.gpu.internode_gbps  # one direction
        return self.model.weight_bytes / engine_tp / (link * 1e9) + latency_s
