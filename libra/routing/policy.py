"""The routing interface every policy implements, and the state they all share.

A `Policy` owns the worker membership (`register`/`deregister`), the load each worker carries
(outstanding tokens and requests, released when a turn is reported done), and the placement of
each live trajectory. Subclasses decide only `choose`: which serving candidate gets a turn, and
why. `route` then books the load; `turn_done`, `tool_returned` and `finish` are the reports the
rollout gateway (or the simulator) sends back, which the learning policies override.

    route(Turn) ──▶ candidates (serving, not excluded) ──▶ choose() ──▶ book load ──▶ Decision
    turn_done / finish ──▶ release load;  tool_returned ──▶ (policies that learn)

Pure logic: no network, no Redis, no clock. This module knows no concrete policy.
"""

from __future__ import annotations

import abc
from collections import Counter
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, eq
from typing import NamedTuple

from libra.errors import FailedPrecondition, InvalidArgument, NotFound


NO_WORKER = "no serving worker to route to"
"""How a route with no serving worker at all begins (FAILED_PRECONDITION): the gateway waits on it."""


@dataclass
class Worker:
    worker_id: str
    bucket: str
    address: str
    tp: int = 1
    serving: bool = True
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    routed: int = 0


class Turn(NamedTuple):
    """One model turn to route. Turn and Decision are NamedTuples: immutable like a frozen dataclass
    and built ~3x faster (0.44 against 1.34 us), which the simulator's million routes per run feel."""

    trajectory_id: str
    prompt_id: str
    turn: int
    prompt_tokens: int
    max_new_tokens: int
    exclude: frozenset[str] = frozenset()


class Decision(NamedTuple):
    worker_id: str
    bucket: str
    address: str
    reason: str
    moved: bool = False


@dataclass
class Placement:
    """Where a trajectory's turn in flight runs, and how much load it holds."""

    worker_id: str | None = None
    inflight_tokens: int = 0
    turns: int = 0


@dataclass
class RoutingState:
    workers: dict[str, Worker] = field(default_factory=dict)
    placements: dict[str, Placement] = field(default_factory=dict)
    reasons: Counter = field(default_factory=Counter)
    rotation: int = 0


class Policy(abc.ABC):
    """A routing policy over a RoutingState (worker membership is shared by all policies)."""

    name = "policy"

    def __init__(self, per_worker_cap_tokens: int, affinity: bool = True):
        self.cap = per_worker_cap_tokens
        self.affinity = affinity
        self.state = RoutingState()
        self._serving: list[Worker] | None = None  # the serving workers, in registration order (cached)

    # -- membership ----------------------------------------------------------------------------
    def register(self, worker: Worker) -> None:
        if not worker.worker_id or not worker.address or not worker.bucket:
            raise InvalidArgument("worker.worker_id, worker.bucket and worker.address are required")
        old = self.state.workers.get(worker.worker_id)
        if old is not None:  # re-registration keeps the load we know about
            worker.outstanding_tokens, worker.outstanding_requests = old.outstanding_tokens, old.outstanding_requests
        self.state.workers[worker.worker_id] = worker
        self._serving = None

    def deregister(self, worker_id: str) -> None:
        if self.state.workers.pop(worker_id, None) is None:
            raise NotFound(f"unknown worker {worker_id!r}")
        self._serving = None

    def serving(self) -> list[Worker]:
        """The serving workers in registration order. A worker's `serving` is read when it registers
        (re-register it to change it); the list is shared: do not modify it."""
        if self._serving is None:
            self._serving = [w for w in self.state.workers.values() if w.serving]
        return self._serving

    # -- routing -------------------------------------------------------------------------------
    def route(self, turn: Turn) -> Decision:
        if not turn.trajectory_id:
            raise InvalidArgument("trajectory_id is required")
        exclude = turn.exclude
        candidates = [w for w in self.serving() if w.worker_id not in exclude] if exclude else self.serving()
        if not candidates:
            known = len(self.state.workers)
            raise FailedPrecondition(f"{NO_WORKER} ({known} registered, "
                                     f"{len(turn.exclude)} excluded): start rollout workers first")
        placement = self.state.placements.get(turn.trajectory_id)
        if placement is None:
            placement = self.state.placements[turn.trajectory_id] = Placement()
        worker, reason = self.choose(turn, placement, candidates)
        moved = placement.worker_id is not None and placement.worker_id != worker.worker_id
        self._release(placement)
        placement.worker_id, placement.inflight_tokens = worker.worker_id, turn.prompt_tokens + turn.max_new_tokens
        placement.turns += 1
        worker.outstanding_tokens += placement.inflight_tokens
        worker.outstanding_requests += 1
        worker.routed += 1
        self.state.reasons[reason] += 1
        return Decision(worker.worker_id, worker.bucket, worker.address, reason, moved)

    @abc.abstractmethod
    def choose(self, turn: Turn, placement: Placement, candidates: list[Worker]) -> tuple[Worker, str]:
        """Pick a worker among candidates (serving, not excluded; do not modify the list: it may be
        `serving()` itself); return it with the reason of the decision."""

    def current(self, turn: Turn, placement: Placement) -> Worker | None:
        """The candidate the trajectory's last turn went to, if it is still one (serving, not excluded)."""
        worker = self.state.workers.get(placement.worker_id or "")
        if worker is None or not worker.serving or worker.worker_id in turn.exclude:
            return None
        return worker

    def least_loaded(self, candidates: list[Worker]) -> Worker:
        """Least outstanding tokens; ties rotate so equal workers share the load."""
        tokens = list(map(_tokens, candidates))
        return self._pick(candidates, tokens, min(tokens))

    def least_loaded_under_cap(self, workers: list[Worker]) -> Worker | None:
        """`least_loaded` of the workers under the per-worker cap; None when none is. (The least
        loaded of all is under the cap when any is, and those tied with it are all under it.)"""
        if not workers:
            return None
        tokens = list(map(_tokens, workers))
        low = min(tokens)
        return self._pick(workers, tokens, low) if low < self.cap else None

    def _pick(self, candidates: list[Worker], tokens: list[int], low: int) -> Worker:
        if tokens.count(low) == 1:
            tied = [candidates[tokens.index(low)]]
        else:
            tied = sorted(compress(candidates, map(eq, tokens, repeat(low))), key=_worker_id)
        self.state.rotation += 1
        return tied[self.state.rotation % len(tied)]

    # -- reports -------------------------------------------------------------------------------
    def turn_done(self, trajectory_id: str, worker_id: str, output_tokens: int = 0) -> None:
        """The turn in flight is over: release its load (`output_tokens` is for policies that learn)."""
        placement = self.state.placements.get(trajectory_id)
        if placement is None:
            raise NotFound(f"unknown trajectory {trajectory_id!r}: it has no routed turn")
        if placement.worker_id != worker_id:
            raise InvalidArgument(f"trajectory {trajectory_id!r} was routed to {placement.worker_id!r}, not {worker_id!r}")
        self._release(placement)

    def tool_returned(self, trajectory_id: str, tool: str, status: str, payload_tokens: int) -> None:
        """Load balance ignores tool outcomes; C-MLFQ learns from them."""
        if trajectory_id not in self.state.placements:
            raise NotFound(f"unknown trajectory {trajectory_id!r}")

    def finish(self, trajectory_id: str, prompt_id: str, output_tokens: int) -> None:
        placement = self.state.placements.pop(trajectory_id, None)
        if placement is None:
            raise NotFound(f"unknown trajectory {trajectory_id!r}")
        self._release(placement)

    def _release(self, placement: Placement) -> None:
        worker = self.state.workers.get(placement.worker_id or "")
        if worker is not None and placement.inflight_tokens:
            worker.outstanding_tokens = max(0, worker.outstanding_tokens - placement.inflight_tokens)
            worker.outstanding_requests = max(0, worker.outstanding_requests - 1)
        placement.inflight_tokens = 0


_worker_id, _tokens = attrgetter("worker_id"), attrgetter("outstanding_tokens")


def ordered_buckets(buckets: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Buckets sorted by max_tokens, after checking names and limits are unique and positive."""
    if not buckets:
        raise InvalidArgument("a bucket policy needs at least one bucket (name, max_tokens), e.g. planner.buckets")
    names = [name for name, _ in buckets]
    limits = [limit for _, limit in buckets]
    if len(set(names)) != len(names) or len(set(limits)) != len(limits) or min(limits) < 1:
        raise InvalidArgument(f"routing buckets need unique names and unique max_tokens >= 1, got {buckets}")
    return sorted(buckets, key=lambda bucket: bucket[1])
