"""Which turns run late together (services/planner/jitter.py): the calibration reads the shares back
from turns drawn with known ones, finds none in independent turns, and the simulator's draws keep
one turn's calibrated distribution while the turns of one engine's moment move together."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from libra.services.planner import jitter
from libra.services.planner.gaps import GAP_PROBS, Replies, ReplySampler, quantiles


def _turns(engine_share: float, engine_s: float, trajectory_share: float, seed: int = 0, n: int = 3000):
    """Turns of 64 trajectories at a time on two workers, replies ~8 ms apart on each worker,
    a trajectory's next turn ~150 ms after its last on the same worker; the time beyond the
    engine is an exponential read at the copula's uniform."""
    rng = random.Random(seed)
    clock = {"w0": 0.0, "w1": 0.0}
    place: dict[str, int] = {}
    rows = []
    for i in range(n):
        tid = f"t{rng.randrange(64) + 64 * (i // 600)}"
        worker = "w0" if int(tid[1:]) % 2 else "w1"
        clock[worker] += rng.expovariate(1 / 0.008)
        place[tid] = place.get(tid, 0) + 1
        u = jitter.uniform(tid, place[tid], worker, clock[worker], engine_share, engine_s, trajectory_share)
        rows.append((clock[worker], worker, tid, place[tid], -0.05 * math.log(1 - u)))
    return rows


def test_the_shares_are_read_back_from_turns_drawn_with_them():
    found = jitter.shares(_turns(0.5, 0.15, 0.0))
    assert 0.4 <= found["request_engine_share"] <= 0.6, found
    assert 0.08 <= found["request_engine_s"] <= 0.3, found
    assert found["request_trajectory_share"] <= 0.1, found


def test_independent_turns_share_nothing():
    found = jitter.shares(_turns(0.0, 0.15, 0.0, seed=1))
    assert found == {} or found["request_engine_share"] < 0.1, found


def test_turns_without_worker_or_trajectory_say_nothing():
    rows = [(t, "", tid, k, b) for t, _, tid, k, b in _turns(0.5, 0.15, 0.0)]
    assert jitter.shares(rows) == {}


def test_the_sampler_keeps_the_distribution_and_moves_an_engines_moment_together():
    rng = random.Random(2)
    factors = quantiles([rng.expovariate(1.0) for _ in range(2000)])
    assert len(factors) == len(GAP_PROBS)
    alone = ReplySampler(factors)
    together = ReplySampler(factors, engine_share=0.6, engine_s=0.2)
    draws_alone = [alone.factor(f"t{i}", 1, "w0", i * 0.5) for i in range(4000)]
    draws_together = [together.factor(f"t{i}", 1, "w0", i * 0.5) for i in range(4000)]
    assert abs(statistics.fmean(draws_alone) - statistics.fmean(draws_together)) < 0.08
    same_moment = [(together.factor(f"a{i}", 1, "w0", i * 1.0), together.factor(f"b{i}", 1, "w0", i * 1.0 + 0.001))
                   for i in range(1500)]
    other_worker = [(together.factor(f"a{i}", 1, "w0", i * 1.0), together.factor(f"b{i}", 1, "w1", i * 1.0))
                    for i in range(1500)]
    far_apart = [(together.factor(f"a{i}", 1, "w0", i * 1.0), together.factor(f"b{i}", 1, "w0", i * 1.0 + 0.3))
                 for i in range(1500)]
    assert statistics.correlation(*zip(*same_moment)) > 0.35
    assert abs(statistics.correlation(*zip(*other_worker))) < 0.1
    assert abs(statistics.correlation(*zip(*far_apart))) < 0.1
    assert together.factor("t", 3, "w0", 1.25) == together.factor("t", 3, "w0", 1.25)  # deterministic


def test_replies_export_the_shares_and_restore_rows_saved_before_them():
    replies = Replies(4096)
    for at, worker, tid, turn, beyond in _turns(0.5, 0.15, 0.0, n=1024):
        replies.add((0.0, 0.01, 0.0, 0.0), 0.0, 0.01 + beyond, at, worker, tid, turn)
    exported = replies.efficiency((1.0, 1.0, 0.0, 0.0, 0.05))
    assert len(exported["request_quantiles"]) == len(GAP_PROBS)
    assert 0.35 <= exported["request_engine_share"] <= 0.65, exported
    again = Replies(4096)
    again.restore(replies.state())  # (saved to 9 digits)
    restored = again.efficiency((1.0, 1.0, 0.0, 0.0, 0.05))
    assert restored["request_quantiles"] == pytest.approx(exported["request_quantiles"], rel=1e-6)
    assert {k: v for k, v in restored.items() if k != "request_quantiles"} == \
        {k: v for k, v in exported.items() if k != "request_quantiles"}
    old = Replies(4096)
    old.restore([[0.0, 0.01, 0.0, 0.0, 0.0, 0.02 + 0.001 * i] for i in range(100)])  # rows of 6: no worker
    assert "request_engine_share" not in old.efficiency((1.0, 1.0, 0.0, 0.0, 0.05))
