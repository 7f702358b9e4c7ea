"""benchmarks/worker_speed_term.py's engine clock (an experiment's term, patched into CostModelInstance in
that script's process only): at a constant speed it is the engine's own clock; at a speed that changes
every period, the completion it predicts is where the clock, advanced to it, finishes the turn; a slower
period finishes it later."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import worker_speed_term  # noqa: E402
from libra.services.planner.calibration import Calibration  # noqa: E402
from libra.services.planner.cost_rollout import RolloutEfficiency  # noqa: E402
from libra.services.planner.hardware import gpu_named, model_named  # noqa: E402
from libra.services.planner.sim.engines import CostModelEngines, CostModelInstance  # noqa: E402
from libra.services.planner.sim.instance import Unit  # noqa: E402
from libra.traces.spec import TrajectorySpec, TurnSpec  # noqa: E402


@pytest.fixture
def engines():
    saved = (CostModelInstance.advance, CostModelInstance.next_completion, Calibration.rollout_efficiency)
    yield CostModelEngines(model_named("qwen2.5-3b"), gpu_named("h200-141g"), (1,),
                           RolloutEfficiency(step_overhead_s=0.004))
    CostModelInstance.advance, CostModelInstance.next_completion, Calibration.rollout_efficiency = saved


def _loaded(engines: CostModelEngines, name: str) -> CostModelInstance:
    instance = engines.instance(name, "all", 1, 1, 0.0)
    for i, output in enumerate((300, 800, 1500)):
        spec = TrajectorySpec(f"t{i}", f"p{i}", 0, 200, (TurnSpec(output),), 1)
        instance.enqueue(Unit(spec, 1, 200.0, 0, float(output), 200.0, seq=i))
    instance.admit()
    return instance


def _play(instance: CostModelInstance) -> list[float]:
    ends = []
    while instance.heap:
        when = instance.next_completion()
        instance.advance(when)
        target = instance.heap[0][0]
        assert instance.progress == pytest.approx(target, rel=1e-9, abs=1e-6)  # the clock got there
        instance.complete()
        ends.append(when)
    return ends


def test_constant_speed_is_the_engines_own_clock(engines):
    plain = _play(_loaded(engines, "w"))
    speeds = worker_speed_term.Speeds(0.05)
    worker_speed_term.patch(speeds)
    assert _play(_loaded(engines, "w")) == pytest.approx(plain, rel=1e-9)


def test_a_varying_speed_is_followed_period_by_period(engines):
    speeds = worker_speed_term.Speeds(0.05)
    speeds.quantiles = (0.5, 0.8, 1.0, 1.3, 1.6, 2.0, 2.2, 2.5, 2.8, 3.0, 3.2, 3.4, 3.6, 3.8, 4.0, 4.5)
    worker_speed_term.patch(speeds)
    varying = _play(_loaded(engines, "w"))
    speeds.quantiles = (4.5,) * 16  # every period at least as slow as the slowest draw
    slowest = _play(_loaded(engines, "w"))
    assert all(v < s for v, s in zip(varying, slowest))
    for t in [i * 0.05 for i in range(200)] + [i * 0.0123 for i in range(200)]:  # boundaries, in floats
        k = speeds.index(t)
        assert k * 0.05 <= t < (k + 1) * 0.05  # a period always ends after t: the clock moves on
