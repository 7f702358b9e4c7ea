"""The workload interface: what an agentic task gives the rest of Libra, and the registry of tasks.

A workload owns its prompts, the text format of a model turn, its tools, its reward and its
demonstrations. It knows nothing about engines, token ids, Redis or schedulers: the agent runner
drives it through this interface, one text turn at a time.

A trajectory, as the runner plays it::

    prompt ─▶ model turn ─▶ parse_turn ─┬─ ToolCall ──▶ call_tool ─▶ render_tool_result ─▶ model turn ...
                                        ├─ Malformed ─▶ render_tool_result(format failure) ─▶ model turn ...
                                        └─ FinalAnswer ─▶ reward

Model turns end on one of `stop_strings`; each of those (and every other string in
`markup_tokens`) is exactly one token of the policy's tokenizer, so the runner can stop on ids.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Iterator


class ToolStatus(str, enum.Enum):
    """How a tool call ended; the scheduler's signatures use this, never the payload text."""

    SUCCESS = "success"
    FAILURE = "failure"
    TIMEOUT = "timeout"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One task instance: the text shown to the model and the reference answer."""

    prompt_id: int
    text: str
    answer: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A model turn asking for a tool: its name and its raw argument text."""

    tool: str
    arguments: str


@dataclasses.dataclass(frozen=True)
class FinalAnswer:
    """A model turn that ends the trajectory with an answer."""

    text: str


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A model turn that is neither a well-formed tool call nor an answer."""

    reason: str


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a tool returned: a structured status and the payload shown to the model."""

    tool: str
    status: ToolStatus
    payload: str


Turn = ToolCall | FinalAnswer | Malformed
Segment = tuple[str, bool]
"""A piece of a conversation's text and whether the model wrote it (and is trained on it)."""


class Workload(abc.ABC):
    """An agentic task: prompts, turn format, tools, reward and demonstrations."""

    name: str = ""

    @property
    @abc.abstractmethod
    def num_prompts(self) -> int:
        """Size of the prompt set; prompt ids are 0 .. num_prompts - 1."""

    @abc.abstractmethod
    def prompt(self, prompt_id: int) -> Prompt:
        """The prompt with this id; the same id always gives the same prompt."""

    @property
    @abc.abstractmethod
    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a model turn; each is a single token of the policy tokenizer."""

    @property
    def markup_tokens(self) -> tuple[str, ...]:
        """Every string that must be one token (stop strings included); tokenizers add these."""
        return self.stop_strings

    @abc.abstractmethod
    def parse_turn(self, text: str) -> Turn:
        """Classify the decoded text of one model turn (its stop string included)."""

    @abc.abstractmethod
    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        """Run a tool call; a call that takes longer than `timeout_s` returns status TIMEOUT."""

    @abc.abstractmethod
    def render_tool_result(self, result: ToolResult) -> str:
        """The text appended to the context after a tool call (masked out of the loss)."""

    @abc.abstractmethod
    def reward(self, prompt: Prompt, answer: FinalAnswer | None) -> float:
        """The scalar reward of a trajectory that ended with `answer` (None: no answer)."""

    @abc.abstractmethod
    def demonstrations(self, count: int, seed: int) -> list[list[Segment]]:
        """Ideal conversations for supervised warm start, as (text, trained-on) segments.

        The first segment is the prompt text (not trained on); the rest alternate model turns
        (trained on) and rendered tool results (not trained on), ending with the answer turn.
        """

    @abc.abstractmethod
    def corpus(self, count: int, seed: int) -> Iterator[str]:
        """Representative text for training a tokenizer."""


def build_workload(config: Any) -> Workload:
    """The workload named by `config.name`, built from its typed config."""
    name = getattr(config, "name", None)
    if name == "calculator":
        from libra.workloads.calculator import CalculatorWorkload  # the registry imports its entries lazily

        return CalculatorWorkload(config)
    raise ValueError(f"unknown workload {name!r}; known workloads: calculator")
