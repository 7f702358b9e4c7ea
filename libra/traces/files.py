"""Reading and writing trace files: every format the project writes or ships, into `TrajectorySpec`s.

    trajectory JSONL   one trajectory per line with the training step it belongs to (what `dump`
                       writes; configs/traces/agentic-drift-sample.jsonl):
        {"step": 0, "trajectory_id": "s0-t3", "prompt_id": "p1", "prompt_tokens": 812, "copies": 1,
         "turns": [{"output_tokens": 240, "tool": "search", "status": "success",
                    "payload_tokens": 3100, "latency_s": 1.4},
                   {"output_tokens": 5200}]}
    run recording      RUN_DIR/trace.jsonl as `libra.trace_record` writes it (`outputs` and `tools`
                       per trajectory; failed trajectories are left out)
    length pairs       single-turn trajectories, one per line: CSV `prompt_tokens,output_tokens`
                       (configs/traces/agentic-longtail.csv) or a JSON object with those fields, as a
                       runtime-history export holds them (`HistoryRecord`s: only `kind: "turn"`
                       records count; camelCase keys too)

The format is told by the first entry (`#` lines and blank lines are skipped). `read` gives the
trajectories in file order; `load` cuts them into training steps: a trajectory JSONL by its own
steps, the others into batches of `batch` in file order (repeated from the start when the file
is shorter than steps x batch). Every entry is checked (`spec.check_spec`); an error names the
file and line. Pure apart from file reading.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import pathlib
import random
import re
from typing import Iterable, Sequence

from libra import trace_record
from libra.errors import InvalidArgument
from libra.traces.spec import Trace, TrajectorySpec, TurnSpec, check, check_spec


def read(path: str | pathlib.Path) -> list[TrajectorySpec]:
    """The trajectories of a trace file in any of the formats above, in file order."""
    return _read(pathlib.Path(path))[0]


def load(path: str | pathlib.Path, steps: int, batch: int) -> Trace:
    """A trace file as `steps` training steps (see the module docstring for how it is cut)."""
    path = pathlib.Path(path)
    specs, stepped = _read(path)
    if not stepped:
        return batches(specs, steps, batch, str(path))
    by_step: dict[int, list[TrajectorySpec]] = {}
    for spec in specs:
        by_step.setdefault(spec.step, []).append(spec)
    if sorted(by_step) != list(range(len(by_step))):
        raise InvalidArgument(f"{path}: steps must be 0..N-1 without gaps, got {sorted(by_step)[:10]}")
    if steps > len(by_step):
        raise InvalidArgument(f"{path} holds {len(by_step)} steps; asked to simulate {steps}")
    return check(Trace(tuple(tuple(by_step[s]) for s in range(steps)), str(path)))


def batches(specs: Sequence[TrajectorySpec], steps: int, batch: int, source: str = "trace") -> Trace:
    """`steps` batches of `batch` trajectories taken in order (repeated from the start as needed);
    each copy gets the id `s{step}-{id}-{index in batch}`."""
    if not specs:
        raise InvalidArgument(f"{source}: no trajectories to cut into batches")
    if steps < 1 or batch < 1:
        raise InvalidArgument(f"steps ({steps}) and batch ({batch}) must be >= 1")
    out = []
    for step in range(steps):
        chosen = (specs[(step * batch + i) % len(specs)] for i in range(batch))
        out.append(tuple(dataclasses.replace(spec, trajectory_id=f"s{step}-{spec.trajectory_id}-{i}", step=step)
                         for i, spec in enumerate(chosen)))
    return check(Trace(tuple(out), source))


COPY_ID = re.compile(r"s(\d+)-(.+)-\d+")


def copy_of(trajectory_id: str) -> tuple[int, str] | None:
    """(batch, original id) of a copy `batches` named; None for any other id."""
    match = COPY_ID.fullmatch(trajectory_id)
    return (int(match.group(1)), match.group(2)) if match else None


def from_pairs(pairs: Sequence[tuple[int, int]], steps: int, batch: int, source: str = "pairs") -> Trace:
    """Single-turn trajectories from (prompt_tokens, output_tokens) pairs, cut like `batches`."""
    if not pairs:
        raise InvalidArgument(f"{source}: no (prompt_tokens, output_tokens) entries")
    return batches([_single(index, prompt, output) for index, (prompt, output) in enumerate(pairs)],
                   steps, batch, source)


def sample(specs: Sequence[TrajectorySpec], n: int, seed: int, prefix: str = "t") -> list[TrajectorySpec]:
    """`n` trajectories drawn with replacement by `seed`, renamed `{prefix}{i}` (prompt ids kept, so
    a policy learns across draws of the same prompt as it did in the run)."""
    if not specs:
        raise InvalidArgument("cannot sample from an empty trace")
    rng = random.Random(seed)
    return [dataclasses.replace(specs[rng.randrange(len(specs))], trajectory_id=f"{prefix}{i}") for i in range(n)]


def dump(trace: Trace) -> Iterable[str]:
    """The trace as trajectory JSONL lines."""
    for specs in trace.steps:
        for spec in specs:
            turns = [{"output_tokens": t.output_tokens, **({"tool": t.tool, "status": t.status,
                      "payload_tokens": t.payload_tokens, "latency_s": round(t.latency_s, 3)} if t.tool else {})}
                     for t in spec.turns]
            yield json.dumps({"step": spec.step, "trajectory_id": spec.trajectory_id, "prompt_id": spec.prompt_id,
                              "prompt_tokens": spec.prompt_tokens, "copies": spec.copies, "turns": turns})


# -- the formats ---------------------------------------------------------------------------------
def _read(path: pathlib.Path) -> tuple[list[TrajectorySpec], bool]:
    """(trajectories, whether they carry their own training steps)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise InvalidArgument(f"cannot read trace {path}: {error.strerror}") from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    if not lines:
        raise InvalidArgument(f"trace {path} has no entries")
    first = _json(path, *lines[0]) if lines[0][1].startswith("{") else {}
    if "turns" in first:
        return [_trajectory(path, number, line) for number, line in lines], True
    if "outputs" in first:
        return _recorded(path), False
    return _pairs(path, lines), False


def _json(path: pathlib.Path, number: int, line: str) -> dict:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise InvalidArgument(f"{path}:{number}: not JSON ({error.msg})") from None
    if not isinstance(item, dict):
        raise InvalidArgument(f"{path}:{number}: a trace entry is a JSON object")
    return item


def _trajectory(path: pathlib.Path, number: int, line: str) -> TrajectorySpec:
    item = _json(path, number, line)
    try:
        turns = tuple(TurnSpec(int(t["output_tokens"]), str(t.get("tool", "")), str(t.get("status", "")),
                               int(t.get("payload_tokens", 0)), float(t.get("latency_s", 0.0)))
                      for t in item["turns"])
        spec = TrajectorySpec(str(item.get("trajectory_id", f"l{number}")), str(item.get("prompt_id", "")),
                              int(item["step"]), int(item["prompt_tokens"]), turns, int(item.get("copies", 1)))
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise InvalidArgument(f"{path}:{number}: expected a trajectory with step, prompt_tokens and turns "
                              f"[{{output_tokens, tool, status, payload_tokens, latency_s}}] ({error!r})") from None
    return check_spec(spec, f"{path}:{number}")


def _recorded(path: pathlib.Path) -> list[TrajectorySpec]:
    """A run's recording (validated line by line by `trace_record.load`). A prompt recorded with 0
    tokens counts as 1, so that every trajectory has a context to prefill."""
    specs = []
    for record in trace_record.load(path):
        tools = record["tools"] + [{}]
        turns = tuple(TurnSpec(int(o), str(t.get("name", "")), str(t.get("status", "")),
                               int(t.get("payload_tokens", 0)), float(t.get("latency_s", 0.0)))
                      for o, t in zip(record["outputs"], tools))
        spec = TrajectorySpec(str(record["trajectory_id"]), str(record["prompt_id"]), 0,
                              max(1, int(record["prompt_tokens"])), turns)
        specs.append(check_spec(spec, f"{path}: trajectory {spec.trajectory_id!r}"))
    if not specs:
        raise InvalidArgument(f"{path}: no completed trajectories recorded")
    return specs


def _pairs(path: pathlib.Path, lines: Sequence[tuple[int, str]]) -> list[TrajectorySpec]:
    specs: list[TrajectorySpec] = []
    for number, line in lines:
        if line.startswith("{"):
            item = _json(path, number, line)
            if item.get("kind", "turn") != "turn":
                continue
            try:
                prompt = int(item.get("prompt_tokens", item.get("promptTokens")))
                output = int(item.get("output_tokens", item.get("outputTokens")))
            except (TypeError, ValueError):
                raise InvalidArgument(f"{path}:{number}: a turn record needs prompt_tokens and output_tokens") from None
        elif line.lower().startswith("prompt"):
            continue  # the CSV header
        else:
            try:
                prompt, output = (int(field) for field in next(csv.reader(io.StringIO(line)))[:2])
            except (ValueError, StopIteration):
                raise InvalidArgument(f"{path}:{number}: expected prompt_tokens,output_tokens, "
                                      f"got {line[:60]!r}") from None
        specs.append(check_spec(_single(len(specs), prompt, output), f"{path}:{number}"))
    if not specs:
        raise InvalidArgument(f"{path}: no (prompt_tokens, output_tokens) entries")
    return specs


def _single(index: int, prompt: int, output: int) -> TrajectorySpec:
    return TrajectorySpec(f"r{index}", f"r{index}", 0, prompt, (TurnSpec(output),))
