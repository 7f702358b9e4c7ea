"""Typed config of the planner service (and of its online replanning: `ReplanSettings`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from libra.configbase import Section
from libra.services.planner.calibration import CalibrationSettings


class ReplanSettings(Section):
    """Online replanning: triggers, gates, acceptance and the transition-cost model."""

    interval_s: float = Field(600.0, ge=0, le=1e7, description="re-evaluate at least this often (0: never on time)")
    pressure_steps: int = Field(3, ge=1, le=10_000, description="recent steps averaged by the pressure triggers")
    window_steps: int = Field(20, ge=1, le=100_000, description="recent steps kept for signals and calibration")
    queue_depth_high: float = Field(0.0, ge=0, le=1e9, description="mean queued turns that trigger (0: off)")
    active_rollouts_high: float = Field(0.0, ge=0, le=1e9, description="mean active rollouts that trigger (0: off)")
    rejected_fraction_high: float = Field(0.2, ge=0, le=1, description="rejected/(rejected+trained) rollouts over "
                                                                      "the window that trigger (0: off)")
    time_ratio_high: float = Field(1.5, ge=0, le=1e6, description="rollout/train time ratio (or its inverse) that "
                                                                 "triggers (0: off; else > 1)")
    warmup_steps: int = Field(3, ge=0, le=1_000_000, description="steps observed before any decision")
    min_history_samples: int = Field(64, ge=1, le=10_000_000, description="finished rollouts needed to search")
    cooldown_s: float = Field(300.0, ge=0, le=1e7, description="no new plan this long after one was applied")
    recheck_s: float = Field(60.0, ge=0, le=1e7, description="no new search this long after one that was rejected")
    horizon_steps: int = Field(50, ge=1, le=10_000_000, description="steps a new plan is expected to run "
                                                                   "(the gain is counted over them)")
    min_gain_ratio: float = Field(0.03, ge=0, le=1, description="net gain / predicted time over the horizon "
                                                               "below which a plan is not applied")
    trace_window: int = Field(1024, ge=1, le=1_000_000, description="most recent lengths kept for the search")
    batch_sequences: int = Field(0, ge=0, le=10_000_000, description="sequences per training batch the search "
                                                                     "plans for (0: the planner service uses "
                                                                     "trainer groups_per_step x group_size; the "
                                                                     "bare Replanner the largest multiple of the "
                                                                     "group size in the trace window)")
    rank: Literal["simulate", "closed_form"] = Field(
        "simulate", description="simulate: rank the search's shortlist by playing the recent window through the "
                                "cluster simulator (the asynchronous pipeline, the move itself included); "
                                "closed_form: one synchronous step of the cost model")
    shortlist: int = Field(3, ge=1, le=32, description="the search's best distinct splits simulated per decision")
    neighbours: int = Field(6, ge=0, le=32, description="also simulated: the best plans one engine exchange away "
                                                        "from the plan in force (same split, TP mix changed)")
    whole_exchanges: bool = Field(True, description="also simulated: the plan in force with all the engines of one TP "
                                                    "degree turned into another's (the far ends of the TP mix)")
    other_splits: bool = Field(False, description="also simulated: the plan in force at the nearest other training "
                                                  "data-parallel degrees (a replica fewer and more, half and twice; "
                                                  "its TP and PP kept, the rollout fleet scaled to the GPUs left): "
                                                  "the search ranks one synchronous step, and its best splits can "
                                                  "all lean the same way")
    confirm: int = Field(2, ge=1, le=100, description="rank simulate: a move is applied only when this many "
                                                       "evaluations in a row call for one (replays of a short "
                                                       "window are noisy; 1: at once)")
    sim_window_steps: int = Field(9, ge=2, le=64, description="recent steps whose replay is measured per "
                                                             "candidate: 1 + a whole number of pipeline periods "
                                                             "(staleness + 1 steps) is used, rounding down")
    sim_warmup_steps: int = Field(4, ge=0, le=64, description="steps replayed before those, to fill the pipeline "
                                                             "and let the routing policy learn (not measured)")
    sim_workers: int = Field(1, ge=0, le=256, description="processes that replay the candidates of one decision "
                                                          "side by side (1: one after the other in the planner's "
                                                          "process; 0: one per available core, at most 16); "
                                                          "the decisions are the same, only sooner")
    drain_s: float = Field(30.0, ge=0, le=86_400, description="seconds to drain a GPU that changes role")
    process_start_s: float = Field(60.0, ge=0, le=86_400, description="seconds to start a new worker or trainer")
    load_gbps: float = Field(5.0, gt=0, le=10_000, description="GB/s per GPU when loading weights or state")
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings,
                                             description="EWMA calibration of the efficiencies")

    @model_validator(mode="after")
    def _consistent(self) -> "ReplanSettings":
        if 0 < self.time_ratio_high <= 1:
            raise ValueError(f"time_ratio_high must be 0 (off) or > 1, got {self.time_ratio_high}")
        if self.pressure_steps > self.window_steps:
            raise ValueError(f"pressure_steps ({self.pressure_steps}) must be <= window_steps ({self.window_steps})")
        if self.sim_window_steps + self.sim_warmup_steps > self.window_steps:
            raise ValueError(f"sim_window_steps + sim_warmup_steps ({self.sim_window_steps} + {self.sim_warmup_steps}) "
                             f"must be <= window_steps ({self.window_steps})")
        return self


class TrainingAllocation(Section):
    """GPUs and parallelism of the training side."""

    gpus: int = Field(0, ge=0, le=65536, description="GPUs for training (0: CPU training)")
    tp: int = Field(1, ge=1, le=64, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, le=256, description="pipeline-parallel degree")
    dp: int = Field(1, ge=1, le=65536, description="data-parallel degree")
    micro_batch: int = Field(8, ge=1, le=4096, description="sequences per micro-batch")


class BucketAllocation(Section):
    """One rollout bucket: a level of the scheduler's queue, served by `replicas` workers."""

    name: str = Field(..., min_length=1, max_length=32, pattern=r"^[a-z][a-z0-9_-]*$",
                      description="bucket name, e.g. short")
    tp: int = Field(1, ge=1, le=64, description="tensor-parallel degree of each worker")
    max_tokens: int = Field(..., ge=1, le=10_000_000,
                            description="largest remaining output (tokens) this bucket is for")
    replicas: int = Field(1, ge=0, le=4096, description="worker instances in this bucket")


class ClusterSettings(Section):
    """What the online planner plans for: the GPU cluster and the model, by their spec names."""

    hardware: str = Field("h200-141g", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                          description="configs/hardware/NAME.yaml")
    model: str = Field("qwen3-4b", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                       description="configs/models/NAME.yaml (the cost model's view of the policy)")
    gpus: int = Field(16, ge=2, le=1_000_000, description="GPUs shared by training and rollout")
    tick_s: float = Field(5.0, gt=0, le=3600, description="seconds between reads of the runtime history")
    tp_choices: tuple[int, ...] = Field((1, 2, 4, 8), min_length=1, description="TP degrees the search may use "
                                                                                "(both sides)")
    min_train_gpus: int = Field(1, ge=1, le=1_000_000, description="fewest GPUs the search gives training")
    min_rollout_gpus: int = Field(1, ge=1, le=1_000_000, description="fewest GPUs the search gives rollout, "
                                                                      "counting only those its engines use")
    whole_nodes: Literal["auto", "on", "off"] = Field(
        "auto", description="on: each side whole nodes; off: sides may share a node; auto: on for >= 2 whole "
                            "nodes while it costs <= 5% of the predicted step (services/planner/placement.py)")
    uneven_splits_up_to: int = Field(0, ge=0, le=1_000_000, description=(
        "on clusters of at most this many GPUs the planner may give training a data-parallel degree that does "
        "not divide the batch's GRPO groups (the busiest replica charged); 0: only degrees that divide them "
        "(off by default: on the headline's drifting trace it cost Libra full 16% at 512 GPUs, and every "
        "degree a candidate took the search at 1,024 GPUs from 0.05 to 3.7 s; docs/benchmarks.md)"))

    @model_validator(mode="after")
    def _sides(self) -> "ClusterSettings":
        if self.min_train_gpus + self.min_rollout_gpus > self.gpus:
            raise ValueError(f"min_train_gpus ({self.min_train_gpus}) + min_rollout_gpus ({self.min_rollout_gpus}) "
                             f"exceed gpus ({self.gpus})")
        if any(not 1 <= tp <= 64 for tp in self.tp_choices):
            raise ValueError(f"tp_choices must be in 1..64, got {list(self.tp_choices)}")
        return self


class PlannerConfig(Section):
    """The planner: serves the configured allocation as generation 1 (`mode: static`), and with
    `mode: online` also calibrates its cost model from runtime history and replans."""

    mode: Literal["static", "online"] = Field(
        "static", description="static: serve the configured allocation; online: also replan from runtime history")
    cluster: ClusterSettings = Field(default_factory=ClusterSettings, description="cluster planned for (online)")
    replan: ReplanSettings = Field(default_factory=ReplanSettings, description="online replanning policy")
    training: TrainingAllocation = Field(default_factory=TrainingAllocation,
                                         description="training side of the allocation")
    buckets: tuple[BucketAllocation, ...] = Field(
        (BucketAllocation(name="short", tp=1, max_tokens=64, replicas=1),
         BucketAllocation(name="long", tp=1, max_tokens=512, replicas=1)),
        description="rollout buckets, ordered by max_tokens")

    @model_validator(mode="after")
    def _buckets_sorted(self) -> "PlannerConfig":
        if not self.buckets:
            raise ValueError("planner.buckets must list at least one bucket")
        names = [b.name for b in self.buckets]
        if len(set(names)) != len(names):
            raise ValueError(f"planner.buckets names must be unique, got {names}")
        limits = [b.max_tokens for b in self.buckets]
        if limits != sorted(limits) or len(set(limits)) != len(limits):
            raise ValueError(f"planner.buckets must be sorted by strictly increasing max_tokens, got {limits}")
        if sum(b.replicas for b in self.buckets) == 0:
            raise ValueError("planner.buckets need at least one replica in total")
        if self.mode == "online":
            from libra.services.planner.hardware import CONFIG_ROOT

            for kind, name, field in (("hardware", self.cluster.hardware, "hardware"),
                                      ("models", self.cluster.model, "model")):
                if not (CONFIG_ROOT / kind / f"{name}.yaml").is_file():
                    raise ValueError(f"planner.cluster.{field}: no configs/{kind}/{name}.yaml; name one of "
                                     f"{sorted(p.stem for p in (CONFIG_ROOT / kind).glob('*.yaml'))}")
        return self
