"""The turn grammar of tag-style workloads: their markup, stop strings and the parse of a model turn.

A tag-style workload ends every model turn with one tagged block, a tool call such as
``<calc>58*2</calc>`` or the answer ``<answer>153</answer>``; a tool's output comes back inside the
result tag (``<result>116</result>``). The workload declares its tags, in the order its tokenizer
adds them, and the grammar derives the rest::

    GRAMMAR = TurnGrammar(Call("calc", tool="calculator"), Result("result"), Answer())
    GRAMMAR.markup_tokens   # ("<calc>", "</calc>", "<result>", "</result>", "<answer>", "</answer>")
    GRAMMAR.stop_strings    # ("</calc>", "</answer>"): each call's closing tag, then the answer's
    GRAMMAR.parse(text)     # ToolCall("calculator", "58*2") | FinalAnswer("153") | Malformed(reason)
    GRAMMAR.wrap("116")     # "<result>116</result>"

`markup_tokens` keeps the declared order: the tiny model's tokenizer adds the tokens in that
order, so their ids (and a warm-started model) depend on it. `parse` reads the block at the end
of the turn (whitespace may follow it). Its malformed-turn messages are the same for every
workload; they are shown to the model inside the result tag, so they never contain markup::

    turn did not end with {calls} or an answer    no block at the end, and no stop string either
    expected {calls} or an answer                  a stop string at the end, but no block
    {tag} closed as {other}                        <calc>…</answer>
    tags inside the {tag}                          the grammar's markup inside a block (inner="no_markup")
    empty {tag}                                    only whitespace inside
    {tag} longer than {N} characters               more than `max_chars` inside

This module knows nothing about tools, rewards, tokens or engines.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from libra.workloads.base import FinalAnswer, Malformed, ToolCall, ToolResult, ToolStatus, Turn, Workload

_TAG_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Call:
    """A tool-call tag: a block of it is a `ToolCall` of `tool` with the block's text as arguments."""

    tag: str
    tool: str
    noun: str = ""
    """How messages name such a block ("a check"); default ``a {tag} call``."""

    @property
    def named(self) -> str:
        return self.noun or f"a {self.tag} call"


@dataclasses.dataclass(frozen=True)
class Answer:
    """The answer tag: a block of it ends the trajectory with a `FinalAnswer`."""

    tag: str = "answer"
    empty_ok: bool = False
    """Whether an empty block still answers (a workload that does not score the answer's text)."""


@dataclasses.dataclass(frozen=True)
class Result:
    """The tag a tool's output is shown in (never written by the model)."""

    tag: str


@dataclasses.dataclass(frozen=True)
class Markup:
    """Any other tag that must be one token (e.g. ``think`` for reasoning); never ends a turn."""

    tag: str


Tag = Call | Answer | Result | Markup
Inner = Literal["any", "text", "no_markup"]


class TurnGrammar:
    """The tags of a workload and what follows from them: markup, stop strings, turn parsing.

    `inner` says what a block may hold: ``any`` (code, JSON, LaTeX), ``text`` (no ``<`` or
    ``>`` at all: text with them forms no block) or ``no_markup`` (anything but this grammar's
    tags). `strip` trims whitespace around the block's text; `max_chars` (0: none) bounds it.
    """

    def __init__(self, *tags: Tag, inner: Inner = "any", strip: bool = True, max_chars: int = 0) -> None:
        names = [tag.tag for tag in tags]
        bad = [name for name in names if not _TAG_NAME.match(name)]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"tags must be distinct lower-case names, got {names}")
        answers = [tag for tag in tags if isinstance(tag, Answer)]
        results = [tag for tag in tags if isinstance(tag, Result)]
        if len(answers) != 1 or len(results) > 1:
            raise ValueError(f"a grammar has one Answer tag and at most one Result tag, got {names}")
        if inner not in ("any", "text", "no_markup") or max_chars < 0:
            raise ValueError(f"inner must be any, text or no_markup and max_chars >= 0, got {inner!r}, {max_chars}")
        self.tags, self.inner, self.strip, self.max_chars = tags, inner, strip, max_chars
        self.answer, self.result = answers[0], (results[0] if results else None)
        self.calls = tuple(tag for tag in tags if isinstance(tag, Call))
        self.markup_tokens = tuple(text for name in names for text in (f"<{name}>", f"</{name}>"))
        self.stop_strings = tuple(f"</{tag.tag}>" for tag in (*self.calls, self.answer))
        self._tool = {call.tag: call.tool for call in self.calls}
        self._expected = " or ".join([call.named for call in self.calls] + ["an answer"])
        ends = "|".join(re.escape(tag.tag) for tag in (*self.calls, self.answer))
        content = "([^<>]*)" if inner == "text" else "(.*?)"
        self._block = re.compile(rf"<({ends})>{content}</({ends})>\s*$", re.S)
        self._markup = re.compile(rf"</?({'|'.join(re.escape(name) for name in names)})>")

    def parse(self, text: str) -> Turn:
        """Classify the decoded text of one model turn (its stop string included)."""
        match = self._block.search(text)
        if match is None:
            if not text.rstrip().endswith(self.stop_strings):
                return Malformed(f"turn did not end with {self._expected}")
            return Malformed(f"expected {self._expected}")
        opening, content, closing = match.groups()
        if opening != closing:
            return Malformed(f"{opening} closed as {closing}")
        if self.inner == "no_markup" and self._markup.search(content):
            return Malformed(f"tags inside the {opening}")
        is_answer = opening == self.answer.tag
        if not content.strip() and not (is_answer and self.answer.empty_ok):
            return Malformed(f"empty {opening}")
        if self.max_chars and len(content) > self.max_chars:
            return Malformed(f"{opening} longer than {self.max_chars} characters")
        content = content.strip() if self.strip else content
        return FinalAnswer(content) if is_answer else ToolCall(self._tool[opening], content)

    def wrap(self, payload: str) -> str:
        """`payload` inside the result tag (what the model sees of a tool's output)."""
        if self.result is None:
            raise ValueError("this grammar declares no Result tag: the workload renders tool results itself")
        return f"<{self.result.tag}>{payload}</{self.result.tag}>"

    def defang(self, text: str) -> str:
        """`text` with every markup token broken (``</result>`` -> ``&lt;/result>``), other ``<`` kept.

        Tool output goes through this, so it cannot close the result tag or fake a block."""
        for token in self.markup_tokens:
            text = text.replace(token, "&lt;" + token[1:])
        return text


class TaggedWorkload(Workload):
    """A workload whose turns follow its `grammar`: markup, stop strings, parsing and results come from it."""

    grammar: TurnGrammar

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.grammar.stop_strings

    @property
    def markup_tokens(self) -> tuple[str, ...]:
        return self.grammar.markup_tokens

    def parse_turn(self, text: str) -> Turn:
        return self.grammar.parse(text)

    def render_tool_result(self, result: ToolResult) -> str:
        """The payload in the result tag; a failed or timed-out call reads ``error: …``."""
        if result.status is ToolStatus.SUCCESS:
            return self.grammar.wrap(result.payload)
        return self.grammar.wrap(f"error: {result.payload}")
