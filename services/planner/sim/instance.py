"""The instance-model seam of the simulator: the unit of work an instance runs, what a simulated
inference instance must do, and what builds instances.

Two instance models fill the seam:

    simple.py   SimpleModel: per-token time base / tp^exponent with a mild batch penalty, a batch
                cap, prefill as extra decode steps (the scheduler evaluation: routing alone)
    engines.py  CostModelEngines: vLLM-like engines at the planner's cost model's decode/prefill
                speeds and KV limits, pooled at cluster scale (`libra sim`, plans)

The rollout loop (`rollout.py`) and the training loop (`cluster.py`) only talk to `Instance`, so
a third model (e.g. one calibrated against real runs) plugs in without touching them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from libra.errors import InvalidArgument
from libra.traces.spec import TrajectorySpec


class SimulationError(InvalidArgument):
    """The run cannot go on as configured (a turn no engine can hold, a layout out of memory)."""


@dataclass(eq=False, slots=True)
class Unit:
    """A trajectory (or a cohort of `copies` identical ones) in flight."""

    spec: TrajectorySpec
    copies: int
    context: float  # tokens per sequence so far (prompt, outputs, tool payloads)
    turn: int = 0
    turn_left: float = 0.0  # output tokens of the current turn not yet generated
    prefill: float = 0.0  # tokens to prefill when admitted
    worker: str = ""
    kv_on: str = ""  # the instance holding this trajectory's prefix cache
    policy: object = None  # the policy object that routed the current turn
    carried: int = 0  # tokens a newer policy counts for this turn on its worker (routed by an older one)
    released_s: float = 0.0
    seq: int = 0
    reply: float = 1.0  # the current turn's time outside the engine, a factor on request_s (drawn when routed)

    @property
    def final(self) -> float:
        """Context per sequence at the end of the current turn."""
        return self.context + self.turn_left


@dataclass(frozen=True)
class Group:
    """`count` identical instances of tensor parallelism `tp` serving `bucket`."""

    bucket: str
    tp: int
    count: int


class Instance(Protocol):
    """One simulated inference instance (or a pool of `replicas` identical engines as one worker).

    It owns its running batch, its FIFO waiting queue and its clock (`last`); the caller advances
    the clock to an event's time before changing anything, and asks `next_completion` afterwards.
    """

    wid: str
    bucket: str
    tp: int
    replicas: int
    up: bool  # serving (registered with the policy)
    alive: bool  # False once taken down by a plan change (its pending events are void)
    version: int  # bumped at every batch change: a completion event of an older version is void
    last: float
    stall: float  # seconds during which the batch makes no progress (prefill, weight sync)
    request_s: float  # seconds a turn spends outside the engine (the reply's way back to the gateway)
    busy_s: float
    peak_kv: float
    routed: int
    waiting: object  # the queue of units not yet admitted (len() is the queue depth)
    seq_capacity: float  # largest context one sequence can reach
    max_seqs: int  # sequences admitted at once
    capacity: float  # KV tokens held at once

    def fits(self, unit: Unit) -> bool:
        """Could it ever run the unit's turn? An answer from `seq_capacity`, `max_seqs` and `capacity`
        alone: the rollout loop asks one instance per class of alike ones."""

    def load_tokens(self) -> int: ...

    def requests(self) -> int: ...

    def advance(self, now: float) -> None: ...

    def enqueue(self, unit: Unit) -> None: ...

    def admit(self) -> None: ...

    def next_completion(self) -> float | None: ...

    def complete(self) -> Unit: ...

    def evict(self) -> list[Unit]: ...


class InstanceModel(Protocol):
    """Builds the instances of a layout; knows which TP degrees it can build and the longest context."""

    def holds(self, tp: int) -> bool: ...

    def max_context_tokens(self) -> float: ...

    def instance(self, wid: str, bucket: str, tp: int, replicas: int, up_at: float) -> Instance: ...
