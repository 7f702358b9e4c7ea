"""The trajectory type of every trace, the batch-per-step `Trace`, and their checks.

A `TrajectorySpec` is what one rollout did: its prompt (id and tokens), its model turns (output
tokens each) and the tool call after every turn but the last (name, structured status, payload
tokens, latency). `step` is the training step whose batch it belongs to. It may stand for `copies`
identical trajectories: the simulator's resolution knob at cluster scale (a cohort is routed,
batched and trained as `copies` sequences, so the GPU work is exact while Python does 1/copies of
the bookkeeping).

Pure data and checks: no files, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from libra.errors import InvalidArgument
from libra.routing.signatures import STATUSES

MAX_TOKENS = 10_000_000  # prompt + outputs + tool payloads of one trajectory (preflight's bound)
MAX_LATENCY_S = 86_400.0


@dataclass(frozen=True)
class TurnSpec:
    """One model turn and the tool call that follows it (no tool after the last turn)."""

    output_tokens: int
    tool: str = ""
    status: str = ""
    payload_tokens: int = 0
    latency_s: float = 0.0


@dataclass(frozen=True)
class TrajectorySpec:
    trajectory_id: str
    prompt_id: str
    step: int
    prompt_tokens: int
    turns: tuple[TurnSpec, ...]
    copies: int = 1

    @property
    def outputs(self) -> tuple[int, ...]:
        """Output tokens per model turn."""
        return tuple(turn.output_tokens for turn in self.turns)

    @cached_property  # read at every finish, training step and length pair of a simulation
    def output_tokens(self) -> int:
        return sum(turn.output_tokens for turn in self.turns)

    @cached_property
    def payload_tokens(self) -> int:
        return sum(turn.payload_tokens for turn in self.turns[:-1])

    @property
    def total_tokens(self) -> int:
        """The training sequence: prompt, every model turn and every tool payload."""
        return self.prompt_tokens + self.output_tokens + self.payload_tokens


@dataclass(frozen=True)
class Trace:
    """`steps[s]` is the batch of training step s."""

    steps: tuple[tuple[TrajectorySpec, ...], ...]
    source: str = "trace"

    @property
    def batch(self) -> int:
        """Trajectories per step (copies counted)."""
        return sum(spec.copies for spec in self.steps[0])

    def pairs(self, step: int) -> list[tuple[int, int]]:
        """Step `step` as the planner's search sees it: (prompt + tool payloads, output) per sequence."""
        return pairs(self.steps[step])

    def mean_tokens(self, step: int) -> float:
        batch = self.steps[step]
        return sum(s.total_tokens * s.copies for s in batch) / sum(s.copies for s in batch)


def pairs(specs) -> list[tuple[int, int]]:
    """(prompt + tool payloads, output) per sequence: a trajectory as the cost model's length pair."""
    out = []
    for spec in specs:
        out.extend([(spec.prompt_tokens + spec.payload_tokens, spec.output_tokens)] * spec.copies)
    return out


class Pairs(Sequence):
    """`pairs(specs)`, built when first read: a simulated step's record carries its batch's lengths
    (32,768 pairs a step at 4,096 GPUs), which only an online replanner reads."""

    __slots__ = ("specs", "_pairs")

    def __init__(self, specs) -> None:
        self.specs = tuple(specs)
        self._pairs: list[tuple[int, int]] | None = None

    def _built(self) -> list[tuple[int, int]]:
        if self._pairs is None:
            self._pairs = pairs(self.specs)
        return self._pairs

    def __len__(self) -> int:
        return sum(spec.copies for spec in self.specs)

    def __getitem__(self, index):
        return self._built()[index]

    def __iter__(self):
        return iter(self._built())

    def __eq__(self, other) -> bool:  # the same pairs, as a list of them would compare
        if isinstance(other, Pairs):
            return self.specs == other.specs or self._built() == other._built()
        if isinstance(other, (list, tuple)):
            return self._built() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (a sequence that compares by value, as a list)

    def __repr__(self) -> str:
        return f"Pairs({len(self)} sequences of {len(self.specs)} specs)"


def check(trace: Trace) -> Trace:
    """Validate lengths, latencies, outcomes and batch sizes; the error names the first bad entry."""
    if not trace.steps or not trace.steps[0]:
        raise InvalidArgument(f"{trace.source}: the trace has no trajectories; give at least one step's batch")
    batch = trace.batch
    seen: set[str] = set()
    for step, specs in enumerate(trace.steps):
        size = sum(spec.copies for spec in specs)
        if size != batch:
            raise InvalidArgument(f"{trace.source}: step {step} has {size} trajectories but step 0 has {batch}; "
                                  f"every step's batch must be the same size (the training layout divides it)")
        for spec in specs:
            where = f"{trace.source}: trajectory {spec.trajectory_id!r} (step {step})"
            if spec.step != step:
                raise InvalidArgument(f"{where} says step {spec.step}")
            check_spec(spec, where)
            if spec.trajectory_id in seen:
                raise InvalidArgument(f"{trace.source}: trajectory_id {spec.trajectory_id!r} appears twice")
            seen.add(spec.trajectory_id)
    return trace


def check_spec(spec: TrajectorySpec, where: str) -> TrajectorySpec:
    """One trajectory's lengths, outcomes and latencies; `where` starts the error message."""
    if not 1 <= spec.copies <= 1_000_000:
        raise InvalidArgument(f"{where}: copies={spec.copies}, must be in 1..1000000")
    if not 1 <= spec.prompt_tokens <= MAX_TOKENS:
        raise InvalidArgument(f"{where}: prompt_tokens={spec.prompt_tokens}, must be in 1..{MAX_TOKENS}")
    if not spec.turns:
        raise InvalidArgument(f"{where}: no turns; a trajectory needs at least one model turn")
    for index, turn in enumerate(spec.turns):
        at = f"{where} turn {index}"
        if not 0 <= turn.output_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"{at}: output_tokens={turn.output_tokens}, must be in 0..{MAX_TOKENS}")
        if index + 1 < len(spec.turns):
            if not turn.tool or turn.status not in STATUSES:
                raise InvalidArgument(f"{at}: a turn before the last needs a tool name and a status in "
                                      f"{STATUSES}, got tool={turn.tool!r} status={turn.status!r}")
            if not 0 <= turn.payload_tokens <= MAX_TOKENS:
                raise InvalidArgument(f"{at}: payload_tokens={turn.payload_tokens}, must be in 0..{MAX_TOKENS}")
            if not (math.isfinite(turn.latency_s) and 0 <= turn.latency_s <= MAX_LATENCY_S):
                raise InvalidArgument(f"{at}: latency_s={turn.latency_s}, must be in 0..{MAX_LATENCY_S:.0f}")
    if spec.output_tokens < 1:
        raise InvalidArgument(f"{where}: output_tokens={spec.output_tokens} over all turns; the model must "
                              f"generate >= 1 token in a trajectory")
    if spec.total_tokens > MAX_TOKENS:
        raise InvalidArgument(f"{where}: {spec.total_tokens} tokens in all (prompt + outputs + tool payloads); "
                              f"at most {MAX_TOKENS}")
    return spec
