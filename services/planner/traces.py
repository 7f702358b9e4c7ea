"""Multi-turn rollout traces for the cluster simulator: the format, its checks, loaders and a
synthetic drifting long-tailed generator.

A trace is one batch of trajectories per training step. A trajectory is a prompt and its model
turns; every turn but the last ends in a tool call (its structured outcome, payload tokens and
latency), as the rollout gateway reports them to the scheduler. A trajectory may stand for
`copies` identical ones: the simulator's resolution knob at cluster scale (a "cohort" is routed,
batched and trained as `copies` sequences, so the GPU work is exact while Python does 1/copies of
the bookkeeping).

File format (`.jsonl`, one trajectory per line; `#` lines and blank lines are skipped):

    {"step": 0, "trajectory_id": "s0-t3", "prompt_id": "p1", "prompt_tokens": 812, "copies": 1,
     "turns": [{"output_tokens": 240, "tool": "search", "status": "success",
                "payload_tokens": 3100, "latency_s": 1.4},
               {"output_tokens": 5200}]}

`step` is the training step whose batch the trajectory belongs to (steps 0..N-1, every step the
same number of trajectories, since the training layout must divide the batch). Two flat formats
are read too, as single-turn trajectories cut into batches of `batch` in file order (repeated
from the start when the file is shorter than steps x batch): CSV `prompt_tokens,output_tokens`
(like `configs/traces/agentic-longtail.csv`) and a runtime-history export (JSON lines of
`HistoryRecord`s; only `kind: "turn"` records count, as the rollout service writes them). A
trace a real run recorded (`RUN_DIR/trace.jsonl`, `libra.trace_record`: `outputs` and `tools` per
trajectory) keeps its turns and tool outcomes and is cut into batches the same way.

This module must not know about instances, policies or plans. Pure apart from file reading.
"""

from __future__ import annotations

import csv
import io
import json
import math
import pathlib
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from libra.errors import InvalidArgument
from libra.services.scheduler.signatures import STATUSES

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
    def output_tokens(self) -> int:
        return sum(turn.output_tokens for turn in self.turns)

    @property
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
        out = []
        for spec in self.steps[step]:
            out.extend([(spec.prompt_tokens + spec.payload_tokens, spec.output_tokens)] * spec.copies)
        return out

    def mean_tokens(self, step: int) -> float:
        batch = self.steps[step]
        return sum(s.total_tokens * s.copies for s in batch) / sum(s.copies for s in batch)


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
            _check_one(spec, step, trace.source)
            if spec.trajectory_id in seen:
                raise InvalidArgument(f"{trace.source}: trajectory_id {spec.trajectory_id!r} appears twice")
            seen.add(spec.trajectory_id)
    return trace


def _check_one(spec: TrajectorySpec, step: int, source: str) -> None:
    where = f"{source}: trajectory {spec.trajectory_id!r} (step {step})"
    if spec.step != step:
        raise InvalidArgument(f"{where} says step {spec.step}")
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
        raise InvalidArgument(f"{where}: the model generated no tokens in any turn; a trajectory needs >= 1")
    if spec.total_tokens > MAX_TOKENS:
        raise InvalidArgument(f"{where}: {spec.total_tokens} tokens in all (prompt + outputs + tool payloads); "
                              f"at most {MAX_TOKENS}")


# -- loaders -------------------------------------------------------------------------------------
def load(path: str | pathlib.Path, steps: int, batch: int) -> Trace:
    """A trace file in any of the three formats (see the module docstring)."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise InvalidArgument(f"cannot read trace {path}: {error.strerror}") from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    if not lines:
        raise InvalidArgument(f"trace {path} has no entries")
    first = lines[0][1]
    keys = json.loads(_json(path, *lines[0])) if first.startswith("{") else {}
    if "turns" in keys:
        return _trajectories(path, lines, steps)
    if "outputs" in keys:
        return _recorded(path, steps, batch)
    pairs = _history(path, lines) if first.startswith("{") else _csv(path, lines)
    return from_pairs(pairs, steps, batch, str(path))


def _json(path: pathlib.Path, number: int, line: str) -> str:
    try:
        json.loads(line)
    except json.JSONDecodeError as error:
        raise InvalidArgument(f"{path}:{number}: not JSON ({error.msg})") from None
    return line


def _trajectories(path: pathlib.Path, lines: Sequence[tuple[int, str]], steps: int) -> Trace:
    by_step: dict[int, list[TrajectorySpec]] = {}
    for number, line in lines:
        try:
            item = json.loads(line)
            turns = tuple(TurnSpec(int(t["output_tokens"]), str(t.get("tool", "")), str(t.get("status", "")),
                                   int(t.get("payload_tokens", 0)), float(t.get("latency_s", 0.0)))
                          for t in item["turns"])
            spec = TrajectorySpec(str(item.get("trajectory_id", f"l{number}")), str(item.get("prompt_id", "")),
                                  int(item["step"]), int(item["prompt_tokens"]), turns, int(item.get("copies", 1)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise InvalidArgument(f"{path}:{number}: expected a trajectory with step, prompt_tokens and turns "
                                  f"[{{output_tokens, tool, status, payload_tokens, latency_s}}] ({error!r})") from None
        by_step.setdefault(spec.step, []).append(spec)
    if sorted(by_step) != list(range(len(by_step))):
        raise InvalidArgument(f"{path}: steps must be 0..N-1 without gaps, got {sorted(by_step)[:10]}")
    if steps > len(by_step):
        raise InvalidArgument(f"{path} holds {len(by_step)} steps; asked to simulate {steps}")
    return check(Trace(tuple(tuple(by_step[s]) for s in range(steps)), str(path)))


def _recorded(path: pathlib.Path, steps: int, batch: int) -> Trace:
    """A trace a real run recorded (`libra.trace_record`), cut into batches in file order."""
    from libra import trace_record

    records = list(trace_record.load(path))
    if not records:
        raise InvalidArgument(f"{path}: no completed trajectories recorded")
    if steps < 1 or batch < 1:
        raise InvalidArgument(f"steps ({steps}) and batch ({batch}) must be >= 1")
    out = []
    for step in range(steps):
        specs = []
        for i in range(batch):
            record = records[(step * batch + i) % len(records)]
            tools = record["tools"] + [{}]
            turns = tuple(TurnSpec(int(o), str(t.get("name", "")), str(t.get("status", "")),
                                   int(t.get("payload_tokens", 0)), float(t.get("latency_s", 0.0)))
                          for o, t in zip(record["outputs"], tools))
            specs.append(TrajectorySpec(f"s{step}-{record['trajectory_id']}-{i}", str(record["prompt_id"]), step,
                                        max(1, int(record["prompt_tokens"])), turns))
        out.append(tuple(specs))
    return check(Trace(tuple(out), str(path)))


def _csv(path: pathlib.Path, lines: Sequence[tuple[int, str]]) -> list[tuple[int, int]]:
    pairs = []
    for number, line in lines:
        if line.lower().startswith("prompt"):
            continue
        try:
            prompt, output = next(csv.reader(io.StringIO(line)))[:2]
            pairs.append((int(prompt), int(output)))
        except (ValueError, StopIteration):
            raise InvalidArgument(f"{path}:{number}: expected prompt_tokens,output_tokens, got {line[:60]!r}") from None
    return pairs


def _history(path: pathlib.Path, lines: Sequence[tuple[int, str]]) -> list[tuple[int, int]]:
    pairs = []
    for number, line in lines:
        item = json.loads(_json(path, number, line))
        if item.get("kind", "turn") != "turn":
            continue
        try:
            prompt = item.get("prompt_tokens", item.get("promptTokens"))
            output = item.get("output_tokens", item.get("outputTokens"))
            pairs.append((int(prompt), int(output)))
        except (TypeError, ValueError):
            raise InvalidArgument(f"{path}:{number}: a turn record needs prompt_tokens and output_tokens") from None
    return pairs


def from_pairs(pairs: Sequence[tuple[int, int]], steps: int, batch: int, source: str = "pairs") -> Trace:
    """Single-turn trajectories in batches of `batch`, the pairs repeated in order to fill `steps`."""
    if not pairs:
        raise InvalidArgument(f"{source}: no (prompt_tokens, output_tokens) entries")
    if steps < 1 or batch < 1:
        raise InvalidArgument(f"steps ({steps}) and batch ({batch}) must be >= 1")
    out = []
    for step in range(steps):
        specs = []
        for i in range(batch):
            index = (step * batch + i) % len(pairs)
            prompt, output = pairs[index]
            specs.append(TrajectorySpec(f"s{step}-r{i}", f"r{index}", step, prompt, (TurnSpec(output),)))
        out.append(tuple(specs))
    return check(Trace(tuple(out), source))


def dump(trace: Trace) -> Iterable[str]:
    """The trace as JSON lines in the file format above."""
    for specs in trace.steps:
        for spec in specs:
            turns = [{"output_tokens": t.output_tokens, **({"tool": t.tool, "status": t.status,
                      "payload_tokens": t.payload_tokens, "latency_s": round(t.latency_s, 3)} if t.tool else {})}
                     for t in spec.turns]
            yield json.dumps({"step": spec.step, "trajectory_id": spec.trajectory_id, "prompt_id": spec.prompt_id,
                              "prompt_tokens": spec.prompt_tokens, "copies": spec.copies, "turns": turns})


# -- synthetic drifting long-tailed trace --------------------------------------------------------
# class -> first tool (name, status, payload range), output tokens in all (range, before drift),
#          model turns (range), tool between later turns
CLASSES = {
    "short": (("calc", "failure", (5, 60)), (300, 1_500), (2, 2), ("calc", "success", (5, 60))),
    "medium": (("search", "success", (60, 250)), (1_500, 6_000), (2, 4), ("python", "success", (20, 200))),
    "long": (("search", "success", (2_000, 5_000)), (6_000, 20_000), (3, 6), ("search", "success", (300, 1_500))),
}


def synthetic(steps: int, prompts_per_step: int, group_size: int, seed: int = 0, drift: float = 1.0,
              copies: int = 1) -> Trace:
    """A drifting long-tailed agentic trace: the lengths grow as training proceeds.

    At progress p = step / (steps - 1), output lengths are scaled by (1 + drift * p) and a prompt's
    share of long trajectories by (1 + drift * p) too (capped at 0.6), so late steps are longer on
    average and in the tail. The first tool outcome predicts a trajectory's class (what C-MLFQ
    learns from); output lengths are log-uniform inside a class. Each generated trajectory stands
    for `copies` identical ones (`copies` must divide prompts_per_step * group_size).
    """
    batch = prompts_per_step * group_size
    if steps < 1 or prompts_per_step < 1 or group_size < 1:
        raise InvalidArgument(f"steps ({steps}), prompts_per_step ({prompts_per_step}) and group_size "
                              f"({group_size}) must be >= 1")
    if copies < 1 or batch % copies:
        raise InvalidArgument(f"copies ({copies}) must divide the batch of {batch} trajectories")
    if not 0 <= drift <= 10:
        raise InvalidArgument(f"drift must be in 0..10 (lengths grow by 1 + drift over the run), got {drift}")
    rng = random.Random(seed)
    pool = max(1, prompts_per_step * 4)
    p_long = [rng.choice((0.05, 0.1, 0.2)) for _ in range(pool)]
    prompt_len = [int(min(8_000, rng.lognormvariate(6.7, 0.5))) + 16 for _ in range(pool)]
    out = []
    for step in range(steps):
        growth = 1.0 + drift * (step / (steps - 1) if steps > 1 else 0.0)
        specs = []
        for unit in range(batch // copies):
            prompt = (step * prompts_per_step + unit * copies // group_size) % pool
            specs.append(_trajectory(rng, f"s{step}-u{unit}", f"p{prompt}", step, prompt_len[prompt],
                                     min(0.6, p_long[prompt] * growth), growth, copies))
        out.append(tuple(specs))
    return check(Trace(tuple(out), f"synthetic(seed={seed}, drift={drift})"))


def _trajectory(rng: random.Random, tid: str, prompt_id: str, step: int, prompt_tokens: int, p_long: float,
                growth: float, copies: int) -> TrajectorySpec:
    draw = rng.random()
    cls = "long" if draw < p_long else "medium" if draw < p_long + 0.35 else "short"
    first, (low, high), (t_low, t_high), later = CLASSES[cls]
    turns = rng.randint(t_low, t_high)
    total = max(turns, int(low * (high / low) ** rng.random() * growth))
    cuts = sorted(rng.sample(range(1, total), turns - 1)) if turns > 1 else []
    outputs = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    specs = []
    for index, output in enumerate(outputs):
        if index + 1 == len(outputs):
            specs.append(TurnSpec(output))
            continue
        name, status, (p_low, p_high) = first if index == 0 else later
        latency = min(60.0, rng.lognormvariate(0.0, 0.8) * (2.0 if name == "search" else 0.5))
        specs.append(TurnSpec(output, name, status, rng.randint(p_low, p_high), latency))
    return TrajectorySpec(tid, prompt_id, step, prompt_tokens, tuple(specs), copies)
