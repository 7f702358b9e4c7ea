"""services/planner/gaps.py: the distribution of a trajectory's time between its turns, measured
(first turns apart), exported as quantiles and drawn from by the simulator."""

from __future__ import annotations

import random
import statistics

import pytest
from pydantic import ValidationError

from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.gaps import GAP_PROBS, MIN_SAMPLES, GapSampler, GapWindows, ReplySampler, quantiles


def skewed(n: int, seed: int, scale: float) -> list[float]:
    """Gaps as the gateway measures them: most short, a long tail."""
    rng = random.Random(seed)
    return [scale * rng.lognormvariate(0.0, 1.0) for _ in range(n)]


def test_quantiles_interpolate_between_order_statistics():
    assert quantiles([3.0, 1.0, 2.0], (0.0, 0.25, 0.5, 1.0)) == (1.0, 1.5, 2.0, 3.0)
    assert quantiles([0.2]) == (0.2,) * len(GAP_PROBS)
    with pytest.raises(ValueError, match="no samples"):
        quantiles([])


def test_draws_reproduce_the_measured_distribution_and_are_the_same_whatever_the_order():
    """Many trajectories' draws have the samples' mean and spread (first turns from their own
    quantiles); the draw of (trajectory, turn) is a function of both, so replaying the same turns
    in another order gives each the same gap."""
    first, later = skewed(4000, 1, 0.05), skewed(4000, 2, 0.02)
    sampler = GapSampler(0.03, quantiles(first), quantiles(later))
    ids = [f"s{b}-g{g}-s{s}" for b in range(20) for g in range(20) for s in range(10)]
    firsts = [sampler.draw(t, 0) for t in ids]
    laters = [sampler.draw(t, k) for t in ids for k in (1, 2, 3)]
    for drawn, measured in ((firsts, first), (laters, later)):
        assert statistics.fmean(drawn) == pytest.approx(statistics.fmean(measured), rel=0.05)
        assert statistics.median(drawn) == pytest.approx(statistics.median(measured), rel=0.05)
        assert statistics.pstdev(drawn) == pytest.approx(statistics.pstdev(measured), rel=0.15)
    assert statistics.fmean(firsts) > 2 * statistics.fmean(laters)
    shuffled = ids[:]
    random.Random(3).shuffle(shuffled)
    again = dict(zip(shuffled, (sampler.draw(t, 0) for t in shuffled)))
    assert [again[t] for t in ids] == firsts
    assert sampler.draw("a", 1) != sampler.draw("a", 2)  # each turn its own draw


def test_without_quantiles_every_turn_gets_the_mean_and_without_gaps_there_is_no_sampler():
    assert GapSampler(0.04).draw("t", 0) == GapSampler(0.04).draw("t", 5) == 0.04
    assert GapSampler(0.04, quantiles([1.0, 2.0]), ()).draw("t", 0) == 0.04  # both kinds or neither
    assert GapSampler.of(RolloutEfficiency()) is None
    assert GapSampler.of(RolloutEfficiency(turn_gap_s=0.02)).draw("t", 3) == 0.02


def test_windows_keep_first_and_later_turns_apart_and_export_once_each_has_enough():
    windows = GapWindows(window=100)
    for i in range(MIN_SAMPLES):
        windows.add(0.5, 1)
        windows.add(0.01 * (i % 5), 2 + i % 3)
        windows.add(9.0, 0)  # a turn whose place was not reported: not kept
    assert windows.efficiency() != {}
    fields = windows.efficiency()
    assert set(fields["first_gap_quantiles"]) == {0.5} and max(fields["turn_gap_quantiles"]) == 0.04
    windows = GapWindows(window=100)
    for _ in range(MIN_SAMPLES - 1):
        windows.add(0.5, 1)
        windows.add(0.02, 2)
    assert windows.efficiency() == {}  # too few of each: the configured values stand
    for _ in range(300):  # the window forgets the oldest
        windows.add(0.1, 1)
        windows.add(0.1, 2)
    assert set(windows.efficiency()["first_gap_quantiles"]) == {0.1}
    copy = GapWindows(window=100)
    copy.restore(windows.state())
    assert copy.efficiency() == windows.efficiency()


def test_a_configured_distribution_is_checked_and_the_error_names_the_field():
    ok = tuple(0.01 * i for i in range(len(GAP_PROBS)))
    assert RolloutEfficiency(first_gap_quantiles=ok, turn_gap_quantiles=ok).turn_gap_quantiles == ok
    for bad, words in (((0.1, 0.2), "needs 16 values"), (tuple(reversed(ok)), "non-decreasing"),
                       ((-1.0,) + ok[1:], "non-negative")):
        with pytest.raises(ValidationError, match=f"turn_gap_quantiles[\\s\\S]*{words}"):
            RolloutEfficiency(turn_gap_quantiles=bad)


def test_a_turns_way_back_is_request_s_times_its_own_draw():
    """The reply's factor on request_s is a draw of its own (not the gap's of the same turn), the
    same for the same turn, mean ~1; without quantiles there is no sampler (request_s as it is)."""
    assert ReplySampler.of(RolloutEfficiency(request_s=0.03)) is None
    factors = quantiles([x / 50 for x in range(101)])  # uniform on [0, 2]: mean 1
    sampler = ReplySampler.of(RolloutEfficiency(request_s=0.03, request_quantiles=factors))
    gaps = GapSampler(0.0, factors, factors)
    ids = [f"g{g}-s{s}" for g in range(100) for s in range(8)]
    drawn = [sampler.factor(t, k) for t in ids for k in range(3)]
    assert statistics.fmean(drawn) == pytest.approx(1.0, abs=0.03) and min(drawn) < 0.1 and max(drawn) > 1.9
    assert sampler.factor("g0-s0", 1) == sampler.factor("g0-s0", 1) != gaps.draw("g0-s0", 1)
