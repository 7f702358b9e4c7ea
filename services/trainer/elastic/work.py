"""Work for hybrids: how many groups a step takes and which replica trains which (pure).

With D core data-parallel ranks and H active hybrids, every replica gets the same share of whole
GRPO groups, s = groups_per_step / D, so the step consumes s × (D + H) groups: the core's batch
widened by the hybrids' share. Advantages are computed over the whole widened batch before it is
split (they are per group, and groups are never split across replicas). Replicas take contiguous
blocks of groups in manifest order: core-0 … core-{D-1}, then the hybrids by replica id — so a
hybrid attached to any core rank gets its own slice, not only hybrids of the first.
"""

from __future__ import annotations

from libra.services.trainer.backend import TrainBatch
from libra.services.trainer.elastic.manifest import StepManifest


def group_share(groups_per_step: int, core_ranks: int) -> int:
    if core_ranks < 1:
        raise ValueError(f"core_ranks must be >= 1, got {core_ranks}")
    if groups_per_step % core_ranks:
        raise ValueError(f"trainer.groups_per_step ({groups_per_step}) must be a multiple of the core "
                         f"data-parallel size ({core_ranks}) so every replica trains the same number of groups")
    return groups_per_step // core_ranks


def widened_groups(groups_per_step: int, manifest: StepManifest) -> int:
    """Groups a step consumes: the core's groups_per_step plus one share per active hybrid."""
    return group_share(groups_per_step, manifest.core_ranks) * manifest.replicas


def split(batch: TrainBatch, group_size: int, manifest: StepManifest) -> dict[str, TrainBatch]:
    """Whole groups per replica, keyed by "core-<rank>" and by hybrid replica id."""
    sequences = batch.sequences
    replicas = manifest.active_ids
    if len(sequences) % (group_size * len(replicas)):
        raise ValueError(f"split: {len(sequences)} sequences are not {len(replicas)} replicas × whole groups "
                         f"of {group_size}")
    per_replica = len(sequences) // len(replicas)
    return {replica: TrainBatch(sequences[i * per_replica : (i + 1) * per_replica])
            for i, replica in enumerate(replicas)}
