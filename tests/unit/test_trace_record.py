"""Recorded traces: what the rollout service writes per trajectory, and what the simulators read."""

from __future__ import annotations

import json

import pytest

from libra.errors import InvalidArgument
from libra.trace_record import TraceWriter, load, record_of, turn_lengths
from libra.traces import files
from libra.v1 import common_pb2 as pb


def _trajectory(tid: str = "g1-0") -> pb.Trajectory:
    # prompt (5 tokens) | turn 0: 3 tokens | tool: 2 tokens | turn 1: 4 tokens | tool: 1 | turn 2: 2 tokens
    mask = [0] * 5 + [1] * 3 + [0] * 2 + [1] * 4 + [0] + [1] * 2
    versions = [0] * 5 + [2] * 3 + [2] * 2 + [3] * 4 + [3] + [3] * 2
    events = [pb.ToolEvent(turn=1, tool="calculator", status=pb.TOOL_STATUS_FAILURE, payload_tokens=1, seconds=0.5),
              pb.ToolEvent(turn=0, tool="calculator", status=pb.TOOL_STATUS_SUCCESS, payload_tokens=2, seconds=0.25)]
    return pb.Trajectory(trajectory_id=tid, prompt_id="7", prompt_length=5, token_ids=list(range(len(mask))),
                         loss_mask=mask, versions=versions, tool_events=events, reward=1.0, turns=3,
                         status=pb.TRAJECTORY_STATUS_COMPLETED, finished_at=123.0)


def test_turn_lengths_are_the_runs_of_trained_tokens():
    assert turn_lengths([0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]) == [2, 1, 3]
    assert turn_lengths([1, 1]) == [2] and turn_lengths([0, 0]) == []


def test_record_keeps_turns_tools_in_order_and_the_oldest_version():
    record = record_of(_trajectory())
    assert record["outputs"] == [3, 4, 2] and record["prompt_tokens"] == 5 and record["prompt_id"] == "7"
    assert [t["status"] for t in record["tools"]] == ["success", "failure"]  # sorted by turn
    assert record["version"] == 2 and record["status"] == "completed"


def test_a_trailing_tool_call_without_a_following_turn_is_dropped():
    traj = _trajectory()
    traj.tool_events.append(pb.ToolEvent(turn=2, tool="calculator", status=pb.TOOL_STATUS_TIMEOUT, seconds=5.0))
    assert len(record_of(traj)["tools"]) == 2


def test_writer_then_load_round_trip_and_failed_are_skipped(tmp_path):
    writer = TraceWriter(tmp_path / "run" / "trace.jsonl")
    writer.write(_trajectory("a"))
    failed = _trajectory("b")
    failed.status = pb.TRAJECTORY_STATUS_FAILED
    writer.write(failed)
    writer.close()
    assert [r["trajectory_id"] for r in load(tmp_path / "run" / "trace.jsonl")] == ["a"]
    assert len(list(load(tmp_path / "run" / "trace.jsonl", include_failed=True))) == 2


@pytest.mark.parametrize("patch, message", [
    ({"outputs": []}, "non-empty"),
    ({"outputs": [3, -1, 2]}, "0.."),
    ({"prompt_tokens": 10**9}, "0.."),
    ({"tools": []}, "need 2 tool calls"),
    ({"tools": [{"name": "c", "status": "ok"}, {"name": "c", "status": "success"}]}, "status must be"),
    ({"tools": [{"name": "c", "status": "success", "latency_s": -1}, {"name": "c", "status": "success"}]}, "latency"),
])
def test_bad_trace_lines_name_the_line_and_the_field(tmp_path, patch, message):
    record = {**record_of(_trajectory()), **patch}
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(record_of(_trajectory())) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(InvalidArgument, match=message) as error:
        list(load(path))
    assert f"{path}:2" in str(error.value)


def test_missing_file_and_non_json_are_clear_errors(tmp_path):
    with pytest.raises(InvalidArgument, match="does not exist"):
        list(load(tmp_path / "nope.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(InvalidArgument, match="bad.jsonl:1: not JSON"):
        list(load(tmp_path / "bad.jsonl"))


def test_recorded_trace_replays_real_lengths_and_outcomes_by_seed(tmp_path):
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(path)
    for i in range(5):
        writer.write(_trajectory(f"t{i}"))
    writer.close()
    recorded = files.read(path)
    first = files.sample(recorded, 20, seed=1, prefix="a-")
    assert len(first) == 20 and first[0].trajectory_id == "a-0"
    assert all(spec.outputs == (3, 4, 2) and spec.prompt_id == "7" for spec in first)
    assert [t.status for t in first[0].turns[:-1]] == ["success", "failure"] and first[0].turns[0].latency_s == 0.25
    assert files.sample(files.read(path), 20, seed=1, prefix="a-") == first
    assert [spec.trajectory_id for spec in recorded] == [f"t{i}" for i in range(5)]  # every line, in order
