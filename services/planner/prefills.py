"""The prefill a measured turn waited through, as the simulator charges prefills (the turn fit's
first feature, calibration.py).

An engine computes a turn's context only where its prefix cache does not hold it: a turn whose
trajectory's previous turn ran on the same worker prefills what was added since (the tool's reply),
any other turn its whole context; the simulator charges the same (sim/rollout.py: `kv_on`). And an
engine's prefill pauses every running row (the hf engine's prefill is a pass of its own; the
simulated engine charges it as a stall of the batch), so a turn's time also holds the prefills of
the turns that joined its engine while it ran: as many as left it (each turn that ends makes room
for one), counted from the replies that came back from its worker meanwhile, each at the mean
prefill of a turn. Fitted on a turn's own prefill alone, the prefill slowdown absorbs the others'
and the simulator, which pauses every row for it, charged it again: on the GPU machine's 16-core
runs the fit came to 3-11x and the simulated turns 1.4-1.8x long (docs/benchmarks.md, "Simulator
against reality").

Records without their trajectory, worker or reply time (from before the gateway kept them) are
charged their whole context and their own prefill alone. Pure: no clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable

from libra.services.planner.turnfit import ForgettingMean

TRAJECTORIES = 65_536  # trajectories whose last worker and context are remembered
REPLIES = 1024  # reply times remembered per worker


class Prefills:
    """Each turn's prefill feature, from the turns seen before it."""

    def __init__(self, window: float):
        self.mean = ForgettingMean(0.0, window)  # a turn's own prefill, nominal seconds
        self.prefixes: OrderedDict[str, tuple[str, int]] = OrderedDict()  # trajectory -> (worker, context after)
        self.ends: dict[str, deque] = {}  # worker -> the reply times of its last turns

    def charge(self, seconds_of: Callable[[int], float], trajectory: str, worker: str, prompt: int, output: int,
               end_s: float, seconds: float) -> float:
        """The turn's prefill seconds at the base efficiency (`seconds_of(tokens)`): its own new tokens
        and, at the mean, one prefill per turn that joined its engine while it ran."""
        fresh = self.computed(trajectory, worker, prompt, output)
        own = seconds_of(fresh) if fresh else 0.0
        charged = own + self.joined(worker, end_s, seconds) * self.mean.value()
        self.mean.add(own)
        return charged

    def computed(self, trajectory: str, worker: str, prompt: int, output: int) -> int:
        """The tokens of a turn's context its engine computes: what was added since the trajectory's
        previous turn where that turn ran on the same worker, else the whole context."""
        if not trajectory or not worker:
            return prompt
        last = self.prefixes.pop(trajectory, None)
        self.prefixes[trajectory] = (worker, prompt + output)
        if len(self.prefixes) > TRAJECTORIES:
            self.prefixes.popitem(last=False)
        if last is not None and last[0] == worker and prompt >= last[1]:
            return prompt - last[1]
        return prompt

    def joined(self, worker: str, end_s: float, seconds: float) -> float:
        """About how many turns joined the turn's engine while it ran: the replies that came back from
        its worker during it (none without its worker or reply time)."""
        if not worker or end_s <= 0:
            return 0.0
        ends = self.ends.get(worker)
        if ends is None:
            ends = self.ends[worker] = deque(maxlen=REPLIES)
        start, joined = end_s - seconds, 0
        for end in reversed(ends):  # (in the order they were recorded: replies come back about in order)
            if end <= start:
                break
            joined += end <= end_s
        ends.append(end_s)
        return float(joined)

    def state(self) -> list:
        return self.mean.state()

    def restore(self, state: list) -> None:
        self.mean.restore(state)
