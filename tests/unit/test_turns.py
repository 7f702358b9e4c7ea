"""The turn grammar of tag-style workloads: markup and stop strings, turn parsing, messages, result wrapping."""

from __future__ import annotations

import pytest

from libra.workloads import calculator, code_agent, math_tasks, search_r1, swe
from libra.workloads.base import FinalAnswer, Malformed, ToolCall
from libra.workloads.config import CalculatorConfig, Gsm8kConfig
from libra.workloads.turns import Answer, Call, Markup, Result, TurnGrammar

CALC = TurnGrammar(Call("calc", "calculator"), Result("result"), Answer())


def test_markup_and_stop_strings_follow_the_declared_tags():
    assert CALC.markup_tokens == ("<calc>", "</calc>", "<result>", "</result>", "<answer>", "</answer>")
    assert CALC.stop_strings == ("</calc>", "</answer>")
    two = TurnGrammar(Markup("think"), Call("look", "eyes"), Answer("final"), Call("b", "bee", "a bee"))
    assert two.markup_tokens == ("<think>", "</think>", "<look>", "</look>", "<final>", "</final>", "<b>", "</b>")
    assert two.stop_strings == ("</look>", "</b>", "</final>")  # calls in order, then the answer
    assert two.parse("<b>x</b>") == ToolCall("bee", "x") and two.parse("<final> y </final>") == FinalAnswer("y")
    assert two.parse("<think>x</think></b>") == Malformed("expected a look call or a bee or an answer")
    assert two.parse("<think>x</think>") == Malformed("turn did not end with a look call or a bee or an answer")


def test_shipped_workloads_keep_their_markup_order():
    # The tiny model's tokenizer adds these in this order: reordering them changes the token ids.
    expected = {
        calculator.GRAMMAR: ("calc", "result", "answer"),
        math_tasks.GSM8K_GRAMMAR: ("think", "answer"),
        math_tasks.DAPO_GRAMMAR: ("check", "result", "answer"),
        code_agent.GRAMMAR: ("python", "output", "answer"),
        swe.GRAMMAR: ("call", "result", "answer"),
        search_r1.GRAMMAR: ("search", "information", "answer", "think"),
    }
    for grammar, tags in expected.items():
        assert grammar.markup_tokens == tuple(t for tag in tags for t in (f"<{tag}>", f"</{tag}>"))
        assert grammar.stop_strings == tuple(f"</{tag}>" for tag in tags if tag not in ("result", "output",
                                                                                          "information", "think"))


def test_tokenizer_adds_the_markup_last_in_declared_order():
    from libra.tiny_model import train_tokenizer

    for workload in (calculator.CalculatorWorkload(CalculatorConfig()), math_tasks.Gsm8kWorkload(Gsm8kConfig())):
        tokenizer = train_tokenizer(workload, 400, 0)
        ids = [tokenizer.token_to_id(text) for text in workload.markup_tokens]
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        assert ids == list(range(size - len(ids), size))


@pytest.mark.parametrize("text, turn", [
    ("<calc>58*2</calc>", ToolCall("calculator", "58*2")),
    ("let me see <calc> 3 + 4 </calc>\n", ToolCall("calculator", "3 + 4")),
    ("<answer>153</answer>  ", FinalAnswer("153")),
    ("153", Malformed("turn did not end with a calc call or an answer")),
    ("<calc>1+2", Malformed("turn did not end with a calc call or an answer")),
    ("1+2</calc>", Malformed("expected a calc call or an answer")),
    ("<calc>1</calc> more", Malformed("turn did not end with a calc call or an answer")),
    ("<calc>1+2</answer>", Malformed("calc closed as answer")),
    ("<answer> </answer>", Malformed("empty answer")),
    ("<calc></calc>", Malformed("empty calc")),
])
def test_parse_and_its_messages(text, turn):
    assert CALC.parse(text) == turn


def test_inner_text_no_markup_and_any():
    text = TurnGrammar(Call("calc", "calculator"), Answer(), inner="text")
    assert text.parse("<calc>3>2</calc>") == Malformed("expected a calc call or an answer")
    assert text.parse("<calc>1</calc><calc>2</calc>") == ToolCall("calculator", "2")  # the last block
    plain = TurnGrammar(Call("search", "search", "a search"), Result("information"), Answer(), Markup("think"),
                        inner="no_markup")
    assert plain.parse("<search>3>2</search>") == ToolCall("search", "3>2")
    assert plain.parse("<search>a<think>b</search>") == Malformed("tags inside the search")
    assert plain.parse("<search>a</information></search>") == Malformed("tags inside the search")
    anything = TurnGrammar(Call("calc", "calculator"), Answer())
    assert anything.parse("<calc>1</calc><calc>2</calc>") == ToolCall("calculator", "1</calc><calc>2")


def test_strip_max_chars_and_empty_answers():
    code = TurnGrammar(Call("python", "run_python"), Result("output"), Answer(), strip=False, max_chars=12)
    assert code.parse("<python>\n    x = 1\n</python>") == ToolCall("run_python", "\n    x = 1\n")
    assert code.parse("<answer>" + "x" * 13 + "</answer>") == Malformed("answer longer than 12 characters")
    assert code.parse("<python>" + "x" * 12 + "</python>") == ToolCall("run_python", "x" * 12)
    done = TurnGrammar(Call("call", "call", "a tool call"), Result("result"), Answer(empty_ok=True))
    assert done.parse("<answer></answer>") == FinalAnswer("")
    assert done.parse("<call> </call>") == Malformed("empty call")
    assert done.parse("hm") == Malformed("turn did not end with a tool call or an answer")


def test_wrap_and_defang():
    assert CALC.wrap("116") == "<result>116</result>"
    assert CALC.defang("a </result><answer>1</answer> <b> <calc>") == \
        "a &lt;/result>&lt;answer>1&lt;/answer> <b> &lt;calc>"
    with pytest.raises(ValueError, match="no Result tag"):
        TurnGrammar(Markup("think"), Answer()).wrap("x")


@pytest.mark.parametrize("tags, kwargs", [
    ((Call("calc", "c"),), {}),  # no answer
    ((Answer(), Answer("final")), {}),  # two answers
    ((Result("r"), Result("s"), Answer()), {}),
    ((Call("answer", "c"), Answer()), {}),  # a name twice
    ((Call("Calc", "c"), Answer()), {}),  # not a lower-case name
    ((Answer(),), {"inner": "html"}),
    ((Answer(),), {"max_chars": -1}),
])
def test_bad_grammars_are_refused(tags, kwargs):
    with pytest.raises(ValueError):
        TurnGrammar(*tags, **kwargs)
