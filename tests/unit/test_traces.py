"""Traces (libra.traces): the generated traces, every file format, and clear errors for bad input."""

from __future__ import annotations

import json
import pickle

import pytest

from libra.errors import InvalidArgument
from libra.traces import files, synthetic
from libra.traces.spec import Pairs, Trace, TrajectorySpec, TurnSpec, check, pairs


def test_the_synthetic_trace_is_deterministic_by_seed():
    assert synthetic.drifting(3, 4, 4, seed=7) == synthetic.drifting(3, 4, 4, seed=7)
    assert synthetic.drifting(3, 4, 4, seed=7) != synthetic.drifting(3, 4, 4, seed=8)


def test_drifting_lengths_grow_over_steps_and_stay_put_without_drift():
    drifting = synthetic.drifting(20, 16, 8, seed=0, drift=1.0)
    first = sum(drifting.mean_tokens(s) for s in range(4)) / 4
    last = sum(drifting.mean_tokens(s) for s in range(16, 20)) / 4
    assert last > 1.6 * first
    flat = synthetic.drifting(20, 16, 8, seed=0, drift=0.0)
    early = sum(flat.mean_tokens(s) for s in range(4)) / 4
    late = sum(flat.mean_tokens(s) for s in range(16, 20)) / 4
    assert 0.8 < late / early < 1.25


def test_synthetic_turns_are_multi_turn_with_tools_between_turns():
    trace = synthetic.drifting(2, 8, 4, seed=3)
    for spec in trace.steps[1]:
        assert spec.step == 1 and len(spec.turns) >= 2
        assert all(t.tool and t.status in ("success", "failure") for t in spec.turns[:-1])
        assert not spec.turns[-1].tool


def test_copies_keep_the_batch_and_must_divide_it():
    trace = synthetic.drifting(2, 8, 8, seed=0, copies=4)
    assert trace.batch == 64 and len(trace.steps[0]) == 16 and len(trace.pairs(0)) == 64
    with pytest.raises(InvalidArgument, match="copies"):
        synthetic.drifting(2, 8, 8, seed=0, copies=3)


def test_trajectory_jsonl_round_trips(tmp_path):
    trace = synthetic.drifting(3, 2, 4, seed=5)
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(files.dump(trace)) + "\n")
    loaded = files.load(path, steps=3, batch=999)  # the batch comes from the file
    assert [[(s.trajectory_id, s.prompt_tokens, [t.output_tokens for t in s.turns]) for s in step]
            for step in loaded.steps] == \
           [[(s.trajectory_id, s.prompt_tokens, [t.output_tokens for t in s.turns]) for s in step]
            for step in trace.steps]


def test_csv_and_history_exports_become_single_turn_batches(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("# comment\nprompt_tokens,output_tokens\n100,20\n200,30\n300,40\n")
    trace = files.load(csv, steps=2, batch=2)
    assert [[(s.prompt_tokens, s.output_tokens) for s in step] for step in trace.steps] == \
           [[(100, 20), (200, 30)], [(300, 40), (100, 20)]]  # repeated in order to fill the steps
    history = tmp_path / "h.jsonl"
    history.write_text("\n".join(json.dumps(r) for r in [
        {"kind": "turn", "promptTokens": 50, "outputTokens": 7}, {"kind": "step", "seconds": 3.0},
        {"kind": "turn", "prompt_tokens": 60, "output_tokens": 8}]))
    assert files.load(history, steps=1, batch=2).pairs(0) == [(50, 7), (60, 8)]


def test_a_recorded_run_trace_keeps_turns_and_tools(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"trajectory_id": "g1-0", "prompt_id": "7", "prompt_tokens": 41, "outputs": [23, 9],
                                "tools": [{"name": "calculator", "status": "success", "payload_tokens": 6,
                                           "latency_s": 0.5}], "status": "completed"}) + "\n")
    spec = files.load(path, steps=2, batch=1).steps[1][0]
    assert spec.turns == (TurnSpec(23, "calculator", "success", 6, 0.5), TurnSpec(9))


@pytest.mark.parametrize("line, match", [
    ("100,-5", "output_tokens=-5"),
    ("-3,40", "prompt_tokens=-3"),
    ("100,50000000", "output_tokens=50000000"),
    ("100,abc", "expected prompt_tokens,output_tokens"),
])
def test_bad_csv_lengths_are_named(tmp_path, line, match):
    path = tmp_path / "bad.csv"
    path.write_text(f"prompt_tokens,output_tokens\n10,10\n{line}\n")
    with pytest.raises(InvalidArgument, match=match):
        files.load(path, steps=1, batch=2)


def test_bad_trajectories_are_named():
    good = TrajectorySpec("a", "p", 0, 10, (TurnSpec(5, "calc", "success", 3, 0.1), TurnSpec(5)))
    with pytest.raises(InvalidArgument, match="status"):
        check(Trace(((TrajectorySpec("a", "p", 0, 10, (TurnSpec(5, "calc", "error?"), TurnSpec(5))),),)))
    with pytest.raises(InvalidArgument, match="latency_s"):
        check(Trace(((TrajectorySpec("a", "p", 0, 10, (TurnSpec(5, "calc", "success", 1, -1.0),
                                                              TurnSpec(5))),),)))
    with pytest.raises(InvalidArgument, match="same size"):
        check(Trace(((good,), (TrajectorySpec("b", "p", 1, 10, (TurnSpec(5),), copies=2),))))
    with pytest.raises(InvalidArgument, match="appears twice"):
        check(Trace(((good,), (TrajectorySpec("a", "p", 1, 10, (TurnSpec(5),)),))))
    with pytest.raises(InvalidArgument, match="no trajectories"):
        check(Trace(((),)))


def test_missing_files_and_fields_are_named(tmp_path):
    with pytest.raises(InvalidArgument, match="cannot read trace"):
        files.load(tmp_path / "missing.jsonl", 1, 1)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"step": 0, "turns": [{"output_tokens": 3}]}) + "\n")
    with pytest.raises(InvalidArgument, match="prompt_tokens"):
        files.load(path, 1, 1)
    path.write_text(json.dumps({"step": 0, "prompt_tokens": 3, "turns": [{"output_tokens": 3}]}) + "\n")
    with pytest.raises(InvalidArgument, match="holds 1 steps"):
        files.load(path, 2, 1)


def test_the_shipped_sample_is_what_its_header_says():
    lines = [line for line in open("configs/traces/agentic-drift-sample.jsonl").read().splitlines()
             if line and not line.startswith("#")]
    assert list(files.dump(synthetic.drifting(4, 4, 4, seed=0, drift=1.0))) == lines


@pytest.mark.parametrize("path, count, turns", [
    ("configs/traces/agentic-drift-sample.jsonl", 64, True),  # trajectory JSONL
    ("configs/traces/agentic-longtail.csv", 512, False),  # CSV pairs
    ("benchmarks/results/quickstart-trace.jsonl", 5335, True),  # a run's recording (one failed line left out)
])
def test_one_reader_reads_every_shipped_format(path, count, turns):
    specs = files.read(path)
    assert len(specs) == count and len({s.trajectory_id for s in specs}) == count
    assert any(len(s.turns) > 1 for s in specs) == turns
    assert all(s.output_tokens >= 1 and s.prompt_tokens >= 1 for s in specs)


def test_pairs_files_may_mix_csv_and_json_lines_and_errors_name_the_line(tmp_path):
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("prompt_tokens,output_tokens\n10,20\n{\"prompt_tokens\": 5, \"output_tokens\": 7}\n"
                     "{\"kind\": \"step\", \"seconds\": 1.0}\n")
    assert [(s.prompt_tokens, s.output_tokens) for s in files.read(mixed)] == [(10, 20), (5, 7)]
    mixed.write_text("10,20\n10,0\n")
    with pytest.raises(InvalidArgument, match=r"mixed.csv:2: output_tokens=0"):
        files.read(mixed)


def test_sample_draws_by_seed_and_renames():
    specs = synthetic.drifting(1, 2, 4, seed=1).steps[0]
    drawn = files.sample(specs, 10, seed=3, prefix="x")
    assert [s.trajectory_id for s in drawn] == [f"x{i}" for i in range(10)]
    assert files.sample(specs, 10, seed=3, prefix="x") == drawn != files.sample(specs, 10, seed=4, prefix="x")
    assert {(s.prompt_id, s.turns) for s in drawn} <= {(s.prompt_id, s.turns) for s in specs}


def test_equal_depth_recuts_every_trajectory_to_the_same_number_of_tool_calls():
    plain, even = synthetic.no_signal(200, 4), synthetic.equal_depth(200, 4, tool_calls=3)
    assert {len(spec.turns) for spec in plain} != {4} and {len(spec.turns) for spec in even} == {4}
    for before, after in zip(synthetic.signal(200, 4), even):
        assert after.output_tokens == before.output_tokens and after.outputs[0] == before.outputs[0]
        assert after.prompt_id == before.prompt_id and all(output >= 1 for output in after.outputs)
        assert all(turn.tool and turn.status for turn in after.turns[:-1]) and not after.turns[-1].tool
    assert synthetic.equal_depth(200, 4) == even  # deterministic; 3 calls by default
    with pytest.raises(InvalidArgument, match="tool_calls must be in 1..64"):
        synthetic.no_signal(10, 1, tool_calls=0)


def test_a_batch_copy_names_its_batch_and_its_original():
    specs = [TrajectorySpec("g0-s1", "7", 0, 5, (TurnSpec(3),)), TrajectorySpec("g1-s0", "8", 0, 5, (TurnSpec(4),))]
    trace = files.batches(specs, 3, 1)
    assert [files.copy_of(s.trajectory_id) for step in trace.steps for s in step] == [
        (0, "g0-s1"), (1, "g1-s0"), (2, "g0-s1")]
    assert files.copy_of("g0-s1") is None  # not a copy


def test_pairs_built_when_read_are_the_length_pairs_of_every_copy():
    """A simulated step's lengths (`Pairs`): the same pairs as `pairs()`, one per copy, expanded only
    when read, and kept through a pickle (a simulation's checkpoint)."""
    specs = (TrajectorySpec("a", "p", 0, 10, (TurnSpec(5, "calc", "success", 3, 0.1), TurnSpec(7)), copies=3),
             TrajectorySpec("b", "q", 0, 4, (TurnSpec(2),)))
    lazy = Pairs(specs)
    assert len(lazy) == 4 and lazy._pairs is None  # its length costs no expansion
    assert list(lazy) == pairs(specs) == [(13, 12)] * 3 + [(4, 2)]
    assert lazy[-1] == (4, 2) and lazy[1:3] == [(13, 12)] * 2
    assert list(pickle.loads(pickle.dumps(lazy))) == pairs(specs)  # a simulation's checkpoint holds its records
    assert lazy == Pairs(specs) == pairs(specs) and lazy != Pairs(specs[:1]) and lazy != "pairs"  # step records compare
    assert specs[0].output_tokens == 12 and specs[0].payload_tokens == 3
