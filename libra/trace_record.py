"""Recorded trajectory traces: what a real run played, in a form the simulator replays.

The rollout service appends one JSON line per finished trajectory to `RUN_DIR/trace.jsonl` (on
by default: `rollout.record_trace`). A line keeps what routing and capacity planning need and
nothing else (no token ids, no text):

    {"trajectory_id": "g12-3", "prompt_id": "7", "prompt_tokens": 41,
     "outputs": [23, 9, 14],                      # tokens the model generated, per model turn
     "tools": [{"name": "calculator", "status": "success", "payload_tokens": 6, "latency_s": 0.002},
               ...],                                # the tool call after each turn but the last
     "reward": 1.0, "version": 3, "status": "completed", "finished_at": 1764500000.0}

Per-turn outputs come from the loss mask: each maximal run of trained-on tokens is one model turn
(tool results are masked out between them). A trajectory that stopped after a tool call (turn or
token budget) keeps that trailing call in `tools` only if another turn followed it, so that
`len(tools) == len(outputs) - 1` always holds; failed trajectories are recorded with their status
and skipped by `load` unless asked for. This module owns the line format (writing and validating
it); `libra.traces.files.read` turns a recording into the `TrajectorySpec`s every simulation plays.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterator

from libra.errors import InvalidArgument
from libra.v1 import common_pb2

STATUS_NAMES = {common_pb2.TOOL_STATUS_SUCCESS: "success", common_pb2.TOOL_STATUS_FAILURE: "failure",
                common_pb2.TOOL_STATUS_TIMEOUT: "timeout"}
KNOWN_STATUSES = frozenset(STATUS_NAMES.values())
MAX_TOKENS = 10_000_000


def turn_lengths(loss_mask) -> list[int]:
    """Lengths of the maximal runs of 1s in a loss mask: the model turns, in order."""
    runs, current = [], 0
    for bit in loss_mask:
        if bit:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs


def record_of(trajectory: common_pb2.Trajectory) -> dict[str, Any]:
    """The trace line of a finished trajectory."""
    outputs = turn_lengths(trajectory.loss_mask)
    tools = [{"name": e.tool, "status": STATUS_NAMES.get(e.status, "failure"), "payload_tokens": e.payload_tokens,
              "latency_s": round(e.seconds, 6)} for e in sorted(trajectory.tool_events, key=lambda e: e.turn)]
    versions = [v for v, bit in zip(trajectory.versions, trajectory.loss_mask) if bit]
    return {"trajectory_id": trajectory.trajectory_id, "prompt_id": trajectory.prompt_id,
            "prompt_tokens": trajectory.prompt_length, "outputs": outputs, "tools": tools[:max(0, len(outputs) - 1)],
            "reward": trajectory.reward, "version": min(versions) if versions else 0,
            "status": common_pb2.TrajectoryStatus.Name(trajectory.status)[len("TRAJECTORY_STATUS_"):].lower(),
            "finished_at": trajectory.finished_at}


class TraceWriter:
    """Appends trace lines to a file; each line is flushed, so a killed service loses none written."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, trajectory: common_pb2.Trajectory) -> None:
        self._file.write(json.dumps(record_of(trajectory), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _check(line_no: int, record: dict[str, Any], source: str) -> dict[str, Any]:
    where = f"{source}:{line_no}"
    for key in ("trajectory_id", "prompt_id", "prompt_tokens", "outputs", "tools"):
        if key not in record:
            raise InvalidArgument(f"{where}: missing field {key!r} (a trace line needs trajectory_id, prompt_id, "
                                  "prompt_tokens, outputs, tools)")
    outputs, tools = record["outputs"], record["tools"]
    if not isinstance(outputs, list) or not outputs:
        raise InvalidArgument(f"{where}: outputs must be a non-empty list of per-turn token counts")
    for value in [record["prompt_tokens"], *outputs]:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKENS:
            raise InvalidArgument(f"{where}: token counts must be integers in 0..{MAX_TOKENS}, got {value!r}")
    if len(tools) != len(outputs) - 1:
        raise InvalidArgument(f"{where}: {len(outputs)} turns need {len(outputs) - 1} tool calls between them, "
                              f"got {len(tools)}")
    for tool in tools:
        if tool.get("status") not in KNOWN_STATUSES:
            raise InvalidArgument(f"{where}: tool status must be one of {sorted(KNOWN_STATUSES)}, "
                                  f"got {tool.get('status')!r}")
        latency = tool.get("latency_s", 0.0)
        if not isinstance(latency, (int, float)) or not 0 <= latency <= 86_400:
            raise InvalidArgument(f"{where}: tool latency_s must be in 0..86400 seconds, got {latency!r}")
        payload = tool.get("payload_tokens", 0)
        if not isinstance(payload, int) or not 0 <= payload <= MAX_TOKENS:
            raise InvalidArgument(f"{where}: payload_tokens must be an integer in 0..{MAX_TOKENS}, got {payload!r}")
    return record


def load(path: str | pathlib.Path, include_failed: bool = False) -> Iterator[dict[str, Any]]:
    """Validated trace lines of a recorded trace; a bad line is an error naming the file and line."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InvalidArgument(f"trace file {path} does not exist (a run writes RUN_DIR/trace.jsonl when "
                              "rollout.record_trace is on)")
    with path.open(encoding="utf-8") as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InvalidArgument(f"{path}:{line_no}: not JSON ({error.msg})") from error
            if not isinstance(record, dict):
                raise InvalidArgument(f"{path}:{line_no}: a trace line is a JSON object")
            if include_failed or record.get("status", "completed") == "completed":
                yield _check(line_no, record, str(path))
