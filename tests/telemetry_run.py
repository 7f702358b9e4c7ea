"""A run record made the way a run makes it, on a clock the test drives: the services' own probes
fed with what the services would hand them (real protos, a real C-MLFQ policy routing turns, real
GRPO batches and a real planner calibration), over a simulated three minutes.

Used by the report's unit tests and its browser test; the quickstart's real record is exercised
by tests/integration/test_end_to_end.py.
"""

from __future__ import annotations

import pathlib
import random
from dataclasses import dataclass

from libra.config import RunConfig, build_run_config
from libra.routing.policy import Turn, Worker
from libra.telemetry.recorder import Recorder
from libra.v1 import common_pb2, planner_pb2, rollout_pb2, trainer_pb2

BUCKETS = [{"name": "short", "tp": 1, "max_tokens": 10, "replicas": 1},
           {"name": "long", "tp": 1, "max_tokens": 512, "replicas": 1}]
STARTED = 1_700_000_000.0


@dataclass
class Clock:
    t: float = STARTED

    def __call__(self) -> float:
        return self.t


def run_config(run_dir: pathlib.Path, **telemetry) -> RunConfig:
    return build_run_config({"run_id": "probe-run", "run_dir": str(run_dir), "planner": {"buckets": BUCKETS},
                             "scheduler": {"policy": "cmlfq"}, "telemetry": {"sample_s": 5, **telemetry}}, env={})


def _groups(step: int, version: int, rng: random.Random):
    from libra.services.trainer.batches import BatchAssembler

    assembler = BatchAssembler(max_staleness=1)
    for g in range(4):
        for i in range(4):
            born = version - rng.choice((0, 0, 1))
            assembler.add(f"e{step}-{g}-{i}", common_pb2.Trajectory(
                trajectory_id=f"g{step}-{g}-s{i}", group_id=f"g{step}-{g}", sample_index=i,
                status=common_pb2.TRAJECTORY_STATUS_COMPLETED, prompt_length=2, token_ids=[1, 2, 3, 4],
                loss_mask=[1, 1], logprobs=[-1.0, -1.0], versions=[born, born],
                reward=float(rng.random() < 0.3 + step / 60), turns=2), samples=4)
    return assembler.take_ready(version, limit=4).admitted


def write_run(run_dir: pathlib.Path, steps: int = 30, seed: int = 0, **telemetry) -> RunConfig:
    """Three simulated minutes of a run: the planner's decisions and ticks, the trainer's steps,
    rollout samples with two workers catching up on versions, the scheduler routing with moves."""
    from libra.services.planner.calibration import Calibration
    from libra.services.planner.cost_rollout import RolloutEfficiency
    from libra.services.planner.cost_train import TrainEfficiency
    from libra.services.planner.hardware import gpu_named, model_named
    from libra.services.planner.telemetry import PlannerProbe
    from libra.services.rollout.telemetry import RolloutProbe
    from libra.services.rollout.workers import PoolWorker
    from libra.services.scheduler.server import SchedulerService
    from libra.services.scheduler.telemetry import SchedulerProbe
    from libra.services.trainer.batches import build_batch
    from libra.services.trainer.telemetry import BatchSummary, TrainerProbe

    config, clock, rng = run_config(run_dir, **telemetry), Clock(), random.Random(seed)
    open_recorder = lambda service: Recorder(config.run_path, service, config.run_id, config.telemetry,  # noqa: E731
                                             clock=clock)
    recorders = {s: open_recorder(s) for s in ("planner", "trainer", "rollout", "scheduler")}
    planner = PlannerProbe(recorders["planner"], config)
    trainer = TrainerProbe(recorders["trainer"], config)
    rollout = RolloutProbe(recorders["rollout"], config, clock=clock)
    scheduler = SchedulerProbe(recorders["scheduler"], config, clock=clock)
    calibration = Calibration(model_named("qwen3-4b"), gpu_named("h200-141g"), RolloutEfficiency(), TrainEfficiency())
    service = SchedulerService(config)
    for worker_id, bucket in (("short-0", "short"), ("long-0", "long")):
        service.policy.register(Worker(worker_id, bucket, f"http://{worker_id}"))
    workers = [PoolWorker("short-0", "short", 1, None, None, version=1), PoolWorker("long-0", "long", 1, None, None,
                                                                                    version=1)]
    plan = common_pb2.Plan(generation=1, buckets=[common_pb2.BucketSpec(**b) for b in BUCKETS])
    planner.decision(planner_pb2.PlanDecision(timestamp=clock.t, chosen=plan, applied=True, reason="configured",
                                              trigger="config"))
    stats, version, trajectory = rollout_pb2.RolloutStats(), 1, 0
    for step in range(1, steps + 1):
        for _ in range(6):  # two seconds of rollout: turns routed by C-MLFQ, finished, sampled
            clock.t += 1.0
            for _ in range(8):
                trajectory += 1
                tid, output = f"t{trajectory}", rng.choice((4, 8, 30))
                for turn in range(2):
                    decision = service.policy.route(Turn(tid, f"p{trajectory}", turn, 10, 48))
                    scheduler.routed(Turn(tid, f"p{trajectory}", turn, 10, 48), decision, service.stats)
                    service.policy.turn_done(tid, decision.worker_id, output)
                    service.policy.tool_returned(tid, "calc", "success", 3)
                    rollout.turn(decision.bucket, 0.05 + rng.random() * (0.4 if decision.bucket == "long" else 0.1))
                service.policy.finish(tid, f"p{trajectory}", 2 * output)
            stats.completed, stats.turns = stats.completed + 8, stats.turns + 16
            stats.generated_tokens += 8 * 30
            rollout.sample(stats, workers)
        version += 1
        groups = _groups(step, version - 1, rng)
        batch, batch_stats = build_batch(groups, version - 1)
        summary = BatchSummary.of(groups, batch, {"loss": 0.1, "grad_norm": 0.8, "lr": 2e-4}, version - 1)
        trainer.step(trainer_pb2.StepRecord(
            step=step, policy_version=version, mean_reward=batch_stats.mean_reward, loss=0.1 - step / 1000,
            trajectories=len(batch), mean_staleness=batch_stats.mean_staleness, wait_seconds=3.0 + rng.random(),
            train_seconds=1.5, publish_seconds=0.4, tokens=batch_stats.tokens, timestamp=clock.t,
            rejected_stale=rng.choice((0, 0, 4)), kl=0.01, clip_fraction=0.02), summary)
        for worker in workers:  # the short worker catches up at once, the long one a step later
            worker.version = version if worker.bucket == "short" else version - 1
        calibration.steps.add(6.0, 6.0 + rng.random())
        planner.tick(calibration.snapshot())
        if step == steps // 2:
            planner.decision(planner_pb2.PlanDecision(
                timestamp=clock.t, chosen=plan, applied=False, trigger="interval",
                reason="no candidate beats the plan in force by more than the transition cost"))
    for recorder in recorders.values():
        recorder.close()
    return config
