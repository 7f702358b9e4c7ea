"""What the replanner is told a batch's rollout took: the rollout's own span (its first trajectory
started to its last finished), never the trainer's wait for the batch, in the trainer's history
record and in the cluster simulator's online controller alike."""

from __future__ import annotations

import pytest

from libra.services.planner.config import ReplanSettings
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import SearchConfig
from libra.services.planner.sim import control
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.traces import synthetic
from libra.v1 import common_pb2


def test_the_trainer_reports_the_batch_rollout_span():
    from libra.services.trainer.batches import PendingGroup
    from libra.services.trainer.loop import rollout_span

    def group(name: str, *spans: tuple[float, float]) -> PendingGroup:
        g = PendingGroup(name, len(spans))
        for index, (start, end) in enumerate(spans):
            g.members[f"{name}{index}"] = (f"e{index}", common_pb2.Trajectory(sample_index=index, started_at=start,
                                                                               finished_at=end))
        return g

    # the batch's rollouts ran from t=100 to t=190, whenever the trainer asked for them
    assert rollout_span([group("a", (100.0, 150.0), (120.0, 190.0)), group("b", (130.0, 160.0))]) == 90.0
    assert rollout_span([group("c", (0.0, 0.0))]) == 0.0  # not stamped: unknown, not a guess


def test_the_simulated_replanner_is_fed_rollout_spans_not_the_trainers_wait():
    model, gpu = model_named("qwen3-4b"), gpu_named("h200-141g")
    config = SearchConfig(total_gpus=16, group_size=4, exact_multiset_limit=64)
    trace = synthetic.drifting(6, 8, 4, seed=2, drift=0.0)
    online = control.Online(model, gpu, config, ReplanSettings(interval_s=0, time_ratio_high=0,
                                                               rejected_fraction_high=0), SimConfig())
    result = Simulator(model, gpu, trace, online, config).run()
    fed = [o.rollout_s for o in online.replanner.window]
    steps = result.steps[:len(fed)]
    assert fed == pytest.approx([s.rollout_s for s in steps])
    assert any(abs(s.rollout_s - s.wait_s) > 1.0 for s in steps)  # the two differ here: the test can tell them apart
