"""The calculator workload: turn parsing, the tool, rendering, reward, prompts and demonstrations."""

from __future__ import annotations

import asyncio

import pytest

from libra.workloads.base import FinalAnswer, Malformed, ToolCall, ToolResult, ToolStatus, build_workload
from libra.workloads.calculator import TOOL, ExpressionError, Problem, evaluate
from libra.workloads.config import CalculatorConfig


def workload(**fields):
    return build_workload(CalculatorConfig(**fields))


def call(expression: str, timeout_s: float = 5.0) -> ToolResult:
    return asyncio.run(workload().call_tool(ToolCall(TOOL, expression), timeout_s))


def test_parse_turn_tool_call_and_answer():
    calc = workload()
    assert calc.parse_turn("<calc>58*2</calc>") == ToolCall(TOOL, "58*2")
    assert calc.parse_turn("let me see <calc> 3 + 4 </calc>\n") == ToolCall(TOOL, "3 + 4")
    assert calc.parse_turn("<answer>153</answer>") == FinalAnswer("153")


@pytest.mark.parametrize("text", [
    "", "153", "<calc>58*2", "<answer>1</calc>", "<calc></calc>", "</answer>", "<calc>1<2</calc>",
])
def test_parse_turn_malformed(text):
    turn = workload().parse_turn(text)
    assert isinstance(turn, Malformed)
    assert "<" not in turn.reason and ">" not in turn.reason  # the reason is shown inside <result>


def test_an_expression_with_angle_brackets_is_no_calc_call():
    assert workload().parse_turn("<calc>3>2</calc>") == Malformed("expected a calc call or an answer")


def test_evaluate_follows_precedence_without_eval():
    assert evaluate("37+58*2") == 153
    assert evaluate("-21+5") == -16
    assert evaluate("(1+2)*-3") == -9
    for bad in ("", "1+", "2**3", "__import__('os')", "1 2", "(1+2", "1" * 70, "9" * 19 + "*10"):
        with pytest.raises(ExpressionError):
            evaluate(bad)


def test_tool_results_good_bad_and_timeout():
    assert call("58*2") == ToolResult(TOOL, ToolStatus.SUCCESS, "116")
    bad = call("58*x")
    assert bad.status is ToolStatus.FAILURE
    assert workload().render_tool_result(bad).startswith("<result>error: ")
    assert call("1+1", timeout_s=0.0).status is ToolStatus.TIMEOUT
    unknown = asyncio.run(workload().call_tool(ToolCall("search", "x"), 1.0))
    assert unknown.status is ToolStatus.FAILURE
    assert workload().render_tool_result(call("7-9")) == "<result>-2</result>"


def test_reward_is_binary_on_the_final_answer():
    calc = workload()
    prompt = calc.prompt(3)
    assert calc.reward(prompt, FinalAnswer(prompt.answer)) == 1.0
    assert calc.reward(prompt, FinalAnswer(f" {prompt.answer} ")) == 1.0
    assert calc.reward(prompt, FinalAnswer(str(int(prompt.answer) + 1))) == 0.0
    assert calc.reward(prompt, FinalAnswer("many")) == 0.0
    assert calc.reward(prompt, None) == 0.0


def test_prompts_are_deterministic_and_seeded():
    first, again, other = workload(seed=1), workload(seed=1), workload(seed=2)
    prompts = [first.prompt(i) for i in range(50)]
    assert prompts == [again.prompt(i) for i in range(50)]
    assert prompts != [other.prompt(i) for i in range(50)]
    assert {p.meta["operations"] for p in prompts} == {1, 2}
    for prompt in prompts:
        assert prompt.answer == str(evaluate(prompt.meta["expression"]))
        assert prompt.text == f"Compute {prompt.meta['expression']}."
    with pytest.raises(ValueError):
        first.prompt(first.num_prompts)


def test_ideal_steps_respect_precedence():
    assert Problem((37, 58, 2), ("+", "*")).steps() == [("58*2", 116), ("37+116", 153)]
    assert Problem((5, 9, 3), ("-", "-")).steps() == [("5-9", -4), ("-4-3", -7)]


def test_demonstrations_replay_through_the_workload():
    calc = workload(max_operations=3)
    demos = calc.demonstrations(30, seed=4)
    assert demos == calc.demonstrations(30, seed=4)
    assert len({len(demo) for demo in demos}) > 1  # trajectory lengths vary with the operations
    for demo in demos:
        text, trained = demo[0]
        assert not trained and text.startswith("Compute ")
        answer = None
        for (turn, trained), following in zip(demo[1:], demo[2:] + [("", False)]):
            if not trained:
                continue
            parsed = calc.parse_turn(turn)
            if isinstance(parsed, ToolCall):
                assert following == (calc.render_tool_result(asyncio.run(calc.call_tool(parsed, 5.0))), False)
            else:
                answer = parsed
        assert str(evaluate(demo[0][0][len("Compute "):-1])) == answer.text


def test_markup_contains_the_stop_strings():
    calc = workload()
    assert set(calc.stop_strings) <= set(calc.markup_tokens)
    assert all(any(s in text for text in calc.corpus(5, 0)) for s in calc.markup_tokens)


def test_unknown_workload_is_an_error():
    class Config:
        name = "nope"

    with pytest.raises(ValueError, match="unknown workload"):
        build_workload(Config())
