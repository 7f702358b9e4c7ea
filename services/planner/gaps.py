"""A trajectory's time between its model turns outside tool calls (its *gap*: the gateway's routing
call, its reports and records), as a distribution rather than a mean.

    gateway: each turn's gap_seconds and turn_number (HistoryRecord)
        -> calibration: `GapWindows`, the recent gaps of first turns and of later ones
        -> RolloutEfficiency.first_gap_quantiles / turn_gap_quantiles (at `GAP_PROBS`)
        -> simulator: `GapSampler.draw(trajectory, turn)`, each turn its own draw

Why: a trajectory's duration is its turns, its tool calls and its gaps, and a synchronous batch
waits for its longest trajectory. The gaps are skewed (on the CPU headline runs: later turns' p50
15-26 ms, p99 0.10-0.23 s; a first turn's longer, the whole batch routing at once), so charging their
mean before every turn makes every trajectory's gaps alike and the longest trajectory too short.
Independent draws from the measured distribution, first turn apart, reproduce the spread of the
measured per-trajectory gap totals (benchmarks/sim_probes.py, `trajectory_time`).

The draw for (trajectory, turn) is a hash of both, not a random generator's next number: the same
replay gives every turn the same gap whatever order its events run in (the simulator stays
deterministic). Without quantiles (too few samples, or an uncalibrated cost model) every turn gets
the mean, `turn_gap_s`, as before.

The same holds inside a turn: what a turn takes beyond the fitted engine time (the engine's
jitter, the reply's way back; on average the turn fit's `request_s`) varies from turn to turn far
more than a constant says (on the CPU headline runs: a standard deviation of 0.07-0.10 s on a
0.12-0.15 s median turn, hardly related to the turn's prompt, output, batch or place), and a
group waits for its slowest trajectory. `Replies` keeps the recent turns' features and seconds;
the calibration exports the distribution of their time beyond the fitted engine time (floored at
0) relative to its mean (`RolloutEfficiency.request_quantiles`), and the simulator charges each
turn `request_s` times its own draw (`ReplySampler`).

Draws are not independent where the turns are not (`Moments`). On the CPU headline runs a batch's
trajectories move through their turns together: the replies of one decode step come back together,
their next routes are answered by one scheduler write, and their time beyond the engine deviates
together (rank correlations 0.87-0.97 between consecutive samples of one kind within 20 ms, as
measured below). Independent draws spread such turns apart, so a
simulated engine always has some trajectory in a turn where a real one idles between turns (its
busy fraction 1.20-1.23x the measured; docs/benchmarks.md, "Simulator against reality"). The
calibration measures how the samples of one *moment* correlate (moments.py). The simulator draws a
moment's samples from a Gaussian copula of that correlation rho between two of its samples:
each draw is Phi(sqrt(rho) z_moment + sqrt(1 - rho) z_own), z_moment shared by the moment and z_own
the turn's own (both hashes, as above), so every marginal distribution stays the calibrated one. A
moment lasts while samples keep coming within `moment_s` of the previous one at its place. With
correlation 0 (the default, and what an uncalibrated run has) every turn draws on its own, as before.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import statistics
from collections import deque
from typing import Hashable, Sequence

GAP_PROBS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)
MIN_SAMPLES = 50  # of each kind, before quantiles replace the mean
MAX_WINDOW = 4096  # samples kept of each kind
REPLY_WINDOW = 1024  # turns kept for the distribution of the time beyond the engine's


def uniform(key: str) -> float:
    """A uniform in [0, 1): a hash of `key` (module docstring)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 18446744073709551616.0


def at(values: Sequence[float], u: float) -> float:
    """Quantiles `values` at GAP_PROBS, read at probability `u` (linear between them)."""
    i = min(len(GAP_PROBS) - 2, bisect.bisect_right(GAP_PROBS, u) - 1)
    p0, p1 = GAP_PROBS[i], GAP_PROBS[i + 1]
    return values[i] + (values[i + 1] - values[i]) * (u - p0) / (p1 - p0)


def draw(values: Sequence[float], key: str) -> float:
    """A draw from quantiles `values` at GAP_PROBS, its uniform a hash of `key` (module docstring)."""
    return at(values, uniform(key))


_NORMAL = statistics.NormalDist()


class Moments:
    """The simulator's side of correlated draws (module docstring): the moment in progress at each
    place, and a turn's uniform given its moment's. Deterministic: the simulator's events run in a
    fixed order, and every uniform is a hash."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.last: dict[Hashable, tuple[float, float]] = {}  # place -> (time of its last sample, z_moment)

    def uniform(self, key: str, rho: float, place: Hashable | None, now: float) -> float:
        """The uniform of the sample named `key` taken at `place` at time `now` (not earlier than the
        place's previous sample), correlated `rho` with each other sample of its moment there: its
        normal score is sqrt(rho) z_moment + sqrt(1 - rho) z_own (place None, or rho or the window
        0: its own uniform)."""
        own = uniform(key)
        if place is None or rho <= 0.0 or self.window_s <= 0.0:
            return own
        last = self.last.get(place)
        if last is not None and now - last[0] <= self.window_s:
            shared = last[1]
        else:
            shared = _NORMAL.inv_cdf(min(max(uniform(key + "/moment"), 1e-12), 1 - 1e-12))
        self.last[place] = (now, shared)
        if rho >= 1.0:
            return _NORMAL.cdf(shared)
        z = math.sqrt(rho) * shared + math.sqrt(1.0 - rho) * _NORMAL.inv_cdf(min(max(own, 1e-12), 1 - 1e-12))
        return _NORMAL.cdf(z)


def quantiles(samples: Sequence[float], probs: Sequence[float] = GAP_PROBS) -> tuple[float, ...]:
    """The samples' quantiles at `probs` (linear between order statistics)."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples to take quantiles of")
    top = len(ordered) - 1
    out = []
    for p in probs:
        position = p * top
        low = int(position)
        high = min(top, low + 1)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    return tuple(out)


def check_quantiles(values: Sequence[float], field: str) -> tuple[float, ...]:
    """Empty, or one non-negative, non-decreasing value per `GAP_PROBS`; the error names the field."""
    values = tuple(float(v) for v in values)
    if not values:
        return values
    if len(values) != len(GAP_PROBS):
        raise ValueError(f"{field} needs {len(GAP_PROBS)} values (at probabilities {list(GAP_PROBS)}), "
                         f"got {len(values)}; or none")
    if values[0] < 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{field} must be non-negative and non-decreasing seconds, got {list(values)}")
    return values


class GapWindows:
    """The last `window` gaps (at most MAX_WINDOW) of first turns and of later turns, as measured."""

    def __init__(self, window: float):
        size = int(min(MAX_WINDOW, max(1, window)))
        self.first: deque[float] = deque(maxlen=size)
        self.later: deque[float] = deque(maxlen=size)

    def add(self, gap_s: float, turn_number: int) -> None:
        """One turn's gap; `turn_number` 1 is a trajectory's first, 0 not reported (not kept)."""
        if turn_number == 1:
            self.first.append(gap_s)
        elif turn_number > 1:
            self.later.append(gap_s)

    def quantiles(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(first turns', later turns') quantiles at GAP_PROBS; both empty until each kind has
        MIN_SAMPLES (a distribution from a handful of turns would be noise, not shape)."""
        if len(self.first) < MIN_SAMPLES or len(self.later) < MIN_SAMPLES:
            return (), ()
        return quantiles(self.first), quantiles(self.later)

    def efficiency(self) -> dict:
        """The RolloutEfficiency fields the windows measure ({} until they have enough: the
        configured ones, if any, stand)."""
        first, later = self.quantiles()
        if not first:
            return {}
        return {"first_gap_quantiles": tuple(min(600.0, g) for g in first),
                "turn_gap_quantiles": tuple(min(600.0, g) for g in later)}

    def state(self) -> list:
        return [[round(g, 6) for g in self.first], [round(g, 6) for g in self.later]]

    def restore(self, state: list) -> None:
        self.first.extend(float(g) for g in state[0])
        self.later.extend(float(g) for g in state[1])


class GapSampler:
    """Each turn's gap in the simulator: a draw from the quantiles, or the mean without them; the
    draws of one moment correlated as calibrated (`Moments`)."""

    def __init__(self, mean_s: float, first: Sequence[float] = (), later: Sequence[float] = (),
                 moment_s: float = 0.0, first_rho: float = 0.0, later_rho: float = 0.0, seed: int = 0):
        self.mean_s = mean_s
        self.first, self.later = (tuple(first), tuple(later)) if first and later else ((), ())
        self.rho = (first_rho, later_rho)
        self.moments = Moments(moment_s)
        self.salt = f"#{seed}" if seed else ""  # (seed 0: the keys of every earlier run)

    @classmethod
    def of(cls, efficiency, seed: int = 0) -> "GapSampler | None":
        """The sampler a `RolloutEfficiency` calls for, its draws seeded by `seed`; None when every
        gap is 0 (the fast path)."""
        if not efficiency.turn_gap_s and not efficiency.turn_gap_quantiles:
            return None
        return cls(efficiency.turn_gap_s, efficiency.first_gap_quantiles, efficiency.turn_gap_quantiles,
                   efficiency.moment_s, efficiency.first_gap_correlation, efficiency.gap_correlation, seed)

    def draw(self, trajectory_id: str, turn: int, place: Hashable | None = None, now: float = 0.0) -> float:
        """The gap before turn `turn` (0: the first) of the trajectory, drawn at time `now` where its
        moment is: for a first turn its release (any place, the same for all), for a later one the
        engine its previous turn came back from (None: its own draw)."""
        values = self.first if turn == 0 else self.later
        if not values:
            return self.mean_s
        key = f"{trajectory_id}/{turn}{self.salt}"
        rho = self.rho[turn > 0]
        if rho <= 0.0 or place is None:
            return draw(values, key)
        return at(values, self.moments.uniform(key, rho, (turn > 0, place), now))


def beyond_engine(row: Sequence[float], c: Sequence[float]) -> float:
    """A turn's seconds beyond the engine time the turn fit's coefficients `c` give it, floored at 0,
    from its row (the fit's first four features, the collectives' seconds, the measured seconds)."""
    return max(0.0, row[5] - row[4] - sum(ci * xi for ci, xi in zip(c[:4], row)))


class Replies:
    """The last REPLY_WINDOW turns' engine features (the turn fit's first four terms and the
    collectives' seconds) and measured seconds: their time beyond the engine, against whichever
    fit is asked (the fit moves; the residuals are taken when exported, not when measured)."""

    def __init__(self, window: float):
        self.rows: deque[tuple[float, ...]] = deque(maxlen=int(min(REPLY_WINDOW, max(1, window))))

    def add(self, x: Sequence[float], comm_s: float, seconds: float) -> None:
        self.rows.append((x[0], x[1], x[2], x[3], comm_s, seconds))

    def quantiles(self, c: Sequence[float]) -> tuple[float, ...]:
        """Quantiles at GAP_PROBS of each turn's seconds beyond the engine time the coefficients `c`
        give it, floored at 0, over their mean (so a draw is a factor on request_s, mean ~1);
        empty until MIN_SAMPLES turns, or when no turn took longer than its engine time."""
        if len(self.rows) < MIN_SAMPLES:
            return ()
        beyond = [beyond_engine(r, c) for r in self.rows]
        mean = statistics.fmean(beyond)
        return quantiles([b / mean for b in beyond]) if mean > 0 else ()

    def efficiency(self, c: Sequence[float]) -> dict:
        """The RolloutEfficiency field the turns measure under the fit `c` ({}: too few turns, or
        the fit puts no time outside the engine; the configured one stands)."""
        factors = self.quantiles(c) if c[4] > 0 else ()
        return {"request_quantiles": tuple(min(1000.0, f) for f in factors)} if factors else {}

    def state(self) -> list:
        return [[float(f"{v:.9g}") for v in row] for row in self.rows]

    def restore(self, state: list) -> None:
        self.rows.extend(tuple(float(v) for v in row) for row in state)


class ReplySampler:
    """Each turn's time outside the engine in the simulator: request_s times a draw (mean ~1); the
    draws of replies that come back together on one engine correlated as calibrated (`Moments`)."""

    def __init__(self, factors: Sequence[float], moment_s: float = 0.0, rho: float = 0.0, seed: int = 0):
        self.factors = tuple(factors)
        self.rho = rho
        self.moments = Moments(moment_s)
        self.salt = f"#{seed}" if seed else ""

    @classmethod
    def of(cls, efficiency, seed: int = 0) -> "ReplySampler | None":
        """Its draws seeded by `seed`; None without a calibrated distribution (every turn gets request_s)."""
        if not efficiency.request_quantiles:
            return None
        return cls(efficiency.request_quantiles, efficiency.moment_s, efficiency.reply_correlation, seed)

    def factor(self, trajectory_id: str, turn: int, place: Hashable | None = None, now: float = 0.0) -> float:
        """The factor on request_s of turn `turn` (0: the first) of the trajectory, sent to engine
        `place` at time `now` (None: its own draw)."""
        key = f"{trajectory_id}/{turn}/reply{self.salt}"
        if self.rho <= 0.0 or place is None:
            return draw(self.factors, key)
        return at(self.factors, self.moments.uniform(key, self.rho, place, now))
