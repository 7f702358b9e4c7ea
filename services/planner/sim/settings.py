"""What the simulated loop does besides the plan (`SimConfig`): staleness, routing policy, weight
sync, colocation, the elastic pool, batching, resolution. The settings of a run, apart from the
simulator that plays it (cluster.py), which re-exports the class."""

from __future__ import annotations

from pydantic import Field, model_validator

from libra.configbase import Section
from libra.routing.names import PolicyName
from libra.services.planner.sim.batching import Batching


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
    max_in_flight: int = Field(0, ge=0, le=100_000_000, description="trajectories played at once (a gateway's "
                                                                    "rollout.max_concurrent_trajectories: the "
                                                                    "rest wait, in release order, for a place; "
                                                                    "0: no limit)")
    draw_seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of the calibrated draws (each turn's gap and "
                           "time outside the engine: gaps.py); a run with another seed draws them afresh, to show "
                           "how much a figure owes to them (0: the draws of every earlier run)")
    steps: int = Field(0, ge=0, le=1_000_000, description="training steps to simulate (0: one per batch of the "
                                                          "trace; first_complete needs spare batches to replace "
                                                          "the groups it rejects)")

    @model_validator(mode="after")
    def _colocated_is_synchronous(self) -> "SimConfig":
        if self.colocated and self.staleness:
            raise ValueError(f"colocated runs are synchronous: set staleness 0 (got {self.staleness}); rollout "
                             "and training take turns on the same GPUs")
        return self
