"""Math word problems from prepared datasets: GSM8K (one turn) and DAPO-Math-17K (with a checker tool).

GSM8K, one model turn (the episode's turn budget is narrowed to 1)::

    <prompt> Answer as <answer>…</answer>.   ─▶   <think>…</think><answer>18</answer>

DAPO-Math-17K, several turns: the model may ask a checker whether a boxed answer parses (it never
says whether it is right), revise, then answer::

    <check>\\boxed{3/4}</check><result>parses as 3/4</result><answer>\\boxed{\\frac{3}{4}}</answer>

The tags of each are a `TurnGrammar` (`GSM8K_GRAMMAR`, `DAPO_GRAMMAR`). Rewards come from
`math-verify`: the reference (wrapped in ``\\boxed{}``) and the answer are parsed to sympy and
compared, so ``0.5`` matches ``\\frac{1}{2}`` and ``1,000`` matches ``1000``.
math-verify's own time limit uses SIGALRM, which only works in the main thread; elsewhere (the
checker runs in a worker thread) it is switched off and the caller's `asyncio.wait_for` bounds it.
This module knows nothing about tokens, engines or the trainer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from typing import Iterator

from libra.workloads.base import Episode, FinalAnswer, Prompt, Segment, ToolCall, ToolResult, ToolStatus, TurnBudget
from libra.workloads.config import DapoMathConfig, Gsm8kConfig
from libra.workloads.prompts import PromptFile, answers_of
from libra.workloads.turns import Answer, Call, Markup, Result, TaggedWorkload, TurnGrammar

CHECKER = "checker"
MAX_ANSWER_CHARS = 2000
"""Answers longer than this are cut before parsing (bounds sympy's work on degenerate output)."""
GSM8K_GRAMMAR = TurnGrammar(Markup("think"), Answer())
DAPO_GRAMMAR = TurnGrammar(Call("check", CHECKER, "a check"), Result("result"), Answer())
_GSM8K_INSTRUCTION = "Answer as <answer>NUMBER</answer>."
_DAPO_INSTRUCTION = r"Check with <check>\boxed{X}</check> if you like; answer as <answer>\boxed{X}</answer>."


def _parse(text: str) -> list:
    from math_verify import parse  # heavy (sympy): imported when a reward is first computed

    if threading.current_thread() is threading.main_thread():
        return parse(text[:MAX_ANSWER_CHARS])
    # Off the main thread the caller bounds the time; math-verify would warn about that on every call.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return parse(text[:MAX_ANSWER_CHARS], parsing_timeout=None)


def math_reward(references: list[str], answer: str) -> float:
    """1.0 when `answer` is mathematically equal to one of the references (math-verify), else 0.0."""
    from math_verify import verify

    # The answer tag holds only the answer, so bare LaTeX (``\\sqrt{8}``) is read as if boxed too.
    readings = [_parse(answer)]
    if "\\boxed" not in answer and "$" not in answer and answer.strip():
        readings.append(_parse(f"\\boxed{{{answer.strip()}}}"))
    readings = [reading for reading in readings if reading]
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    for reference in references:
        gold = _parse(reference if "\\boxed" in reference else f"\\boxed{{{reference}}}")
        if gold and any(verify(gold, reading, timeout_seconds=timeout) for reading in readings):
            return 1.0
    return 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def check_boxed(text: str) -> ToolResult:
    """The checker: does the text hold a boxed answer that parses? (Never whether it is right.)"""
    boxed = last_boxed(text)
    if boxed is None:
        return ToolResult(CHECKER, ToolStatus.FAILURE, "no boxed answer to check")
    if not boxed.strip():
        return ToolResult(CHECKER, ToolStatus.FAILURE, "the boxed answer is empty")
    parsed = _parse(f"\\boxed{{{boxed}}}")
    if not parsed:
        return ToolResult(CHECKER, ToolStatus.FAILURE, "the boxed answer does not parse")
    return ToolResult(CHECKER, ToolStatus.SUCCESS, f"parses as {parsed[-1]}")


class _DatasetMath(TaggedWorkload):
    """Prompts from a prepared file, an `<answer>` turn, and a math-verify reward."""

    instruction = ""

    def __init__(self, config: Gsm8kConfig | DapoMathConfig) -> None:
        self.config = config
        self.data = PromptFile(config.data, config.name, config.limit)

    @property
    def num_prompts(self) -> int:
        return len(self.data)

    def prompt(self, prompt_id: int) -> Prompt:
        row = self.data.get(prompt_id)
        return Prompt(row.prompt_id, self.prompt_text(row.text), row.answer, row.meta)

    def prompt_text(self, task: str) -> str:
        return f"{task.strip()}\n{self.instruction}\n"

    def prompt_key(self, prompt_id: int) -> str:
        return self.data.key(prompt_id)

    def reward(self, prompt: Prompt, answer: FinalAnswer | None) -> float:
        return 0.0 if answer is None else math_reward(answers_of(prompt), answer.text)

    def _sample_rows(self, count: int, seed: int) -> list[Prompt]:
        rows = list(self.data.valid())
        rng = random.Random(f"{self.name}-demo:{seed}")
        return [rng.choice(rows) for _ in range(count)]


class Gsm8kWorkload(_DatasetMath):
    """GSM8K: one turn, reasoning optional, the number in `<answer>`."""

    name = "gsm8k"
    instruction = _GSM8K_INSTRUCTION
    grammar = GSM8K_GRAMMAR

    def episode(self, prompt_id: int, sample_index: int, seed: int, budget: TurnBudget) -> Episode:
        single = TurnBudget(1, budget.max_new_tokens, budget.max_total_tokens)
        return Episode(self, self.prompt(prompt_id), sample_index, seed, single)

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        return ToolResult(call.tool, ToolStatus.FAILURE, "this task has no tools")

    def render_tool_result(self, result: ToolResult) -> str:
        # No tools, so no result tag: a malformed turn's reason follows as plain text.
        return f"\nformat error: {result.payload}\n"

    def demonstrations(self, count: int, seed: int) -> list[list[Segment]]:
        demos = []
        for row in self._sample_rows(count, seed):
            solution = str(row.meta.get("solution", "")).strip()
            reasoning = f"<think>{solution}</think>" if solution and self.config.reasoning_in_demonstrations else ""
            demos.append([(self.prompt_text(row.text), False), (f"{reasoning}<answer>{row.answer}</answer>", True)])
        return demos

    def corpus(self, count: int, seed: int) -> Iterator[str]:
        for demonstration in self.demonstrations(count, seed):
            yield "".join(text for text, _ in demonstration)
        for reason in ("the turn did not end with an answer", "empty answer"):
            yield self.render_tool_result(ToolResult("format", ToolStatus.FAILURE, reason))


class DapoEpisode(Episode):
    """A DAPO trajectory: counts checker calls against `max_checks`."""

    def __init__(self, *args, max_checks: int) -> None:
        super().__init__(*args)
        self.checks_left = max_checks

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        if call.tool == CHECKER:
            if self.checks_left <= 0:
                return ToolResult(CHECKER, ToolStatus.FAILURE, "no checks left, answer now")
            self.checks_left -= 1
        return await self.workload.call_tool(call, timeout_s)


class DapoMathWorkload(_DatasetMath):
    """DAPO-Math-17K: a checker tool for boxed answers, then a boxed final answer."""

    name = "dapo_math"
    instruction = _DAPO_INSTRUCTION
    grammar = DAPO_GRAMMAR

    def episode(self, prompt_id: int, sample_index: int, seed: int, budget: TurnBudget) -> Episode:
        return DapoEpisode(self, self.prompt(prompt_id), sample_index, seed, budget, max_checks=self.config.max_checks)

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        if call.tool != CHECKER:
            return ToolResult(call.tool, ToolStatus.FAILURE, f"unknown tool {call.tool}")
        try:
            return await asyncio.wait_for(asyncio.to_thread(check_boxed, call.arguments), timeout_s)
        except TimeoutError:
            return ToolResult(CHECKER, ToolStatus.TIMEOUT, "timed out")

    def demonstrations(self, count: int, seed: int) -> list[list[Segment]]:
        rng = random.Random(f"{self.name}-check:{seed}")
        demos = []
        for row in self._sample_rows(count, seed):
            boxed = f"\\boxed{{{row.answer}}}"
            segments: list[Segment] = [(self.prompt_text(row.text), False)]
            if rng.random() < self.config.check_demonstrations:
                segments += [(f"<check>{boxed}</check>", True),
                             (self.render_tool_result(ToolResult(CHECKER, ToolStatus.SUCCESS, f"parses as {row.answer}")),
                              False)]
            demos.append(segments + [(f"<answer>{boxed}</answer>", True)])
        return demos

    def corpus(self, count: int, seed: int) -> Iterator[str]:
        for demonstration in self.demonstrations(count, seed):
            yield "".join(text for text, _ in demonstration)
        for reason in ("no boxed answer to check", "the boxed answer does not parse", "no checks left, answer now",
                       "expected a check or an answer", "timed out"):
            yield self.render_tool_result(ToolResult(CHECKER, ToolStatus.FAILURE, reason))
