"""What the trainer records about each committed step: reward, advantage, loss and policy
statistics, staleness, and where the step's time went (run record, TensorBoard, W&B, Prometheus).

Tags follow TensorBoard's `section/name` grouping: reward/*, advantage/*, loss/*, policy/*,
staleness/*, time/* (seconds), batch/*; the step is the training step. Entropy is not computed by
the loss (policy/kl is the k3 estimate over the batch's tokens), so it is not logged.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from prometheus_client import Counter as PromCounter, Gauge, Histogram

from libra.telemetry.recorder import probe
from libra.services.trainer.batches import generated_versions
from libra.services.trainer.grpo import staleness
from libra.v1 import trainer_pb2

SERVICE = "trainer"
LOSS = Gauge("libra_trainer_loss", "policy loss of the last step")
KL = Gauge("libra_trainer_kl", "mean k3 KL(policy || behaviour) over the last batch's tokens")
CLIPPED = Gauge("libra_trainer_clipped_tokens_ratio", "fraction of the last batch's tokens whose ratio was clipped")
GRAD_NORM = Gauge("libra_trainer_grad_norm", "gradient norm of the last step, before clipping")
STALENESS = Histogram("libra_trainer_trajectory_staleness_versions",
                      "policy versions between a trained trajectory's oldest token and the trainer",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16))
REJECTED = PromCounter("libra_trainer_rejected_stale_trajectories_total", "trajectories rejected as too stale")
TRAINED = PromCounter("libra_trainer_trained_trajectories_total", "trajectories trained on")
TOKENS = PromCounter("libra_trainer_trained_tokens_total", "tokens of the trajectories trained on")


@dataclass
class BatchSummary:
    """Per-trajectory values of one step's batch (what the step record only averages)."""

    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, groups: Iterable[Any], batch: Any, metrics: dict[str, float], version: int) -> "BatchSummary":
        """From the step's whole groups, its batch (advantages), the backend's metrics and the version trained."""
        trajectories = [t for group in groups for t in group.trajectories()]
        return cls([t.reward for t in trajectories], [s.advantage for s in batch.sequences],
                   [staleness(version, generated_versions(t)) for t in trajectories], dict(metrics))


def _spread(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{prefix}/mean": statistics.fmean(values), f"{prefix}/std": statistics.pstdev(values),
            f"{prefix}/min": min(values), f"{prefix}/max": max(values)}


def step_scalars(record: trainer_pb2.StepRecord, batch: BatchSummary) -> dict[str, float]:
    """The step's tags and values."""
    m = batch.metrics
    scalars = {"reward/mean": record.mean_reward, **_spread("reward", batch.rewards)}
    scalars.update(_spread("advantage", batch.advantages))
    if batch.advantages:
        scalars["advantage/zero_fraction"] = sum(a == 0 for a in batch.advantages) / len(batch.advantages)
    scalars.update({"loss/policy": record.loss, "policy/kl": record.kl, "policy/clip_fraction": record.clip_fraction,
                    "policy/version": record.policy_version})
    scalars.update({f"policy/{name}": m[name] for name in ("ratio_mean", "tis_mean", "grad_norm", "lr") if name in m})
    if record.fresh_sequences:
        scalars["policy/behaviour_logprob_gap"] = record.behaviour_logprob_gap
    scalars.update({"staleness/mean": record.mean_staleness, "staleness/rejected_trajectories": record.rejected_stale})
    if batch.staleness:
        scalars["staleness/max"] = max(batch.staleness)
    scalars.update({"time/wait_s": record.wait_seconds, "time/train_s": record.train_seconds,
                    "time/publish_s": record.publish_seconds, "time/publish_write_s": record.publish_write_seconds,
                    "time/publish_send_s": record.publish_send_seconds,
                    "time/publish_rpc_s": record.publish_rpc_seconds,
                    "time/step_s": record.wait_seconds + record.train_seconds + record.publish_seconds})
    scalars.update({"batch/trajectories": record.trajectories, "batch/tokens": record.tokens,
                    "batch/mean_turns": record.mean_turns, "batch/workers_updated": record.workers_updated})
    return scalars


class TrainerProbe:
    def __init__(self, recorder, config) -> None:
        self.recorder = recorder

    def step(self, record: trainer_pb2.StepRecord, batch: BatchSummary | None) -> None:
        batch = batch or BatchSummary()
        scalars = step_scalars(record, batch)
        self.recorder.write(
            "step", step=record.step, t=record.timestamp or None, scalars=scalars,
            histograms={"reward": batch.rewards, "advantage": batch.advantages,
                        "staleness": [float(s) for s in batch.staleness]},
            policy_version=record.policy_version,
            staleness_counts={str(lag): count for lag, count in sorted(Counter(batch.staleness).items())})
        LOSS.set(record.loss)
        KL.set(record.kl)
        CLIPPED.set(record.clip_fraction)
        if "grad_norm" in batch.metrics:
            GRAD_NORM.set(batch.metrics["grad_norm"])
        for lag in batch.staleness:
            STALENESS.observe(lag)
        REJECTED.inc(record.rejected_stale)
        TRAINED.inc(record.trajectories)
        TOKENS.inc(record.tokens)


def record_step(config, record: trainer_pb2.StepRecord, batch: BatchSummary | None) -> None:
    """The trainer loop's hook after a committed step."""
    probe(config, SERVICE, TrainerProbe).step(record, batch)
