"""Whole-group batch assembly, staleness admission and advantages."""

from __future__ import annotations

import pytest

from libra.services.trainer.batches import (BatchAssembler, build_batch, fresh_positions, generated_versions,
                                          logprob_gap, spread)
from libra.v1 import common_pb2 as pb


def traj(group: str, index: int, reward: float, version: int = 3, status=pb.TRAJECTORY_STATUS_COMPLETED):
    return pb.Trajectory(trajectory_id=f"{group}-s{index}", group_id=group, sample_index=index, status=status,
                         prompt_length=2, token_ids=[1, 2, 3, 4, 5], loss_mask=[1, 0, 1], logprobs=[-1.0, 0.0, -1.0],
                         versions=[version, 0, version], reward=reward, turns=2)


def test_groups_wait_for_all_samples_then_get_advantages():
    assembler = BatchAssembler(max_staleness=1)
    assembler.add("e1", traj("g", 0, 1.0), samples=2)
    assert assembler.take_ready(3, limit=5).admitted == []
    assembler.add("e2", traj("g", 1, 0.0), samples=2)
    admitted = assembler.take_ready(3, limit=5).admitted
    assert [g.group_id for g in admitted] == ["g"] and sorted(admitted[0].entries()) == ["e1", "e2"]
    batch, stats = build_batch(admitted, current_version=3)
    assert [s.advantage for s in batch.sequences] == pytest.approx([1.0, -1.0], abs=1e-4)
    assert stats.mean_reward == 0.5 and stats.mean_staleness == 0


def test_stale_groups_are_rejected_whole_and_tool_tokens_do_not_count():
    assembler = BatchAssembler(max_staleness=1)
    assembler.add("e1", traj("old", 0, 1.0, version=1), samples=2)
    assembler.add("e2", traj("old", 1, 1.0, version=3), samples=2)
    verdicts = assembler.take_ready(3, limit=5)
    assert [g.group_id for g in verdicts.rejected] == ["old"] and not verdicts.admitted


def test_failed_samples_drop_the_group_and_limit_is_kept():
    assembler = BatchAssembler(max_staleness=0)
    assembler.add("e1", traj("bad", 0, 0.0, status=pb.TRAJECTORY_STATUS_FAILED), samples=1)
    for name in ("a", "b"):
        assembler.add(f"e-{name}", traj(name, 0, 1.0), samples=1)
    verdicts = assembler.take_ready(3, limit=1)
    assert [g.group_id for g in verdicts.failed] == ["bad"]
    assert len(verdicts.admitted) == 1 and len(assembler.groups) == 1


def test_fresh_tokens_are_the_generated_ones_the_current_version_sampled():
    """A turn split by a swap (v3 then v4, a tool token between): at v4 only the v4 ids are fresh, and
    the gap is taken over them alone; the sequence's staleness still counts from its oldest id (v3)."""
    mixed = pb.Trajectory(trajectory_id="m-s0", group_id="m", prompt_length=2, token_ids=[1, 2, 3, 4, 5, 6, 7],
                          loss_mask=[1, 1, 0, 1, 1], logprobs=[-1.0, -2.0, 0.0, -3.0, -4.0], versions=[3, 4, 4, 4, 4],
                          status=pb.TRAJECTORY_STATUS_COMPLETED, reward=1.0)
    assert fresh_positions(mixed, 4) == [1, 3, 4] and fresh_positions(mixed, 3) == [0]
    assert fresh_positions(mixed, 5) == []
    trainer = [-1.5, -2.0 + 3e-7, 9.0, -3.0, -4.0 - 1e-7]  # the tool position (9.0) and the v3 id are not counted
    gap, tokens = logprob_gap([mixed], [trainer], version=4)
    assert tokens == 3 and gap == pytest.approx(4e-7 / 3, abs=1e-12)
    assert generated_versions(mixed) == [3, 4, 4, 4] and build_batch(
        [_group_of(mixed)], current_version=4)[1].mean_staleness == 1


def _group_of(trajectory):
    from libra.services.trainer.batches import PendingGroup

    group = PendingGroup(trajectory.group_id, 1)
    group.members[trajectory.trajectory_id] = ("e", trajectory)
    return group


def test_the_logprob_check_spreads_its_sequences_over_the_batch():
    batch = list(range(64))
    assert spread(batch, 8) == [0, 8, 16, 24, 32, 40, 48, 56]  # one per group of 8, in order
    assert spread(batch, 64) == batch and spread(batch, 100) == batch
    assert spread(batch[:5], 3) == [0, 1, 3]
    assert spread(batch, 0) == [] and spread([], 8) == []
