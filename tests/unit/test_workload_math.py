"""GSM8K and DAPO-Math workloads: math-verify rewards (right and wrong answers), turn parsing, the
checker tool and its per-trajectory limit, bad data rows, demonstrations, and the interface's
backwards compatibility (a config without `name` is the calculator)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from libra.config import build_run_config
from libra.errors import ConfigError, InvalidArgument
from libra.workloads.base import (
    WORKLOADS, Episode, FinalAnswer, Malformed, ToolCall, ToolStatus, TurnBudget, build_workload,
)
from libra.workloads.config import CalculatorConfig, DapoMathConfig, Gsm8kConfig
from libra.workloads.math_tasks import CHECKER, check_boxed, last_boxed, math_reward

BUDGET = TurnBudget(4, 48, 384)


@pytest.mark.parametrize("reference, answer, expected", [
    ("18", "18", 1.0), ("18", r"\boxed{18}", 1.0), ("18", "18 dollars", 1.0), ("1000", "1,000", 1.0),
    (r"\frac{1}{4}", "0.25", 1.0), (r"\frac{1}{4}", r"\boxed{\frac{2}{8}}", 1.0), (r"2\sqrt{2}", r"\sqrt{8}", 1.0),
    ("18", "17", 0.0), ("18", "", 0.0), ("18", "eighteen-ish", 0.0), (r"\frac{1}{4}", r"\boxed{\frac{1}{3}}", 0.0),
    ("-7", "7", 0.0), ("18", r"\boxed{18", 0.0),
])
def test_math_reward_known_right_and_wrong(reference, answer, expected):
    assert math_reward([reference], answer) == expected


def test_math_reward_off_the_main_thread():
    found = []
    worker = threading.Thread(target=lambda: found.append((math_reward(["12"], r"\boxed{12}"),
                                                           math_reward(["12"], "13"))))
    worker.start()
    worker.join()
    assert found == [(1.0, 0.0)]


def test_gsm8k_single_turn_parse_and_reward():
    gsm8k = build_workload(Gsm8kConfig())
    prompt = gsm8k.prompt(0)
    assert prompt.text.startswith("Mia has 3 boxes") and prompt.text.rstrip().endswith("<answer>NUMBER</answer>.")
    assert gsm8k.parse_turn("<think>3*4 = 12</think><answer>12</answer>") == FinalAnswer("12")
    for text in ("12", "<answer></answer>", "<think>12</think>", "<answer>12"):
        assert isinstance(gsm8k.parse_turn(text), Malformed)
    assert gsm8k.reward(prompt, FinalAnswer("12")) == 1.0
    assert gsm8k.reward(prompt, FinalAnswer("13")) == 0.0
    assert gsm8k.reward(prompt, None) == 0.0
    assert gsm8k.prompt_key(0) == "gsm8k:gsm8k-sample-0"  # the row id: stable when the file is reordered
    episode = gsm8k.episode(0, 3, 7, BUDGET)
    assert episode.budget.max_turns == 1 and episode.sample_index == 3 and episode.seed == 7
    assert episode.reward(FinalAnswer(r"\boxed{12}")) == 1.0


def test_gsm8k_demonstrations_are_answer_turns_with_reasoning():
    gsm8k = build_workload(Gsm8kConfig())
    demos = gsm8k.demonstrations(20, seed=1)
    assert demos == gsm8k.demonstrations(20, seed=1) and demos != gsm8k.demonstrations(20, seed=2)
    for demo in demos:
        (prompt_text, trained_prompt), (turn, trained_turn) = demo
        assert not trained_prompt and trained_turn
        assert turn.startswith("<think>") and isinstance(gsm8k.parse_turn(turn), FinalAnswer)
    plain = build_workload(Gsm8kConfig(reasoning_in_demonstrations=False)).demonstrations(3, 0)
    assert all(demo[1][0].startswith("<answer>") for demo in plain)


def test_dapo_checker_reports_parsing_not_correctness():
    assert last_boxed(r"so \boxed{\frac{1}{2}} or \boxed{3}") == "3"
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{12") is None and last_boxed("12") is None
    good = check_boxed(r"\boxed{\frac{3}{4}}")
    assert good.status is ToolStatus.SUCCESS and good.tool == CHECKER and "3" in good.payload
    wrong_but_parses = check_boxed(r"\boxed{999}")  # the checker never reveals the reference
    assert wrong_but_parses.status is ToolStatus.SUCCESS
    for text in ("12", r"\boxed{}", r"\boxed{12"):
        assert check_boxed(text).status is ToolStatus.FAILURE


def test_dapo_episode_limits_checks_and_rewards_the_boxed_answer():
    dapo = build_workload(DapoMathConfig(max_checks=1))
    prompt_id = next(i for i in range(dapo.num_prompts) if dapo.prompt(i).answer == r"\frac{1}{4}")
    episode = dapo.episode(prompt_id, 0, 0, BUDGET)
    assert dapo.parse_turn(r"<check>\boxed{1/4}</check>") == ToolCall(CHECKER, r"\boxed{1/4}")
    assert isinstance(dapo.parse_turn(r"<check>\boxed{1}</answer>"), Malformed)
    first = asyncio.run(episode.call_tool(ToolCall(CHECKER, r"\boxed{1/4}"), 5.0))
    second = asyncio.run(episode.call_tool(ToolCall(CHECKER, r"\boxed{1/4}"), 5.0))
    assert first.status is ToolStatus.SUCCESS
    assert second.status is ToolStatus.FAILURE and "no checks left" in second.payload
    assert dapo.render_tool_result(second).startswith("<result>error: ")
    assert episode.reward(FinalAnswer(r"\boxed{0.25}")) == 1.0
    assert episode.reward(FinalAnswer(r"\boxed{\frac{1}{3}}")) == 0.0
    unknown = asyncio.run(dapo.call_tool(ToolCall("search", "x"), 1.0))
    assert unknown.status is ToolStatus.FAILURE
    timed_out = asyncio.run(dapo.call_tool(ToolCall(CHECKER, r"\boxed{1}"), 0.0))
    assert timed_out.status is ToolStatus.TIMEOUT


def test_dapo_demonstrations_check_then_answer():
    dapo = build_workload(DapoMathConfig(check_demonstrations=1.0))
    for demo in dapo.demonstrations(5, 0):
        texts = [text for text, _ in demo]
        assert [trained for _, trained in demo] == [False, True, False, True]
        assert isinstance(dapo.parse_turn(texts[1]), ToolCall) and isinstance(dapo.parse_turn(texts[3]), FinalAnswer)


def test_bad_data_rows_fail_only_their_prompt(tmp_path):
    data = tmp_path / "rows.jsonl"
    rows = [{"id": 1, "prompt": "What is 2+2?", "answer": "4"}, {"id": 2, "prompt": "No answer here"},
            "not json", {"id": 4, "prompt": "What is 3+3?", "answer": "6", "meta": {"solution": "3+3=6"}}]
    data.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    gsm8k = build_workload(Gsm8kConfig(data=str(data)))
    assert gsm8k.num_prompts == 4 and gsm8k.prompt(3).answer == "6"
    with pytest.raises(InvalidArgument, match="line 2 .*missing field answer.*libra data prepare"):
        gsm8k.prompt(1)
    with pytest.raises(InvalidArgument, match="line 3 .*not valid JSON"):
        gsm8k.episode(2, 0, 0, BUDGET)
    assert {demo[1][0] for demo in gsm8k.demonstrations(30, 0)} <= {
        "<think></think><answer>4</answer>", "<answer>4</answer>", "<think>3+3=6</think><answer>6</answer>"}
    limited = build_workload(Gsm8kConfig(data=str(data), limit=1))
    assert limited.num_prompts == 1


def test_config_errors_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"workload.data: no file .*libra data prepare gsm8k"):
        build_run_config({"workload": {"name": "gsm8k", "data": str(tmp_path / "missing.jsonl")}})
    with pytest.raises(ConfigError, match="known workloads: calculator, .*dapo_math, gsm8k, search_r1"):
        build_run_config({"workload": {"name": "chess"}})
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n")
    with pytest.raises(ConfigError, match="no valid rows"):
        build_workload(Gsm8kConfig(data=str(empty)))
    assert build_run_config({"workload": {"num_prompts": 5}}).workload == CalculatorConfig(num_prompts=5)


def test_every_registered_workload_builds_and_opens_episodes():
    configs = {"calculator": CalculatorConfig(), "gsm8k": Gsm8kConfig(), "dapo_math": DapoMathConfig()}
    for name, config in configs.items():
        assert name in WORKLOADS
        workload = build_workload(config)
        episode = workload.episode(0, 1, 2, BUDGET)
        assert isinstance(episode, Episode) and episode.prompt == workload.prompt(0)
        assert episode.max_new_tokens(0, 380) == 4 and episode.max_new_tokens(0, 10) == 48
    with pytest.raises(ValueError, match="known workloads"):
        build_workload(type("Cfg", (), {"name": "nope"})())
