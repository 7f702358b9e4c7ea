"""The prefill a measured turn waited through (services/planner/prefills.py), as the calibration's turn fit
charges it: the prefix its engine holds left out, and the prefills of the turns that joined its engine."""

from __future__ import annotations

import random

import pytest

from libra.services.planner import cost_rollout
from libra.services.planner.calibration import Calibration, CalibrationSettings
from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.cost_train import TrainEfficiency
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.prefills import Prefills

MODEL, GPU = model_named("qwen3-4b"), gpu_named("h200-141g")


def calibration(**settings) -> Calibration:
    return Calibration(MODEL, GPU, RolloutEfficiency(), TrainEfficiency(), CalibrationSettings(**settings))


def test_a_turn_on_its_trajectorys_last_worker_is_charged_the_prefill_of_what_was_added():
    """The engine's prefix cache holds a trajectory's context where its previous turn ran: a later
    turn there prefills only what was added since (the tool's reply), as the simulator charges it;
    on another worker, or as a first turn, the whole context. The turns are built so with a
    prefill 3x slower than the base: fitted on what was prefilled, the slowdown comes back."""
    inst = cost_rollout.instance(MODEL, GPU, 1, RolloutEfficiency())
    cal = calibration(prior_turns=1e-6)
    rng = random.Random(5)
    for i in range(300):
        worker, moved = f"w{i % 4}", rng.random() < 0.3
        prompt, output = rng.choice((200, 2000, 8000)), rng.choice((10, 100, 500))
        first = (prompt, prompt)  # (context, tokens prefilled)
        added = rng.choice((50, 300, 3000))
        later = (prompt + output + added, prompt + output + added if moved else added)
        for number, (context, prefilled) in enumerate((first, later), start=1):
            seconds = (3 * inst.prefill_seconds(prefilled) + output * inst.decode_step_seconds(1, context + output / 2)
                       + 0.01)
            assert cal.observe_turn(1, context, output, seconds, 1, 0.0, number, worker=f"x{i}" if moved and number == 2
                                    else worker, trajectory=f"t{i}") is None
    assert cal.rollout_efficiency().prefill_mfu == pytest.approx(RolloutEfficiency().prefill_mfu / 3, rel=0.02)
    assert len(cal.prefills.prefixes) == 300


def test_a_turn_waits_through_the_prefills_of_the_turns_that_joined_its_engine():
    """An engine's prefill pauses every running row, and the simulator charges it so; a turn's time
    then holds its own prefill and those of the turns that joined while it ran (as many as left:
    the replies that came back from its worker meanwhile). Turns built that way, on an engine 3x
    slower at prefill than the base, give the slowdown back; charged their own prefill alone, the
    same turns make it several times larger, as the fit did on the GPU machine's 16-core runs."""
    from libra.services.planner.turnfit import ForgettingMean

    inst = cost_rollout.instance(MODEL, GPU, 1, RolloutEfficiency())
    rng = random.Random(7)

    def turns():
        mean, ends, end = ForgettingMean(0.0, 2000.0), [], 0.0
        for i in range(600):
            end += rng.uniform(0.002, 0.03)
            prompt, output = rng.choice((2000, 8000, 30000)), rng.choice((5, 40, 200))
            own, base = inst.prefill_seconds(prompt), output * inst.decode_step_seconds(1, prompt + output / 2) + 0.01
            seconds = base + 3 * own
            for _ in range(20):  # the turns that came back while it ran depend on how long it ran
                joined = sum(1 for e in ends if end - seconds < e <= end)
                settled = base + 3 * (own + joined * mean.value())
                if settled == seconds:
                    break
                seconds = settled
            mean.add(own)
            ends.append(end)
            yield prompt, output, seconds, end

    built = list(turns())
    cal, alone = calibration(prior_turns=1e-6), calibration(prior_turns=1e-6)
    for prompt, output, seconds, end in built:
        assert cal.observe_turn(1, prompt, output, seconds, 1, worker="w", end_s=end) is None
        assert alone.observe_turn(1, prompt, output, seconds, 1) is None  # no worker: its own prefill alone
    assert cal.rollout_efficiency().prefill_mfu == pytest.approx(RolloutEfficiency().prefill_mfu / 3, rel=0.03)
    assert alone.rollout_efficiency().prefill_mfu < RolloutEfficiency().prefill_mfu / 4.5
    # the count itself: replies from its worker within the turn, none from before it or elsewhere
    probe = Prefills(2000.0)
    for end in (1.0, 1.1, 1.2):
        probe.joined("w", end, 0.01)
    probe.joined("v", 1.15, 0.01)
    assert probe.joined("w", 1.25, 0.2) == 2.0  # 1.1 and 1.2 came back in (1.05, 1.25]
    assert probe.joined("", 0.0, 0.2) == 0.0  # a record without its worker: its own prefill alone
