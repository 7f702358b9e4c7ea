"""Which trajectories the simulated trainer trains at each step, and when rollout may start more:
the two batch rules of the cluster simulator.

    in_order        step s trains the whole batch s of the trace, released once the policy version
                    reaches s - staleness: every step waits for its batch's longest trajectory
                    (the simulator's first rule; what a synchronous job does at staleness 0)
    first_complete  the trainer's own rule (services/trainer/loop.py, batches.py): the trace's
                    groups (a prompt's samples) are submitted in order while fewer than
                    (staleness + version + 1) batches' worth have been (plus one group for each
                    group discarded); a step trains the first complete groups that fill a batch;
                    a complete group whose oldest token is more than `staleness` versions behind
                    the trainer is rejected whole: its rollout work is lost, a replacement goes out

A group here is the trajectories of one prompt in one batch of the trace (a cohort entry that
stands for several prompts' groups is judged as one). A trajectory's oldest token is its first
(`started`: the version its first turn was admitted with; the version it was released at when the
instance model does not say). Pure bookkeeping: no events, no engines; `cluster.Simulator` calls
`due` after every step, `finished` for every trajectory, `take` when the trainer is free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from libra.services.planner.sim.instance import SimulationError
from libra.traces.spec import Pairs, Trace, TrajectorySpec

Batching = Literal["in_order", "first_complete"]


@dataclass(frozen=True)
class Batch:
    """What one step trains: its trajectories, when their rollout started and ended, and their lags."""

    specs: tuple[TrajectorySpec, ...]
    released_s: float  # the earliest release among them
    finished_s: float  # the last of them to finish
    lags: tuple[tuple[int, int], ...]  # (versions behind the trainer, trajectories)

    @property
    def lengths(self) -> Pairs:
        return Pairs(self.specs)

    @property
    def mean_tokens(self) -> float:
        return sum(s.total_tokens * s.copies for s in self.specs) / sum(s.copies for s in self.specs)


class Groups:
    """The trace's groups in submission order, their progress and the version of their first tokens."""

    def __init__(self, trace: Trace, by_batch: bool):
        keys: dict[tuple[int, str], list[TrajectorySpec]] = {}
        for step, specs in enumerate(trace.steps):
            for spec in specs:
                keys.setdefault((step, "" if by_batch else spec.prompt_id), []).append(spec)
        self.members = list(keys.values())  # group index -> its trajectories, in trace order
        self.of = {spec.trajectory_id: g for g, specs in enumerate(self.members) for spec in specs}
        self.left = [len(specs) for specs in self.members]
        self.size = [sum(s.copies for s in specs) for specs in self.members]
        self.released_s = [0.0] * len(self.members)
        self.released_version = [0] * len(self.members)
        self.finished_s = [0.0] * len(self.members)
        self.first_version: dict[str, int] = {}

    def lags(self, group: int, version: int) -> list[tuple[int, int]]:
        return [(version - self.first_version.get(s.trajectory_id, self.released_version[group]), s.copies)
                for s in self.members[group]]


class InOrder:
    """Step s trains batch s; batch s goes out once version >= s - staleness."""

    def __init__(self, trace: Trace, staleness: int, batch: int):
        self.groups, self.staleness, self.released = Groups(trace, by_batch=True), staleness, 0
        self.taken: list[tuple[int, ...]] = []  # the groups each step trained

    def due(self, version: int, now: float) -> list[TrajectorySpec]:
        """Trajectories to release now: batches up to version + staleness."""
        out = []
        while self.released < len(self.groups.members) and self.released <= version + self.staleness:
            out.extend(self._release(self.released, version, now))
            self.released += 1
        return out

    def _release(self, group: int, version: int, now: float) -> list[TrajectorySpec]:
        self.groups.released_s[group], self.groups.released_version[group] = now, version
        return list(self.groups.members[group])

    def started(self, trajectory_id: str, version: int) -> None:
        self.groups.first_version.setdefault(trajectory_id, version)

    def finished(self, trajectory_id: str, now: float) -> bool:
        """A trajectory finished; True when that completes a group (the trainer may have a batch)."""
        group = self.groups.of[trajectory_id]
        self.groups.left[group] -= 1
        if self.groups.left[group]:
            return False
        self.groups.finished_s[group] = now
        return True

    def take(self, version: int) -> Batch | None:
        """Step `version`'s batch if it is complete."""
        g = self.groups
        if version >= self.released or g.left[version]:
            return None
        if len(self.taken) == version:  # (asked again while the trainer is busy: the same batch)
            self.taken.append((version,))
        return Batch(tuple(g.members[version]), g.released_s[version], g.finished_s[version],
                     tuple(g.lags(version, version)))

    @property
    def rejected(self) -> int:
        return 0


class FirstComplete(InOrder):
    """The trainer's rule (module docstring)."""

    def __init__(self, trace: Trace, staleness: int, batch: int):
        self.groups, self.staleness, self.batch, self.released = Groups(trace, by_batch=False), staleness, batch, 0
        self.taken = []
        self.submitted = self.discarded = 0  # trajectories
        self.complete: deque[int] = deque()  # groups complete and not yet judged, in completion order
        self.admitted: list[int] = []  # groups admitted for the coming step
        self.have = 0  # their trajectories
        self.rejected_groups: list[int] = []

    def due(self, version: int, now: float) -> list[TrajectorySpec]:
        budget = (self.staleness + version + 1) * self.batch + self.discarded
        out, g = [], self.groups
        while self.released < len(g.members) and self.submitted + g.size[self.released] <= budget:
            out.extend(self._release(self.released, version, now))
            self.submitted += g.size[self.released]
            self.released += 1
        return out

    def finished(self, trajectory_id: str, now: float) -> bool:
        done = super().finished(trajectory_id, now)
        if done:
            self.complete.append(self.groups.of[trajectory_id])
        return done

    def take(self, version: int) -> Batch | None:
        g, have = self.groups, self.have
        while self.complete:
            group = self.complete.popleft()
            lags = g.lags(group, version)
            if max(lag for lag, _ in lags) > self.staleness:
                self.rejected_groups.append(group)
                self.discarded += g.size[group]
            elif have + g.size[group] <= self.batch:
                self.admitted.append(group)
                have += g.size[group]
            else:
                self.complete.appendleft(group)  # for the next step
                break
        self.have = have
        if have < self.batch:
            if self.released == len(g.members) and not self.complete and not self._in_flight():
                raise SimulationError(f"the trace ran out of groups at version {version}: {self.rejected} "
                                      f"trajectories were rejected as stale; give the trace more batches than the "
                                      f"steps to train")
            return None
        chosen, self.admitted, self.have = self.admitted, [], 0
        self.taken.append(tuple(chosen))
        return Batch(tuple(s for i in chosen for s in g.members[i]), min(g.released_s[i] for i in chosen),
                     max(g.finished_s[i] for i in chosen), tuple(lag for i in chosen for lag in g.lags(i, version)))

    def _in_flight(self) -> bool:
        return any(self.groups.left[i] for i in range(self.released))

    @property
    def rejected(self) -> int:
        """Trajectories rejected as stale so far."""
        return sum(self.groups.size[i] for i in self.rejected_groups)


def feeder(kind: Batching, trace: Trace, staleness: int) -> InOrder:
    return (FirstComplete if kind == "first_complete" else InOrder)(trace, staleness, trace.batch)
