"""services/planner/gaps.py: the distribution of a trajectory's time between its turns, measured
(first turns apart), exported as quantiles and drawn from by the simulator; the draws of turns that
come back together correlated as measured (moments)."""

from __future__ import annotations

import random
import statistics

import pytest
from pydantic import ValidationError

from libra.services.planner.cost_rollout import RolloutEfficiency
from libra.services.planner.gaps import (GAP_PROBS, MIN_SAMPLES, GapSampler, GapWindows, Moments, ReplySampler,
                                         quantiles, uniform)
from libra.services.planner.moments import moment_correlation


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


def test_a_moments_draws_share_its_uniform_and_a_later_sample_starts_a_new_one():
    """Correlation 1: every sample at one place within the window of the previous one there takes
    the moment's uniform (the moment lasts while samples keep coming); a sample later than the
    window starts a new moment, another place has its own; correlation 0 or no place: the sample's
    own uniform, the draw every turn had before moments."""
    moments = Moments(0.01)
    wave = [moments.uniform(f"t{i}", 1.0, "w0", 0.004 * i) for i in range(5)]  # 0-16 ms, 4 ms apart
    assert len(set(wave)) == 1 and 0.0 < wave[0] < 1.0
    assert moments.uniform("t5", 1.0, "w0", 0.016 + 0.011) != wave[0]  # 11 ms after the last: a new moment
    assert moments.uniform("t6", 1.0, "w1", 0.0) != wave[0]
    assert moments.uniform("t7", 0.0, "w0", 0.03) == uniform("t7")
    assert moments.uniform("t8", 1.0, None, 0.03) == uniform("t8")
    assert Moments(0.0).uniform("t9", 1.0, "w0", 0.0) == uniform("t9")


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.8, 0.95])
def test_correlated_draws_keep_their_distribution_and_the_calibrations_measure_finds_their_correlation(rho):
    """Samples drawn in moments at correlation rho are still uniform (every marginal stays the
    calibrated distribution), and moment_correlation, what the calibration measures on a run, finds
    rho in them again (a negative or absent correlation measures 0)."""
    moments = Moments(0.01)
    samples = [("w", m + 0.001 * j, moments.uniform(f"m{m}-{j}", rho, "w", m + 0.001 * j))
               for m in range(500) for j in range(5)]  # moments 1 s apart, 5 samples 1 ms apart in each
    us = [u for _, _, u in samples]
    assert statistics.fmean(us) == pytest.approx(0.5, abs=0.03)
    assert sum(u < 0.1 for u in us) / len(us) == pytest.approx(0.1, abs=0.03)
    assert moment_correlation(samples, 0.01) == pytest.approx(rho, abs=0.06)


def test_moment_correlation_pairs_consecutive_samples_of_one_place_within_the_window_only():
    rng = random.Random(4)
    together = [(f"w{m % 2}", m * 0.5 + 0.002 * j, float(m)) for m in range(60) for j in range(3)]
    assert moment_correlation(together, 0.01) == pytest.approx(1.0)  # each moment's values equal
    assert moment_correlation(together, 0.0) is None
    assert moment_correlation(together[:40], 0.01) is None  # fewer than MIN_SAMPLES pairs
    spread = [(p, t, rng.random()) for p, t, _ in together]
    assert moment_correlation(spread, 0.01) < 0.3
    apart = [("w", i * 0.05, float(i // 2)) for i in range(400)]  # pairs 50 ms apart: none within 10 ms
    assert moment_correlation(apart, 0.01) is None
    other_places = [(f"w{i}", 0.0, float(i)) for i in range(400)]  # one sample per place: no pairs
    assert moment_correlation(other_places, 0.01) is None
    assert moment_correlation([("w", i * 0.001, 1.0) for i in range(400)], 0.01) is None  # values do not vary


def test_samplers_draw_in_moments_as_their_efficiency_says_and_a_seed_draws_afresh():
    """GapSampler and ReplySampler take the correlations from the RolloutEfficiency; seed 0 draws as
    every run before seeds did, another seed other draws of the same distribution."""
    factors = quantiles([x / 50 for x in range(101)])
    eff = RolloutEfficiency(request_s=0.03, request_quantiles=factors, turn_gap_s=0.02, first_gap_quantiles=factors,
                            turn_gap_quantiles=factors, moment_s=0.01, first_gap_correlation=1.0,
                            gap_correlation=1.0, reply_correlation=1.0)
    gaps, replies = GapSampler.of(eff), ReplySampler.of(eff)
    firsts = {gaps.draw(f"g{i}", 0, "", 0.0) for i in range(8)}
    later = {gaps.draw(f"g{i}", 1, "w0", 0.5 + 0.001 * i) for i in range(8)}
    back = [replies.factor(f"g{i}", 1, "w0", 0.5 + 0.001 * i) for i in range(8)]
    assert len(firsts) == len(later) == len(set(back)) == 1
    independent = GapSampler.of(eff.model_copy(update={"gap_correlation": 0.0}))
    assert len({independent.draw(f"g{i}", 1, "w0", 0.5) for i in range(8)}) == 8
    plain, seeded = GapSampler(0.0, factors, factors), GapSampler(0.0, factors, factors, seed=3)
    ids = [f"g{g}-s{s}" for g in range(200) for s in range(8)]
    seed0 = GapSampler(0.0, factors, factors, seed=0)
    assert [plain.draw(t, 1) for t in ids[:50]] == [seed0.draw(t, 1) for t in ids[:50]]
    assert sum(plain.draw(t, 1) != seeded.draw(t, 1) for t in ids) > 0.99 * len(ids)
    assert statistics.fmean(seeded.draw(t, 1) for t in ids) == pytest.approx(1.0, abs=0.05)
    assert ReplySampler(factors, seed=3).factor("g0", 1) != ReplySampler(factors).factor("g0", 1)


@pytest.mark.parametrize("field", ["first_gap_correlation", "gap_correlation", "reply_correlation"])
def test_a_correlation_outside_0_to_1_is_refused_naming_the_field(field):
    with pytest.raises(ValidationError, match=field):
        RolloutEfficiency(**{field: 1.5})
    with pytest.raises(ValidationError, match="moment_s"):
        RolloutEfficiency(moment_s=-0.01)
