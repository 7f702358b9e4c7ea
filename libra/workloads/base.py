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
The built-in workloads are tag-style: they subclass `libra.workloads.turns.TaggedWorkload` and
declare their tags in a `TurnGrammar`, which gives the markup, stop strings, turn parsing (with
one set of malformed-turn messages) and the result tag.

One signature for every workload: the runner opens an `Episode` per trajectory with
``workload.episode(prompt_id, sample_index, seed, budget)`` and plays it::

    episode = workload.episode(prompt_id, sample_index, seed, TurnBudget(max_turns, max_new_tokens, max_total))
    episode.prompt                                 # the Prompt (raises InvalidArgument for a bad data row)
    episode.max_new_tokens(turn, context_tokens)   # per-turn token budget (0: stop, budget spent)
    episode.parse_turn(text) / await episode.call_tool(call, timeout_s) / episode.render_tool_result(result)
    episode.reward(answer)                         # may use what the episode saw (e.g. malformed turns)
    await episode.close()                          # always called, also when the trajectory fails

`Episode` is concrete: by default it delegates to the workload's stateless methods above, so a
workload that needs no per-trajectory state (calculator, GSM8K) does not subclass it. A workload
with per-trajectory state (DAPO's checker budget, Search-R1's format check, a sandbox directory)
returns its own `Episode` subclass from `episode()` and releases the state in `close()`. `seed` is deterministic
per trajectory (the runner derives it from the run seed and the trajectory id, which names the
prompt's group and the sample); per-turn sampling seeds stay the runner's `turn_seed`.

Added (backwards compatible): `TurnBudget`, `Episode`, `Workload.episode`, `Workload.prompt_key`,
`ToolResult.detail` (why a call failed, for a person debugging; never shown to the model or the scheduler), `WORKLOADS`
(the registry's names) and `register_workload` (for workloads that live outside this package).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
from typing import Any, Awaitable, Callable, Iterator


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
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class TurnBudget:
    """Token and turn limits of one trajectory (the runner's config unless a workload narrows them)."""

    max_turns: int
    max_new_tokens: int
    max_total_tokens: int


Turn = ToolCall | FinalAnswer | Malformed
Segment = tuple[str, bool]
"""A piece of a conversation's text and whether the model wrote it (and is trained on it)."""


class Episode:
    """One trajectory's view of a workload: its prompt, budget and seed, and the turn-by-turn calls.

    The default delegates to the workload's stateless methods; subclass it for per-trajectory
    state and return the subclass from `Workload.episode`.
    """

    def __init__(self, workload: "Workload", prompt: Prompt, sample_index: int, seed: int, budget: TurnBudget):
        self.workload, self.prompt, self.sample_index = workload, prompt, sample_index
        self.seed, self.budget = seed, budget
        self.malformed_turns = 0

    def max_new_tokens(self, turn: int, context_tokens: int) -> int:
        """Tokens the model may generate in this turn (0 or less: the budget is spent)."""
        return min(self.budget.max_new_tokens, self.budget.max_total_tokens - context_tokens)

    def parse_turn(self, text: str) -> Turn:
        turn = self.workload.parse_turn(text)
        if isinstance(turn, Malformed):
            self.malformed_turns += 1
        return turn

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        return await self.workload.call_tool(call, timeout_s)

    def render_tool_result(self, result: ToolResult) -> str:
        return self.workload.render_tool_result(result)

    def reward(self, answer: FinalAnswer | None) -> float | Awaitable[float]:
        """The trajectory's reward; an episode that scores by running code (sandboxed tests) may
        return an awaitable instead, which the runner awaits."""
        return self.workload.reward(self.prompt, answer)

    async def close(self) -> None:
        """Release per-trajectory state; called once, also when the trajectory failed."""


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

    def warm_start_inputs(self) -> dict[str, Any] | None:
        """What its demonstrations and corpus depend on besides the seed, when that is code and config
        alone (a synthetic workload, no data read): a JSON-serialisable mapping (its source files'
        digest, the config fields they read). The warm start's cache key then holds this instead of
        the generated texts' digest, which costs ~0.7 CPU-s at every start, on the first step's path.
        None (the default, any workload reading data): the texts are generated and hashed."""
        return None

    def episode(self, prompt_id: int, sample_index: int, seed: int, budget: TurnBudget) -> Episode:
        """Open the trajectory of sample `sample_index` of prompt `prompt_id` (one signature for every workload).

        Raises `InvalidArgument` when the prompt cannot be built (e.g. a dataset row with missing
        fields): the runner records the trajectory as failed and goes on.
        """
        return Episode(self, self.prompt(prompt_id), sample_index, seed, budget)

    def prompt_key(self, prompt_id: int) -> str:
        """A stable key of the prompt's content (the dataset row id where there is one)."""
        return f"{self.name}:{prompt_id}"


WORKLOADS: dict[str, str] = {
    "calculator": "libra.workloads.calculator:CalculatorWorkload",
    "gsm8k": "libra.workloads.math_tasks:Gsm8kWorkload",
    "dapo_math": "libra.workloads.math_tasks:DapoMathWorkload",
    "search_r1": "libra.workloads.search_r1:SearchR1Workload",
    "code_agent": "libra.workloads.code_agent:CodeAgentWorkload", "swe": "libra.workloads.swe:SweWorkload",
}
"""Workload name -> "module:Class"; the registry imports its entries lazily (no heavy imports at config time)."""


def register_workload(name: str, target: str) -> None:
    """Add a workload ("module:Class", built as Class(config)) to the registry."""
    WORKLOADS[name] = target


def build_workload(config: Any) -> Workload:
    """The workload named by `config.name`, built from its typed config."""
    name = getattr(config, "name", None)
    target = WORKLOADS.get(name)
    if target is None:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(sorted(WORKLOADS))}")
    module, _, cls = target.partition(":")
    factory: Callable[[Any], Workload] = getattr(importlib.import_module(module), cls)
    return factory(config)
