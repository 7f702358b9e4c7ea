"""The calculator workload: integer arithmetic the model solves by calling a calculator tool.

A prompt reads ``Compute 37+58*2.``. The ideal trajectory makes one tool call per operation,
highest precedence first (leftmost on ties), then answers::

    <calc>58*2</calc><result>116</result><calc>37+116</calc><result>153</result><answer>153</answer>

Model turns end on ``</calc>`` or ``</answer>``; ``<result>…</result>`` is the tool's output (the
tags are `GRAMMAR`, a `libra.workloads.turns.TurnGrammar`). The reward is 1 when the answer
equals the true value, else 0. The tool evaluates expressions with a small recursive-descent
parser (integers, + - *, unary minus, parentheses): no `eval`.
This module knows nothing about tokens, engines or the trainer.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from typing import Iterator

from libra.workloads.base import FinalAnswer, Prompt, Segment, ToolCall, ToolResult, ToolStatus
from libra.workloads.config import CalculatorConfig
from libra.workloads.turns import Answer, Call, Result, TaggedWorkload, TurnGrammar

TOOL = "calculator"
MAX_EXPRESSION_CHARS = 64
MAX_DEPTH = 16
MAX_MAGNITUDE = 10**18
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}
_LEXEME = re.compile(r"\s*(?:(\d+)|([-+*()]))")
GRAMMAR = TurnGrammar(Call("calc", TOOL), Result("result"), Answer(), inner="text")
"""An expression never holds ``<`` or ``>``, so text with them forms no block (inner="text")."""


class ExpressionError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


def tokenize_expression(expression: str) -> list[str]:
    """Split an expression into integers and operator/parenthesis symbols."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError("expression too long")
    lexemes, position = [], 0
    while position < len(expression.rstrip()):
        match = _LEXEME.match(expression, position)
        if match is None:
            raise ExpressionError("unexpected character")
        lexemes.append(match.group(1) or match.group(2))
        position = match.end()
    if not lexemes:
        raise ExpressionError("empty expression")
    return lexemes


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor ('*' factor)* ; factor := '-' factor | int | '(' expr ')'."""

    def __init__(self, lexemes: list[str]) -> None:
        self.lexemes, self.position = lexemes, 0

    def peek(self) -> str | None:
        return self.lexemes[self.position] if self.position < len(self.lexemes) else None

    def take(self) -> str | None:
        lexeme = self.peek()
        self.position += 1
        return lexeme

    def expr(self, depth: int) -> int:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            value = value + self.term(depth) if self.take() == "+" else value - self.term(depth)
        return value

    def term(self, depth: int) -> int:
        value = self.factor(depth)
        while self.peek() == "*":
            self.take()
            value = _bounded(value * self.factor(depth))
        return value

    def factor(self, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ExpressionError("expression nested too deeply")
        lexeme = self.take()
        if lexeme == "-":
            return -self.factor(depth + 1)
        if lexeme == "(":
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExpressionError("unbalanced parentheses")
            return value
        if lexeme is None or not lexeme.isdigit():
            raise ExpressionError("expected a number")
        return _bounded(int(lexeme))


def _bounded(value: int) -> int:
    if abs(value) > MAX_MAGNITUDE:
        raise ExpressionError("number too large")
    return value


def evaluate(expression: str) -> int:
    """The integer value of an arithmetic expression; raises ExpressionError when it is invalid."""
    parser = _Parser(tokenize_expression(expression))
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ExpressionError("unexpected symbol after the expression")
    return _bounded(value)


@dataclasses.dataclass(frozen=True)
class Problem:
    """An arithmetic problem: operands[0] op[0] operands[1] op[1] … with usual precedence."""

    operands: tuple[int, ...]
    operators: tuple[str, ...]

    def text(self) -> str:
        """The expression without spaces, e.g. ``37+58*2``."""
        parts = [str(self.operands[0])]
        for operator, operand in zip(self.operators, self.operands[1:]):
            parts += [operator, str(operand)]
        return "".join(parts)

    def steps(self) -> list[tuple[str, int]]:
        """The ideal tool calls (expression, value): highest precedence first, leftmost on ties."""
        operands, operators, steps = list(self.operands), list(self.operators), []
        while operators:
            best = max(_PRECEDENCE[op] for op in operators)
            index = next(i for i, op in enumerate(operators) if _PRECEDENCE[op] == best)
            call = f"{operands[index]}{operators[index]}{operands[index + 1]}"
            value = evaluate(call)
            steps.append((call, value))
            operands[index:index + 2] = [value]
            del operators[index]
        return steps


def draw_problem(rng: random.Random, config: CalculatorConfig) -> Problem:
    """A problem with 1..max_operations operations, uniform operands and operators."""
    count = rng.randint(1, config.max_operations)
    operands = tuple(rng.randint(config.min_operand, config.max_operand) for _ in range(count + 1))
    return Problem(operands, tuple(rng.choice("+-*") for _ in range(count)))


def prompt_text(problem: Problem) -> str:
    # No spaces: the first tool call is then a verbatim copy of part of the prompt, which is what
    # a tiny model learns fastest (an induction-style copy).
    return f"Compute {problem.text()}."


class CalculatorWorkload(TaggedWorkload):
    """Arithmetic problems solved with a calculator tool; binary reward on the final answer."""

    name = "calculator"
    grammar = GRAMMAR

    def __init__(self, config: CalculatorConfig) -> None:
        self.config = config

    @property
    def num_prompts(self) -> int:
        return self.config.num_prompts

    def problem(self, prompt_id: int) -> Problem:
        if not 0 <= prompt_id < self.config.num_prompts:
            raise ValueError(f"prompt_id must be in 0..{self.config.num_prompts - 1}, got {prompt_id}")
        return draw_problem(random.Random(f"calculator:{self.config.seed}:{prompt_id}"), self.config)

    def prompt(self, prompt_id: int) -> Prompt:
        problem = self.problem(prompt_id)
        meta = {"expression": problem.text(), "operations": len(problem.operators)}
        return Prompt(prompt_id, prompt_text(problem), str(evaluate(problem.text())), meta)

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        if call.tool != TOOL:
            return ToolResult(call.tool, ToolStatus.FAILURE, f"unknown tool {call.tool!r}")
        # Inline: an expression is bounded (MAX_EXPRESSION_CHARS, MAX_DEPTH, MAX_MAGNITUDE; + - * only), so
        # it evaluates in microseconds (~4 µs) where a thread hop with a timeout cost ~73 µs of CPU a call
        # (and could not stop the thread either); an evaluation that overran timeout_s is still TIMEOUT.
        started = time.monotonic()
        try:
            value = evaluate(call.arguments)
        except ExpressionError as error:
            return ToolResult(TOOL, ToolStatus.FAILURE, str(error))
        if time.monotonic() - started > timeout_s:
            return ToolResult(TOOL, ToolStatus.TIMEOUT, "timed out")
        return ToolResult(TOOL, ToolStatus.SUCCESS, str(value))

    def reward(self, prompt: Prompt, answer: FinalAnswer | None) -> float:
        if answer is None:
            return 0.0
        try:
            return 1.0 if int(answer.text.strip()) == int(prompt.answer) else 0.0
        except ValueError:
            return 0.0

    def warm_start_inputs(self) -> dict:
        """Its demonstrations and corpus are this module's code (with turns' and base's) on its config's
        fields but the prompt count, and Python's `random` (whose streams a Python version may change)."""
        import pathlib
        import platform

        from libra import model_cache
        from libra.workloads import base, turns

        return {"code": model_cache.digest_files([pathlib.Path(__file__), base.__file__, turns.__file__]),
                "config": self.config.model_dump(mode="json", exclude={"num_prompts"}),
                "python": ".".join(platform.python_version_tuple()[:2])}

    def demonstrations(self, count: int, seed: int) -> list[list[Segment]]:
        # A stream of its own ("demo"), so demonstrations are not the prompt set itself.
        rng = random.Random(f"calculator-demo:{self.config.seed}:{seed}")
        return [self._demonstration(draw_problem(rng, self.config), rng.random() < self.config.direct_answer_fraction)
                for _ in range(count)]

    def _demonstration(self, problem: Problem, direct: bool = False) -> list[Segment]:
        steps = problem.steps()
        segments: list[Segment] = [(prompt_text(problem), False)]
        if direct:
            # Answering without the tool: right in the demonstration, but a tiny model cannot do
            # the arithmetic itself, so this habit earns little reward and RL learns to call the tool.
            return segments + [(f"<answer>{steps[-1][1]}</answer>", True)]
        for call, value in steps:
            segments.append((f"<calc>{call}</calc>", True))
            segments.append((self.render_tool_result(ToolResult(TOOL, ToolStatus.SUCCESS, str(value))), False))
        segments.append((f"<answer>{steps[-1][1]}</answer>", True))
        return segments

    def corpus(self, count: int, seed: int) -> Iterator[str]:
        for demonstration in self.demonstrations(count, seed):
            yield "".join(text for text, _ in demonstration)
        for reason in ("unexpected character", "expected a number", "unbalanced parentheses",
                       "expression too long", "number too large", "timed out", "empty calc"):
            yield self.render_tool_result(ToolResult(TOOL, ToolStatus.FAILURE, reason))
