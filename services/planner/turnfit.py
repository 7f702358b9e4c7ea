"""The turn model's terms, fitted to measured turns by least squares with forgetting.

A measured turn (seconds from the gateway's route to its reply) is modelled as

    seconds - comm = f_prefill * P + f_decode * D + step_overhead * N + per_seq * R + request * 1

with the cost model's nominal parts as features, each a column the fit scales:

    P   prefill seconds of the turn's context at the base efficiency (compute-bound)
    D   decode seconds of its output at the base efficiency: output x (weights + KV read) per step
    N   engine steps the turn waits for, one per generated token (= output)
    R   sequences in those steps: output x the engine's batch
    1   the turn's latency outside the engine (gateway, routing call, HTTP)

and comm the all-reduces, which the fit takes as given. f_prefill and f_decode are slowdowns (the
base efficiency is divided by them); step_overhead, per_seq and request are seconds. Measured per
generated token, step_overhead and per_seq include whatever the engine interleaves with the turn's
steps (other turns' prefill passes): the simulator charges them per decode step and a prefill its
tokens only. Why a fit and not one ratio per turn: on a small model (or a busy gateway) most of a
turn's time is per step and per request, which no efficiency of the roofline scales; a per-turn
ratio then swings with the turn's length (short turns are mostly waiting), and the calibrated
simulator replayed the same run 2x faster or slower depending on its last turns.

The fit minimises sum_i w_i (y_i - x_i . c)^2 + prior, with w_i = s_i (1 - 1/window)^(age of turn
i) and s_i the weight the caller gives the turn (the calibration: 1 / batch, the turn's share of its
engine's steps, so that the fit matches engine time rather than the sum of overlapping latencies):
the sufficient statistics (X'WX, X'Wy) are decayed and updated per turn, so a fit costs a 5 x 5
solve whatever the history. The prior (a ridge) pulls each coefficient towards its base value
(slowdown 1, overheads as configured) with the weight of `prior_turns` turns, in units of each
feature's mean square, so that terms the turns seen so far cannot tell apart (every turn alike)
share the difference equally instead of taking arbitrary shares. Coefficients are non-negative
(the active set with the least objective among those whose solution is non-negative: 2^5 - 1
small solves). Pure.
"""

from __future__ import annotations

import itertools
import math

TERMS = ("prefill", "decode", "step_overhead_s", "step_per_seq_s", "request_s")


class TurnFit:
    """Weighted least squares over the turn model with forgetting, a prior and c >= 0."""

    def __init__(self, base: tuple[float, ...], window: float, prior_turns: float):
        self.base, self.window, self.prior_turns = tuple(base), window, prior_turns
        n = len(TERMS)
        self.xx = [[0.0] * n for _ in range(n)]
        self.xy = [0.0] * n
        self.weight = 0.0  # the decayed sum of the turns' weights
        self.samples = 0
        self._solved: tuple[float, ...] | None = None
        self.in_force = self.base  # the coefficients of the last solve (what the planner last used)

    def add(self, x: tuple[float, ...], y: float, weight: float = 1.0) -> None:
        keep = 1.0 - 1.0 / self.window
        n = len(x)
        for i in range(n):
            row = self.xx[i]
            wx = weight * x[i]
            for j in range(n):
                row[j] = row[j] * keep + wx * x[j]
            self.xy[i] = self.xy[i] * keep + wx * y
        self.weight = self.weight * keep + weight
        self.samples += 1
        self._solved = None

    def coefficients(self) -> tuple[float, ...]:
        """The fitted terms (the base values until a turn is in)."""
        if self.samples == 0:
            return self.base
        if self._solved is None:
            self._solved = self.in_force = self._solve()
        return self._solved

    def _solve(self) -> tuple[float, ...]:
        n = len(self.base)
        # each term in units of its feature's root mean square (the features span many orders of
        # magnitude: a GPU prefill is microseconds, a turn hundreds of steps); the prior is
        # prior_turns pseudo-turns per term; a feature never seen (always 0) keeps its base value
        rms = [math.sqrt(self.xx[i][i] / self.weight) if self.weight else 0.0 for i in range(n)]
        unit = [r if r > 0 else 1.0 for r in rms]
        a = [[self.xx[i][j] / (unit[i] * unit[j]) for j in range(n)] for i in range(n)]
        b = [self.xy[i] / unit[i] for i in range(n)]
        for i in range(n):
            if rms[i] > 0:
                a[i][i] += self.prior_turns
                b[i] += self.prior_turns * self.base[i] * unit[i]
            else:
                a[i][i], b[i] = 1.0, self.base[i]
        best, best_error = [0.0] * n, 0.0
        for size in range(n, 0, -1):
            for free in itertools.combinations(range(n), size):
                solution = _solve_subset(a, b, free)
                if solution is None or min(solution) < 0:
                    continue
                c = [0.0] * n
                for k, i in enumerate(free):
                    c[i] = solution[k]
                error = self._error(a, b, c)
                if error < best_error:
                    best, best_error = c, error
        return tuple(c / unit[i] for i, c in enumerate(best))

    @staticmethod
    def _error(a: list[list[float]], b: list[float], c: list[float]) -> float:
        """The objective up to a constant: c'Ac - 2 b'c."""
        n = len(c)
        return sum(c[i] * a[i][j] * c[j] for i in range(n) for j in range(n)) - 2 * sum(b[i] * c[i] for i in range(n))

    def state(self) -> list:
        return [self.xx, self.xy, self.weight, self.samples]

    def restore(self, state: list) -> None:
        self.xx = [list(map(float, row)) for row in state[0]]
        self.xy = list(map(float, state[1]))
        self.weight, self.samples, self._solved = float(state[2]), int(state[3]), None
        self.in_force = self.coefficients()


class ForgettingMean:
    """The mean of a series with the turn fit's forgetting (weight (1 - 1/window)^age): the time a
    trajectory spends between its turns, which the simulator charges before each turn as a constant.
    A plain mean, not a change-point EWMA: the gaps are skewed (most short, a queue's tail long) and
    what the simulator needs is their sum, which a median or a clipped mean would understate."""

    def __init__(self, base: float, window: float):
        self.base, self.window = base, window
        self.total = self.weight = 0.0
        self.samples = 0

    def add(self, value: float) -> None:
        keep = 1.0 - 1.0 / self.window
        self.total, self.weight = self.total * keep + value, self.weight * keep + 1.0
        self.samples += 1

    def value(self) -> float:
        return self.total / self.weight if self.weight > 0 else self.base

    def state(self) -> list:
        return [self.total, self.weight, self.samples]

    def restore(self, state: list) -> None:
        self.total, self.weight, self.samples = float(state[0]), float(state[1]), int(state[2])


def _solve_subset(a: list[list[float]], b: list[float], free: tuple[int, ...]) -> list[float] | None:
    """Solve a[free][free] c = b[free] by Gaussian elimination with partial pivoting (None: singular)."""
    m = [[a[i][j] for j in free] + [b[i]] for i in free]
    size = len(free)
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-300 or not math.isfinite(m[pivot][col]):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, size):
            factor = m[r][col] / m[col][col]
            if factor:
                for k in range(col, size + 1):
                    m[r][k] -= factor * m[col][k]
    out = [0.0] * size
    for r in range(size - 1, -1, -1):
        out[r] = (m[r][size] - sum(m[r][k] * out[k] for k in range(r + 1, size))) / m[r][r]
    return out
