"""What the calibration measures of moments (gaps.py's `Moments` draws them): how the gaps and the
times beyond the engine of turns that go together correlate.

Per kind, the correlation between consecutive samples of one *moment*, each placed by a time that
does not depend on its own value (a sample placed by a time its own value moves would pair with
its likes and measure a correlation that is not there): the reply factors of turns sent to one
engine within `moment_s` of each other (placed where their routes were answered), the gaps before
the turns whose previous turns came back from one engine within `moment_s` (placed at that engine
and reply), the first gaps of trajectories released within `moment_s` of each other. The rank
correlation is turned into the Gaussian copula's (2 sin(pi rho_s / 6)), which the simulator draws
with. Pure.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Hashable, Sequence

from libra.services.planner.gaps import MAX_WINDOW, MIN_SAMPLES, REPLY_WINDOW, beyond_engine


def moment_correlation(samples: Sequence[tuple[Hashable, float, float]], window_s: float) -> float | None:
    """The correlation of the Gaussian copula (module docstring) between the values of consecutive
    samples at one place within `window_s` of each other, from `samples` of (place, time, value):
    their rank correlation rho_s, as 2 sin(pi rho_s / 6), floored at 0 (a negative one is drawn as
    none). None with fewer than MIN_SAMPLES such pairs, or when the values do not vary."""
    if window_s <= 0:
        return None
    by_place: dict[Hashable, list[tuple[float, float]]] = {}
    for place, time, value in samples:
        by_place.setdefault(place, []).append((time, value))
    xs: list[float] = []
    ys: list[float] = []
    for rows in by_place.values():
        rows.sort(key=lambda row: row[0])  # by time alone: samples at one time stay in their order, not by value
        for (t0, v0), (t1, v1) in zip(rows, rows[1:]):
            if t1 - t0 <= window_s:
                xs.append(v0)
                ys.append(v1)
    if len(xs) < MIN_SAMPLES:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    if min(rx) == max(rx) or min(ry) == max(ry):
        return None
    rank = statistics.correlation(rx, ry)
    return max(0.0, min(1.0, 2.0 * math.sin(math.pi * rank / 6.0)))


def _ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 1, ties at their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


class MomentWindows:
    """The calibration's side of correlated draws (module docstring): the recent samples of each
    kind with the place and time of their moment, and the trajectories' last turns (where a later
    turn's gap began)."""

    def __init__(self, window: float, moment_s: float):
        size = int(min(MAX_WINDOW, max(1, window)))
        self.moment_s = moment_s
        self.first: deque[tuple[str, float, float]] = deque(maxlen=size)  # ("", released at, gap)
        self.later: deque[tuple[str, float, float]] = deque(maxlen=size)  # (previous engine, its reply at, gap)
        self.replies: deque[tuple] = deque(maxlen=int(min(REPLY_WINDOW, max(1, window))))  # (engine, sent at, row)
        self.previous: dict[str, tuple[str, float]] = {}  # trajectory -> (engine, reply at) of its last turn
        self.added = 0  # samples taken so far: what the exported figures were measured on (`efficiency`)
        self._exported: tuple[tuple, dict] | None = None  # ((added, fit), figures) of the last export

    def add(self, worker: str, end_s: float, seconds: float, gap_s: float, turn_number: int, trajectory: str,
            x: Sequence[float], comm_s: float) -> None:
        """One measured turn: served by `worker`, its reply back at `end_s` (wall-clock seconds) after
        `seconds`, `gap_s` after its trajectory's previous turn (or its release); a turn that names
        no worker or time is not placed in a moment."""
        if not worker or end_s <= 0:
            return
        self.added += 1
        self.replies.append((worker, end_s - seconds, (x[0], x[1], x[2], x[3], comm_s, seconds)))  # at its start
        if gap_s > 0 and turn_number == 1:
            self.first.append(("", end_s - seconds - gap_s, gap_s))
        elif gap_s > 0 and turn_number > 1 and trajectory in self.previous:
            engine, at_s = self.previous[trajectory]
            self.later.append((engine, at_s, gap_s))
        if trajectory:
            self.previous.pop(trajectory, None)  # (re-inserted last: the oldest go first)
            self.previous[trajectory] = (worker, end_s)
            if len(self.previous) > 4 * MAX_WINDOW:
                del self.previous[next(iter(self.previous))]

    def efficiency(self, c: Sequence[float]) -> dict:
        """The RolloutEfficiency fields measured under the turn fit `c` (each correlation once it has
        MIN_SAMPLES pairs; {} while none has: the configured ones stand)."""
        if self.moment_s <= 0:
            return {}
        key = (self.added, tuple(c))
        if self._exported is not None and self._exported[0] == key:  # asked again, nothing new: the same
            return dict(self._exported[1])
        beyond = [(worker, sent, beyond_engine(row, c)) for worker, sent, row in self.replies]
        found = {name: moment_correlation(samples, self.moment_s)
                 for name, samples in (("first_gap_correlation", self.first), ("gap_correlation", self.later),
                                       ("reply_correlation", beyond))}
        found = {name: round(rho, 6) for name, rho in found.items() if rho is not None}
        figures = {"moment_s": self.moment_s, **found} if found else {}
        self._exported = (key, figures)
        return dict(figures)

    def state(self) -> dict:
        return {"first": [[p, round(t, 6), round(g, 6)] for p, t, g in self.first],
                "later": [[p, round(t, 6), round(g, 6)] for p, t, g in self.later],
                "replies": [[w, round(t, 6), [float(f"{v:.9g}") for v in row]] for w, t, row in self.replies]}

    def restore(self, state: dict) -> None:
        self.added += 1  # (what was exported before is not what these samples measure)
        self.first.extend((str(p), float(t), float(g)) for p, t, g in state.get("first", ()))
        self.later.extend((str(p), float(t), float(g)) for p, t, g in state.get("later", ()))
        self.replies.extend((str(w), float(t), tuple(float(v) for v in row)) for w, t, row in state.get("replies", ()))
