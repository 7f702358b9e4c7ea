"""Search-R1: question answering with a search tool, rewarded by exact match of the normalised answer.

A trajectory interleaves searches and retrieved passages, then answers::

    Question: Who designed ...?  ─▶  <search>designer of the Calder lighthouse</search>
    <information>Doc 1(Title: Calder lighthouse) ... designed by ... Mira Solt ...</information>
    ─▶  <answer>Mira Solt</answer>

Model turns end on ``</search>`` or ``</answer>``; ``<information>…</information>`` is the tool's
output (masked out of the loss); the tags are `GRAMMAR`. The retriever is a local BM25 index or a Search-R1 retrieval
server (`libra.workloads.retrieval`). Reward: 1 when the normalised answer (lower case, no
punctuation, no articles, single spaces) equals a normalised reference; otherwise
`format_reward` when the trajectory was well formed (every turn parsed, one answer), else 0.
This module knows nothing about tokens, engines or the trainer.
"""

from __future__ import annotations

import random
import re
import string
from typing import Iterator

from libra.workloads.base import Episode, FinalAnswer, Prompt, Segment, ToolCall, ToolResult, ToolStatus
from libra.workloads.config import SearchR1Config
from libra.workloads.prompts import PromptFile, answers_of
from libra.workloads.retrieval import TOOL, Bm25Retriever, Document, build_retriever, render_documents
from libra.workloads.turns import Answer, Call, Markup, Result, TaggedWorkload, TurnGrammar

GRAMMAR = TurnGrammar(Call("search", TOOL, "a search"), Result("information"), Answer(), Markup("think"),
                      inner="no_markup")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
INSTRUCTION = "Search with <search>QUERY</search>, answer as <answer>TEXT</answer>."


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and articles removed, whitespace collapsed (the usual QA normalisation)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def exact_match(answer: str, references: list[str]) -> bool:
    """Whether the normalised answer equals a normalised reference (an empty answer never matches)."""
    normalised = normalize_answer(answer)
    return bool(normalised) and any(normalised == normalize_answer(ref) for ref in references)


class SearchEpisode(Episode):
    """A Search-R1 trajectory: its reward also checks that every turn was well formed."""

    def reward(self, answer: FinalAnswer | None) -> float:
        if answer is None:
            return 0.0
        if exact_match(answer.text, answers_of(self.prompt)):
            return 1.0
        return self.workload.config.format_reward if self.malformed_turns == 0 else 0.0


class SearchR1Workload(TaggedWorkload):
    """Questions from a prepared file; a `<search>` tool backed by BM25 or a retrieval server."""

    name = "search_r1"
    grammar = GRAMMAR

    def __init__(self, config: SearchR1Config) -> None:
        self.config = config
        self.data = PromptFile(config.data, config.name, config.limit)
        self.retriever = build_retriever(config.retriever)

    @property
    def num_prompts(self) -> int:
        return len(self.data)

    def prompt_text(self, question: str) -> str:
        return f"Question: {question.strip()}\n{INSTRUCTION}\n"

    def prompt(self, prompt_id: int) -> Prompt:
        row = self.data.get(prompt_id)
        return Prompt(row.prompt_id, self.prompt_text(row.text), row.answer, row.meta)

    def prompt_key(self, prompt_id: int) -> str:
        return self.data.key(prompt_id)

    def episode(self, prompt_id, sample_index, seed, budget) -> Episode:
        return SearchEpisode(self, self.prompt(prompt_id), sample_index, seed, budget)

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        if call.tool != TOOL:
            return ToolResult(call.tool, ToolStatus.FAILURE, f"unknown tool {call.tool}")
        return await self.retriever.search(call.arguments, timeout_s)

    def reward(self, prompt: Prompt, answer: FinalAnswer | None) -> float:
        return 1.0 if answer is not None and exact_match(answer.text, answers_of(prompt)) else 0.0

    def _passages(self, question: str, answer: str) -> str:
        # With a local index the demonstration shows what the tool really returns; a remote one
        # cannot be asked while the tokenizer is trained, so a passage naming the answer stands in.
        if isinstance(self.retriever, Bm25Retriever):
            return render_documents(self.retriever.search_now(question), self.config.retriever.max_doc_chars)
        return render_documents([Document("", f"{question} {answer}")], self.config.retriever.max_doc_chars)

    def demonstrations(self, count: int, seed: int) -> list[list[Segment]]:
        rows = list(self.data.valid())
        rng = random.Random(f"{self.name}-demo:{seed}")
        cache: dict[int, str] = {}
        demos = []
        for _ in range(count):
            row = rng.choice(rows)
            question = row.text.strip()
            if row.prompt_id not in cache:
                cache[row.prompt_id] = self._passages(question, row.answer)
            info = self.render_tool_result(ToolResult(TOOL, ToolStatus.SUCCESS, cache[row.prompt_id]))
            demos.append([(self.prompt_text(question), False), (f"<search>{question}</search>", True), (info, False),
                          (f"<answer>{row.answer}</answer>", True)])
        return demos

    def corpus(self, count: int, seed: int) -> Iterator[str]:
        for demonstration in self.demonstrations(count, seed):
            yield "".join(text for text, _ in demonstration)
        for reason in ("expected a search or an answer", "empty query", "search timed out", "no documents found",
                       "the retriever is unreachable"):
            yield self.render_tool_result(ToolResult(TOOL, ToolStatus.FAILURE, reason))
