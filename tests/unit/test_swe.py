"""SWE repair: R2E-Gym-format tasks, the file tools on a private checkout, and the test-based reward."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

from libra.errors import ConfigError
from libra.workloads.base import FinalAnswer, Malformed, ToolCall, ToolStatus, TurnBudget, build_workload
from libra.workloads.swe import SweConfig, load_tasks, parse_test_report

BUDGET = TurnBudget(8, 128, 4096)


@pytest.fixture(scope="module")
def workload():
    return build_workload(SweConfig())


def call(episode, name: str, **arguments):
    return asyncio.run(episode.call_tool(ToolCall("call", json.dumps({"name": name, "arguments": arguments})), 20.0))


def test_shipped_tasks_have_the_r2e_gym_fields():
    tasks = load_tasks("configs/data/swe/tasks.jsonl")
    assert len(tasks) == 3
    for task in tasks:
        assert task["FAIL_TO_PASS"] and task["PASS_TO_PASS"] and task["problem_statement"] and task["patch"]
        assert not set(task["FAIL_TO_PASS"]) & set(task["PASS_TO_PASS"])


def test_the_reference_fix_resolves_and_the_snapshot_does_not(workload):
    task = workload.tasks[2]
    episode = workload.episode(2, 0, 0, BUDGET)
    try:
        assert asyncio.run(episode.reward(FinalAnswer("done"))) == 0.0  # the snapshot fails FAIL_TO_PASS
        failing = call(episode, "run_tests")
        assert failing.status is ToolStatus.FAILURE and "FAILED" in failing.payload
        for edit in task["fix_edits"]:
            assert call(episode, "edit", **edit).status is ToolStatus.SUCCESS
        passing = call(episode, "run_tests")
        assert passing.status is ToolStatus.SUCCESS and "FAILED" not in passing.payload
        assert asyncio.run(episode.reward(FinalAnswer("done"))) == 1.0
        assert asyncio.run(episode.reward(None)) == 0.0  # no answer: no reward
    finally:
        asyncio.run(episode.close())
    assert not episode.checkout.root.exists()
    original = pathlib.Path(task["repo_dir"]) / task["fix_edits"][0]["path"]
    assert task["fix_edits"][0]["old"] in original.read_text()  # the snapshot itself never changes


def test_a_fix_that_breaks_pass_to_pass_scores_zero(workload):
    episode = workload.episode(1, 0, 0, BUDGET)  # ledger: largest() by absolute amount
    try:
        path = "ledger/book.py"
        fixed = call(episode, "edit", path=path, old="cents > best[1]", new="abs(cents) > abs(best[1])")
        assert fixed.status is ToolStatus.SUCCESS
        broken = call(episode, "edit", path=path, old="return best[0] if best else None", new="return best[0]")
        assert broken.status is ToolStatus.SUCCESS  # the empty book now raises: a PASS_TO_PASS test fails
        assert asyncio.run(episode.reward(FinalAnswer("done"))) == 0.0
    finally:
        asyncio.run(episode.close())


def test_editing_the_tests_does_not_earn_the_reward(workload):
    episode = workload.episode(0, 0, 0, BUDGET)
    try:
        for old in ('assert slugify("Hello World") == "hello-world"', 'assert slugify("Ready, Set... Go!") == "ready-set-go"'):
            assert call(episode, "edit", path="tests/test_core.py", old=old, new="pass").status is ToolStatus.SUCCESS
        assert call(episode, "run_tests").status is ToolStatus.SUCCESS  # the edited tests pass ...
        assert asyncio.run(episode.reward(FinalAnswer("done"))) == 0.0  # ... the task's own tests do not
    finally:
        asyncio.run(episode.close())


def test_file_tools_stay_inside_the_checkout(workload, tmp_path):
    episode = workload.episode(0, 0, 0, BUDGET)
    try:
        assert "slugify" in call(episode, "view_file", path="slugkit/core.py").payload
        assert "tests/test_core.py" in call(episode, "view_file", path=".").payload
        assert "slugkit/core.py:6" in call(episode, "search", pattern="def slugify").payload
        for path in ("../../../etc/passwd", "/etc/passwd/../../etc/passwd", ""):
            assert call(episode, "view_file", path=path).status is ToolStatus.FAILURE
        (episode.checkout.root / "link").symlink_to("/etc")
        assert call(episode, "view_file", path="link/passwd").status is ToolStatus.FAILURE
        assert call(episode, "edit", path="slugkit/core.py", old="missing", new="x").status is ToolStatus.FAILURE
        assert call(episode, "edit", path="slugkit/core.py", old="separator", new="x").status is ToolStatus.FAILURE
        assert call(episode, "nope").status is ToolStatus.FAILURE
        assert call(episode, "view_file", wrong="x").status is ToolStatus.FAILURE
        bad_json = asyncio.run(episode.call_tool(ToolCall("call", "{not json"), 5.0))
        assert bad_json.status is ToolStatus.FAILURE and bad_json.tool == "format"
    finally:
        asyncio.run(episode.close())


def test_a_looping_test_run_times_out(workload):
    episode = workload.episode(2, 0, 0, BUDGET)
    try:
        call(episode, "edit", path="spans/merge.py", old="    merged = []", new="    merged = []\n    while True:\n        pass")
        result = asyncio.run(episode.call_tool(ToolCall("call", '{"name": "run_tests", "arguments": {}}'), 2.0))
        assert result.status is ToolStatus.TIMEOUT
    finally:
        asyncio.run(episode.close())


def test_parse_turn_and_report_parsing(workload):
    assert workload.parse_turn('<call>{"name": "run_tests"}</call>') == ToolCall("call", '{"name": "run_tests"}')
    assert workload.parse_turn("<answer>done</answer>") == FinalAnswer("done")
    assert workload.parse_turn("<answer></answer>") == FinalAnswer("")  # the tests score it, not its text
    for text in ("", "<call></call>", "<call>x</answer>", "just text"):
        assert isinstance(workload.parse_turn(text), Malformed)
    report = parse_test_report("PASSED tests/a.py::t1\nFAILED tests/a.py::t2 - assert 1 == 2\nnoise PASSED x\n")
    assert report == {"tests/a.py::t1": "PASSED", "tests/a.py::t2": "FAILED"}


def test_demonstrations_replay_the_reference_fix(workload):
    demos = workload.demonstrations(3, 0)
    for demo in demos:
        assert demo[-1] == ("<answer>done</answer>", True)
        calls = [json.loads(text[len("<call>"):-len("</call>")]) for text, trained in demo[1:] if trained and text.startswith("<call>")]
        assert [c["name"] for c in calls][-1] == "run_tests" and "edit" in [c["name"] for c in calls]


def test_bad_task_files_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="workload.tasks"):
        SweConfig(tasks=str(tmp_path / "none.jsonl"))
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"instance_id": "x", "repo_name": "r", "repo_path": "nowhere"}\n')
    with pytest.raises(ConfigError, match="lacks"):
        load_tasks(bad)
