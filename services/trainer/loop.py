"""The asynchronous GRPO loop: keep rollout fed, train on whole groups, publish, checkpoint.

```
            SubmitPrompts (≤ groups_per_step × (max_staleness+1) groups in flight)
 trainer ─────────────────────────────────────────────────────────────▶ rollout
    ▲  read_completed (consumer group)                                      │ complete_trajectory
    └──────────────── Redis completed stream ◀──────────────────────────────┘
    │ whole groups, staleness-checked ─▶ train_step ─▶ publish v+1 (publisher.py: disk or the
    │                                                    weights group, UpdateWeights, no drain)
    └ every checkpoint_every steps: checkpoint, then ack the entries those steps used
```
Rollout never stops for training: while a step trains, the next batch is already being sampled.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from prometheus_client import Gauge, Histogram

from libra import log as liblog
from libra.config import RunConfig
from libra.services.trainer.backend import TrainBatch
from libra.services.trainer.batches import (BatchAssembler, PendingGroup, build_batch, fresh_positions,
                                          logprob_gap, spread, to_sequence)
from libra.services.trainer.model_state import ModelState, Position
from libra.services.trainer.peers import patient
from libra.services.trainer.publisher import WeightPublisher
from libra.services.trainer.status import TrainerStatus
from libra.services.trainer import telemetry
from libra.v1 import common_pb2, rollout_pb2, trainer_pb2

_log = liblog.get("libra.trainer")
CONSUMER = "trainer-0"
STEP = Gauge("libra_trainer_step", "last committed training step")
VERSION = Gauge("libra_trainer_policy_version", "policy version of the trainer's weights")
REWARD = Gauge("libra_trainer_mean_reward", "mean reward of the last batch")
GAP = Gauge("libra_trainer_behaviour_logprob_gap", "mean |trainer - rollout| log-prob on fresh tokens")
STEP_SECONDS = Histogram("libra_trainer_step_seconds", "phases of a step", ["phase"],
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))


def prompt_for(position: int, num_prompts: int, seed: int) -> int:
    """Deterministic shuffled order of prompt ids over the data positions."""
    epoch, index = divmod(position, num_prompts)
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    offset = int.from_bytes(digest, "little") % num_prompts
    stride = next(s for s in (7919, 104729, 1299709, 1) if num_prompts % s != 0 or s == 1)
    return (offset + index * stride) % num_prompts


def rollout_span(groups: list[PendingGroup]) -> float:
    """The batch's rollout span: its first trajectory started to its last finished (0: not stamped)."""
    stamped = [t for g in groups for t in g.trajectories() if t.started_at and t.finished_at]
    if not stamped:
        return 0.0
    return max(0.0, max(t.finished_at for t in stamped) - min(t.started_at for t in stamped))


class GrpoLoop:
    def __init__(self, config: RunConfig, store, rollout, model: ModelState, status: TrainerStatus,
                 num_prompts: int, publisher: WeightPublisher):
        self.config, self.cfg = config, config.trainer
        self.store, self.rollout, self.model, self.status = store, rollout, model, status
        self.publisher = publisher
        self.num_prompts = num_prompts
        self.assembler = BatchAssembler(self.cfg.max_staleness)
        self.position = Position()
        self.rejected_since_step = 0
        self.elastic = None  # ElasticControl when hybrid replicas may join (set by the service)

    # -- feeding rollout -------------------------------------------------------------------------
    async def submit(self) -> None:
        """Submit groups up to the staleness budget (AReaL-style capacity bound).

        Groups submitted while the trainer is at step s are trained at step s + max_staleness at
        the latest, so at most (max_staleness + s + 1) batches may ever have been submitted
        (plus replacements of discarded groups).
        """
        cfg, position = self.cfg, self.position
        budget = (cfg.max_staleness + position.step + 1) * cfg.groups_per_step + position.discarded_groups
        budget += self.elastic.hybrid_groups if self.elastic is not None else 0  # hybrids' widened share
        missing = budget - position.data_position
        if missing <= 0:
            return
        start = self.position.data_position
        groups = [rollout_pb2.PromptGroup(
            group_id=f"g{p}", prompt_id=str(prompt_for(p, self.num_prompts, self.config.seed)),
            samples=self.cfg.group_size, min_version=self.position.version) for p in range(start, start + missing)]
        meta = common_pb2.RequestMeta(request_id=f"submit-{start}-{missing}", run_id=self.config.run_id)
        request = rollout_pb2.SubmitPromptsRequest(meta=meta, groups=groups)
        await patient(lambda: self.rollout.SubmitPrompts(request, timeout=60), "SubmitPrompts")
        self.position.data_position += missing

    # -- collecting a batch ----------------------------------------------------------------------
    async def collect(self, count: int | None = None) -> list[PendingGroup]:
        """Block until `count` (default groups_per_step) fresh whole groups are in; drop stale or failed ones."""
        count = count or self.cfg.groups_per_step
        admitted: list[PendingGroup] = []
        while len(admitted) < count:
            await self.submit()
            entries = await self.store.read_completed(CONSUMER, count=256, block_ms=1000)
            if entries:
                trajs = await self.store.get_trajectories([e.trajectory_id for e in entries])
                for entry, traj in zip(entries, trajs):
                    self.assembler.add(entry.entry_id, traj, self.cfg.group_size)
            verdicts = self.assembler.take_ready(self.position.version, count - len(admitted))
            admitted.extend(verdicts.admitted)
            await self._discard(verdicts.rejected, common_pb2.TRAJECTORY_STATUS_REJECTED)
            await self._discard(verdicts.failed, common_pb2.TRAJECTORY_STATUS_FAILED)
            self.rejected_since_step += sum(len(g.members) for g in verdicts.rejected)
            self.position.discarded_groups += len(verdicts.rejected) + len(verdicts.failed)
        return admitted

    async def _discard(self, groups: list[PendingGroup], status: int) -> None:
        """Rejected groups are marked at once; their entries are acked with the next checkpoint, as
        the ones a step used, so a restarted trainer judges them again and counts them again
        (`discarded_groups` feeds the submit budget: a count lost at a crash would starve it)."""
        if not groups:
            return
        ids = [t.trajectory_id for g in groups for t in g.trajectories()]
        if status == common_pb2.TRAJECTORY_STATUS_REJECTED:
            await self.store.mark_trajectories(ids, status)
        self.position.used_entries.extend(e for g in groups for e in g.entries())
        _log.info("groups discarded", status=common_pb2.TrajectoryStatus.Name(status), groups=len(groups))

    # -- one step --------------------------------------------------------------------------------
    async def step(self) -> trainer_pb2.StepRecord:
        manifest, count = None, self.cfg.groups_per_step
        if self.elastic is not None:  # membership frozen for this step; hybrids widen the batch
            manifest = await self.elastic.begin_step(self.position.step + 1)
            count = self.elastic.widen(manifest, self.cfg.groups_per_step)
        waited = time.monotonic()
        groups = await self.collect(count)
        wait_s = time.monotonic() - waited
        await self.publisher.settle()  # the last version's background disk write: before the backend is used
        batch, stats = build_batch(groups, self.position.version)
        gap, fresh = await self.behaviour_gap(groups)
        core_batch = self.elastic.hand_out(batch, self.cfg.group_size, manifest) if manifest else batch
        started = time.monotonic()
        metrics = await asyncio.to_thread(self.model.backend.train_step, core_batch, self.cfg)
        train_s = time.monotonic() - started
        self.batch_summary = telemetry.BatchSummary.of(groups, batch, metrics, self.position.version)
        if self.elastic is not None:
            self.elastic.end_step()
        self.position.step += 1
        published = await self.publisher.publish(self.position.version + 1)
        self.position.version = published.version
        self.position.used_entries.extend(e for g in groups for e in g.entries())
        self.step_lengths = [(t.prompt_length, len(t.token_ids) - t.prompt_length)  # for the planner's history
                             for g in groups for t in g.trajectories()]
        self.step_rollout_s = rollout_span(groups)  # for the planner's history: what rollout took, not our wait
        record = trainer_pb2.StepRecord(
            step=self.position.step, policy_version=self.position.version, mean_reward=stats.mean_reward,
            loss=metrics.get("loss", 0.0), trajectories=len(batch), rejected_stale=self.rejected_since_step,
            mean_staleness=stats.mean_staleness, train_seconds=train_s, wait_seconds=wait_s,
            publish_seconds=published.seconds, publish_write_seconds=published.write_seconds,
            publish_send_seconds=published.send_seconds, publish_rpc_seconds=published.rpc_seconds,
            workers_updated=published.workers_updated, mean_turns=stats.mean_turns, tokens=stats.tokens,
            phase=trainer_pb2.TRAINER_PHASE_TRAINING, timestamp=time.time(),
            clip_fraction=metrics.get("clip_fraction", 0.0), kl=metrics.get("kl", 0.0),
            behaviour_logprob_gap=gap, fresh_sequences=fresh)
        self.rejected_since_step = 0
        return record

    async def behaviour_gap(self, groups: list[PendingGroup]) -> tuple[float, int]:
        """Mean |trainer − rollout| log-prob over the tokens the current weights sampled ("fresh"
        tokens, batches.fresh_positions) in up to `logprob_check_sequences` sequences holding any,
        spread over the batch; and how many sequences it checked.

        Per-token versions are exact and no KV crosses versions, so this is float rounding (~1e-7 in
        fp32); a broken weight sync or KV reused across versions shows as orders more, in any fresh
        sequence: a few checked find it as surely as all, for a forward pass of a few sequences
        instead of most of the batch.
        """
        version, limit = self.position.version, self.cfg.logprob_check_sequences
        fresh = spread([t for g in groups for t in g.trajectories() if fresh_positions(t, version)], limit)
        if not fresh:
            return 0.0, 0
        batch = TrainBatch([to_sequence(t, 0.0) for t in fresh])
        ours = await asyncio.to_thread(self.model.backend.compute_logprobs, batch)
        gap, _ = logprob_gap(fresh, [logprobs.tolist() for logprobs in ours], version)
        return gap, len(fresh)

    async def checkpoint(self):
        """Checkpoint the position (after the last version's background disk write: one backend call at a time)."""
        await self.publisher.settle()
        return await self.model.checkpoint(self.position)

    async def run_one(self) -> trainer_pb2.StepRecord:
        """One committed step: train, publish, record, checkpoint when due."""
        record = await self.step()
        await self.store.save_step_record(record.step, record.SerializeToString())
        lengths = getattr(self, "step_lengths", [])
        now, previous = time.monotonic(), getattr(self, "recorded_at", None)
        self.recorded_at = now  # the planner's history: what a step costs beyond its three timers
        overhead = 0.0 if previous is None else max(
            0.0, now - previous - record.wait_seconds - record.train_seconds - record.publish_seconds)
        await self.store.append_history("step", common_pb2.HistoryRecord(
            kind="step", timestamp=record.timestamp, step=record.step, output_tokens=record.tokens,
            seconds=record.wait_seconds + record.train_seconds + record.publish_seconds,
            train_seconds=record.train_seconds, rollout_seconds=getattr(self, "step_rollout_s", 0.0),
            rejected_rollouts=record.rejected_stale, sequences=record.trajectories,
            prompt_lengths=[p for p, _ in lengths], output_lengths=[o for _, o in lengths],
            overhead_seconds=overhead))
        if record.step % self.cfg.checkpoint_every == 0 or record.step == self.cfg.steps:
            await self.checkpoint()
        await self.status.add_record(record)
        telemetry.record_step(self.config, record, getattr(self, "batch_summary", None))
        STEP.set(record.step)
        VERSION.set(record.policy_version)
        REWARD.set(record.mean_reward)
        if record.fresh_sequences:
            GAP.set(record.behaviour_logprob_gap)
        for phase in ("wait", "train", "publish"):
            STEP_SECONDS.labels(phase).observe(getattr(record, f"{phase}_seconds"))
        _log.info("step", step=record.step, reward=round(record.mean_reward, 4), version=record.policy_version,
                  wait_s=round(record.wait_seconds, 2), train_s=round(record.train_seconds, 2),
                  publish_s=round(record.publish_seconds, 3), write_s=round(record.publish_write_seconds, 3),
                  send_s=round(record.publish_send_seconds, 3), rpc_s=round(record.publish_rpc_seconds, 3))
        return record
