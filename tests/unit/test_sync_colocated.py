"""configs/sync-colocated.yaml is the quickstart made synchronous and nothing else, and the trainer
runs it synchronously: with max_staleness 0 it keeps exactly one batch submitted, the next one only
after a step has committed, each group marked with the version that will train on it."""

from __future__ import annotations

import pathlib

from libra.config import load_run_config
from libra.services.trainer.loop import GrpoLoop
from libra.services.trainer.model_state import Position, warm_model_recipe
from libra.workloads.base import build_workload

ROOT = pathlib.Path(__file__).resolve().parents[2]
DIFFERENT = {"run_id", "run_dir"}


def _configs():
    return (load_run_config(ROOT / "configs" / "quickstart.yaml", env={}),
            load_run_config(ROOT / "configs" / "sync-colocated.yaml", env={}))


def test_the_sync_config_is_the_quickstart_with_staleness_zero():
    quick, sync = _configs()
    assert (quick.trainer.max_staleness, sync.trainer.max_staleness) == (1, 0)
    assert sync.rollout.max_concurrent_trajectories == sync.trainer.groups_per_step * sync.trainer.group_size
    a, b = quick.model_dump(mode="json"), sync.model_dump(mode="json")
    for tree in (a, b):
        for key in DIFFERENT:
            tree.pop(key)
        tree["trainer"].pop("max_staleness")
    assert a == b  # same model, workload, batch, learning rate, sampling, engines and threads


def test_both_start_from_one_cached_warm_start():
    quick, sync = _configs()
    workload = build_workload(quick.workload)
    assert warm_model_recipe(quick, workload) == warm_model_recipe(sync, workload)


class _Rollout:
    def __init__(self):
        self.groups = []

    async def SubmitPrompts(self, request, timeout=None):  # noqa: N802 - the gRPC stub's name
        self.groups.extend(request.groups)


def test_with_staleness_zero_one_batch_is_in_flight(arun):
    _, sync = _configs()
    rollout = _Rollout()
    loop = GrpoLoop(sync, None, rollout, None, None, num_prompts=2000, publisher=None)
    loop.position = Position(step=0, version=1)
    arun(loop.submit())
    arun(loop.submit())  # nothing more until the step commits
    per_step = sync.trainer.groups_per_step
    assert len(rollout.groups) == per_step and {g.min_version for g in rollout.groups} == {1}
    loop.position.step, loop.position.version = 1, 2  # step 1 committed, v2 served
    arun(loop.submit())
    assert len(rollout.groups) == 2 * per_step and {g.min_version for g in rollout.groups[per_step:]} == {2}
    quick, _ = _configs()
    ahead = GrpoLoop(quick, None, _Rollout(), None, None, num_prompts=2000, publisher=None)
    ahead.position = Position(step=0, version=1)
    arun(ahead.submit())
    assert len(ahead.rollout.groups) == 2 * per_step  # the quickstart keeps a second batch going
