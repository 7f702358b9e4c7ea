"""Assembling GRPO batches from completed trajectories (pure: no Redis, no clock).

Completed-stream entries arrive one trajectory at a time, in any order. A group becomes ready
when all its samples are in; a ready group is admitted whole if every sample is within the
staleness bound, rejected whole otherwise, and dropped whole if any sample failed (an
infrastructure failure says nothing about the policy). Each entry is remembered so it can be
acknowledged once the step that used it is committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libra.services.trainer.backend import TrainBatch, TrainSequence
from libra.services.trainer.grpo import group_advantages, staleness
from libra.v1 import common_pb2


@dataclass
class PendingGroup:
    group_id: str
    samples: int
    members: dict[str, tuple[str, common_pb2.Trajectory]] = field(default_factory=dict)  # tid -> (entry, traj)

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.samples

    def entries(self) -> list[str]:
        return [entry for entry, _ in self.members.values()]

    def trajectories(self) -> list[common_pb2.Trajectory]:
        return [traj for _, traj in sorted(self.members.values(), key=lambda m: m[1].sample_index)]


@dataclass
class Verdicts:
    admitted: list[PendingGroup] = field(default_factory=list)
    rejected: list[PendingGroup] = field(default_factory=list)
    failed: list[PendingGroup] = field(default_factory=list)


def generated_versions(traj: common_pb2.Trajectory) -> list[int]:
    """Policy versions of the tokens the model generated (tool tokens carry no policy)."""
    return [v for v, m in zip(traj.versions, traj.loss_mask) if m] or list(traj.versions)


def fresh_positions(traj: common_pb2.Trajectory, version: int) -> list[int]:
    """Response positions of the generated tokens that `version` sampled (its "fresh" tokens).

    A token's recorded version is exact and its KV was computed by that version alone (the engines
    recompute in-flight KV at a swap and never reuse another version's prefix cache), so the trainer
    holding `version` computes a fresh token's behaviour log-prob exactly, whatever the sequence's
    other tokens came from.
    """
    return [i for i, (v, m) in enumerate(zip(traj.versions, traj.loss_mask)) if m and v == version]


def spread(items: list, limit: int) -> list:
    """At most `limit` of `items`, evenly spaced over them, in order (all of them when they fit)."""
    if len(items) <= limit:
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


def logprob_gap(trajectories: list[common_pb2.Trajectory], trainer_logprobs: list[list[float]],
                version: int) -> tuple[float, int]:
    """(mean |trainer − behaviour| log-prob over the tokens `version` sampled, how many tokens):
    `trainer_logprobs[i]` is the trainer's log-prob of every response token of `trajectories[i]`,
    computed with `version`'s weights."""
    total, count = 0.0, 0
    for traj, ours in zip(trajectories, trainer_logprobs, strict=True):
        for i in fresh_positions(traj, version):
            total, count = total + abs(ours[i] - traj.logprobs[i]), count + 1
    return (total / count if count else 0.0), count


class BatchAssembler:
    """Collects stream entries into whole groups and judges them against the staleness bound."""

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self.groups: dict[str, PendingGroup] = {}

    def add(self, entry_id: str, traj: common_pb2.Trajectory, samples: int) -> None:
        group = self.groups.setdefault(traj.group_id, PendingGroup(traj.group_id, samples))
        group.members.setdefault(traj.trajectory_id, (entry_id, traj))

    def take_ready(self, current_version: int, limit: int) -> Verdicts:
        """Remove and judge up to `limit` admitted groups (and every rejected/failed ready group)."""
        verdicts = Verdicts()
        for group_id in [g for g, group in self.groups.items() if group.complete]:
            group = self.groups[group_id]
            trajs = group.trajectories()
            if any(t.status != common_pb2.TRAJECTORY_STATUS_COMPLETED or not t.versions for t in trajs):
                verdicts.failed.append(self.groups.pop(group_id))
            elif max(staleness(current_version, generated_versions(t)) for t in trajs) > self.max_staleness:
                verdicts.rejected.append(self.groups.pop(group_id))
            elif len(verdicts.admitted) < limit:
                verdicts.admitted.append(self.groups.pop(group_id))
        return verdicts


def to_sequence(traj: common_pb2.Trajectory, advantage: float) -> TrainSequence:
    """The training view of a trajectory: its token ids, masks and behaviour log-probs."""
    return TrainSequence(token_ids=list(traj.token_ids), prompt_length=traj.prompt_length,
                         loss_mask=list(traj.loss_mask), behaviour_logprobs=list(traj.logprobs),
                         advantage=float(advantage))


@dataclass(frozen=True)
class BatchStats:
    mean_reward: float
    mean_turns: float
    mean_staleness: float
    tokens: int


def build_batch(groups: list[PendingGroup], current_version: int) -> tuple[TrainBatch, BatchStats]:
    """GRPO batch of whole groups: group-normalised advantages on every sample."""
    trajs = [t for group in groups for t in group.trajectories()]
    advantages = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs]).tolist()
    sequences = [to_sequence(t, a) for t, a in zip(trajs, advantages)]
    stats = BatchStats(
        mean_reward=sum(t.reward for t in trajs) / len(trajs),
        mean_turns=sum(t.turns for t in trajs) / len(trajs),
        mean_staleness=sum(staleness(current_version, generated_versions(t)) for t in trajs) / len(trajs),
        tokens=sum(len(t.token_ids) for t in trajs))
    return TrainBatch(sequences=sequences), stats
