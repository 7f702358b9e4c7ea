"""When a turn's time beyond its engine's runs long, and with which other turns.

A turn takes its engine time (the turn fit) plus a time beyond it (the reply's way back, the engine
waiting for a core it shares): `gaps.Replies` measures that time's distribution and the simulator
draws each turn's from it. Independent draws get the spread of one turn right but not its company
(docs/benchmarks.md, "Simulator against reality"): the turns one engine answers at one moment run
late together, that lasts a fraction of a second, and a trajectory's own turns run late together a
little. A group waits for its slowest trajectory, so what runs late together matters.

    calibration: each turn's reply time, worker, trajectory, place and time beyond its engine
        -> `shares`: on the normal scores of the times beyond (so only their order counts, not the
           distribution's tail), the correlation of turns of different trajectories on one worker
           whose replies arrive within `NEAR_S` (`engine_share`), again `FAR_S` apart (with a linear
           decay, how long a moment lasts: `engine_s`), and of a trajectory's consecutive turns
           beyond what their engine's moment explains (`trajectory_share`)
        -> RolloutEfficiency.request_engine_share, request_engine_s, request_trajectory_share
    simulator: `uniform(trajectory, turn, worker, at)`: a Gaussian copula of three normal parts,
        the engine's moment (two grids of `engine_s` cells offset by half a cell, averaged: a
        correlation that falls linearly to 0 over `engine_s`), the trajectory's, the turn's own;
        the draw keeps the calibrated distribution of one turn (`gaps.draw` at that uniform)

Deterministic: every part is a hash of its key (the worker and the simulated time's cell; the
trajectory; the trajectory and turn), like the gaps' draws.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import statistics
from typing import Sequence

NEAR_S = 0.02  # replies this close share the engine's moment
FAR_S = (0.1, 0.2)  # and this far apart show how long it lasts
MIN_PAIRS = 30  # pairs needed for a correlation
MIN_SHARE = 0.05  # an engine's moment shared less than this is noise: independent draws
_NORMAL = statistics.NormalDist()


def scores(values: Sequence[float]) -> list[float]:
    """Normal scores of `values` (ties share their mean rank)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2
        start = end + 1
    n = len(values)
    return [_NORMAL.inv_cdf((r + 0.5) / n) for r in ranks]


def _corr(pairs: list[tuple[float, float]]) -> float | None:
    if len(pairs) < MIN_PAIRS:
        return None
    try:
        return statistics.correlation([a for a, _ in pairs], [b for _, b in pairs])
    except statistics.StatisticsError:
        return None


def shares(turns: Sequence[tuple[float, str, str, int, float]]) -> dict[str, float]:
    """(engine_share, engine_s, trajectory_share) from turns (reply time, worker, trajectory,
    place, time beyond the engine); {} when the turns do not say (no worker or trajectory reported,
    too few pairs, or an engine's moment shared less than MIN_SHARE)."""
    rows = [t for t in turns if t[1] and t[2]]
    if len(rows) < 2 * MIN_PAIRS:
        return {}
    z = scores([t[4] for t in rows])
    by_worker: dict[str, list[tuple[float, str, float]]] = {}
    for t, s in zip(rows, z):
        by_worker.setdefault(t[1], []).append((t[0], t[2], s))
    near, far, lags = [], [], []
    for items in by_worker.values():
        items.sort()
        times = [i[0] for i in items]
        for k, (at, tid, s) in enumerate(items):
            for other in items[k + 1:bisect.bisect_right(times, at + FAR_S[1])]:
                if other[1] == tid:
                    continue
                apart = other[0] - at
                if apart <= NEAR_S:
                    near.append((s, other[2]))
                elif apart >= FAR_S[0]:
                    far.append((s, other[2]))
    near_c, far_c = _corr(near), _corr(far)
    if near_c is None or near_c < MIN_SHARE:
        return {}
    mid = (FAR_S[0] + FAR_S[1]) / 2
    lasting = mid / (1 - far_c / near_c) if far_c is not None and 0 < far_c < near_c else mid
    lasting = max(NEAR_S, min(10.0, lasting))
    own: dict[str, list[tuple[int, float, str, float]]] = {}
    for t, s in zip(rows, z):
        own.setdefault(t[2], []).append((t[3], t[0], t[1], s))
    consecutive = []
    for items in own.values():
        items.sort()
        for a, b in zip(items, items[1:]):
            consecutive.append((a[3], b[3]))
            lags.append(max(0.0, 1 - abs(b[1] - a[1]) / lasting) if a[2] == b[2] else 0.0)
    consec_c = _corr(consecutive)
    explained = near_c * statistics.fmean(lags) if lags else 0.0
    trajectory = max(0.0, min(1 - near_c, (consec_c or 0.0) - explained))
    return {"request_engine_share": round(min(0.95, near_c), 4), "request_engine_s": round(lasting, 4),
            "request_trajectory_share": round(trajectory, 4)}


def _normal(key: str) -> float:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 0.5) / 18446744073709551616.0
    return _NORMAL.inv_cdf(u)


def uniform(trajectory_id: str, turn: int, worker: str, at: float, engine_share: float, engine_s: float,
            trajectory_share: float) -> float:
    """The uniform of a turn's draw: its engine's moment at `at`, its trajectory's and its own part."""
    cell = at / engine_s
    moment = (_normal(f"{worker}@{math.floor(cell)}") + _normal(f"{worker}@{math.floor(cell + 0.5)}+")) / math.sqrt(2)
    own = max(0.0, 1.0 - engine_share - trajectory_share)
    z = (math.sqrt(engine_share) * moment + math.sqrt(trajectory_share) * _normal(f"{trajectory_id}/reply")
         + math.sqrt(own) * _normal(f"{trajectory_id}/{turn}/reply"))
    return min(1 - 1e-12, max(0.0, _NORMAL.cdf(z)))
