"""The code agent workload: the model writes Python, runs it in a sandbox, and answers with code.

A task (one line of ``configs/data/code_tasks.jsonl``, the prompt-file format of
`libra.workloads.prompts`) is a function spec; its reference solution is the row's ``answer`` and
its hidden tests (``meta.tests``: Python statements such as ``assert add(1, 2) == 3``) are never
shown to the model. A trajectory::

    <prompt> ─▶ <python>def add(a, b): …\\nprint(add(1, 2))</python> ─▶ <output>status: ok\\n3</output>
             ─▶ <answer>def add(a, b): …</answer>

Model turns end on ``</python>`` or ``</answer>`` (the tags are `GRAMMAR`). ``run_python`` runs the code in the sandbox
(`libra.workloads.sandbox`: no network, CPU/memory/disk/process limits, wall clock) and shows
its status and bounded stdout/stderr; the tool status is SUCCESS for exit 0, FAILURE for an error,
TIMEOUT for a time limit. The reward is the pass rate of the hidden tests: the answer's code
runs in the sandbox with a harness that executes each test under its own alarm and prints one
result line per test, so a test that loops costs only itself.

The harness trusts the process it runs in to report honestly (a program could forge result
lines by imitating the harness); the per-run nonce only stops accidental look-alikes. This
module knows nothing about tokens, engines or the trainer.
"""

from __future__ import annotations

import json
import random
import secrets
from typing import Iterator, Literal

from pydantic import Field

from libra.configbase import Section
from libra.workloads.base import Episode, FinalAnswer, Prompt, Segment, ToolCall, ToolResult, ToolStatus
from libra.workloads.prompts import PromptFile
from libra.workloads.sandbox import (SandboxLimits, SandboxRun, SandboxStatus, check_isolation, python_argv,
                                     run_in_sandbox)
from libra.workloads.turns import Answer, Call, Result, TaggedWorkload, TurnGrammar

TOOL = "run_python"
MAX_CODE_CHARS = 8000
GRAMMAR = TurnGrammar(Call("python", TOOL), Result("output"), Answer(), strip=False, max_chars=MAX_CODE_CHARS)
"""Code is kept as written (strip=False): its indentation is part of it."""
_INSTRUCTION = "Test code with <python>CODE</python>; answer with <answer>CODE</answer>."
_RESULT_PREFIX = "LIBRA-TEST"

_HARNESS = '''
import json, os, signal, sys
nonce = os.environ.pop("LIBRA_NONCE")
tests = json.load(open("tests.json"))
os.remove("tests.json")
class _Slow(Exception):
    pass
def _alarm(signum, frame):
    raise _Slow()
signal.signal(signal.SIGALRM, _alarm)
scope = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), scope)
    loaded = ""
except BaseException as error:
    loaded = "solution failed to load: %%s: %%s" %% (type(error).__name__, error)
for index, test in enumerate(tests):
    if loaded:
        outcome = loaded
    else:
        signal.alarm(%(per_test_s)d)
        try:
            exec(test, dict(scope))
            outcome = "pass"
        except _Slow:
            outcome = "timeout"
        except BaseException as error:
            outcome = "%%s: %%s" %% (type(error).__name__, str(error)[:200])
        finally:
            signal.alarm(0)
    sys.stdout.write("%(prefix)s %%s %%d %%s\\n" %% (nonce, index, json.dumps(outcome)))
    sys.stdout.flush()
'''


class CodeAgentConfig(Section):
    """Python function tasks: the model may run code in a sandbox, then answers with code; reward = test pass rate."""

    name: Literal["code_agent"] = Field("code_agent", description="workload name")
    data: str = Field("configs/data/code_tasks.jsonl", min_length=1,
                      description="task file (JSONL: id, prompt, answer = reference solution, meta.tests = asserts)")
    limit: int = Field(0, ge=0, le=100_000_000, description="use only the first `limit` tasks (0: all)")
    wall_s: float = Field(5.0, gt=0, le=600, description="wall-clock limit of one sandboxed run (tool call or test run)")
    cpu_s: int = Field(4, ge=1, le=600, description="CPU-time limit of one sandboxed run")
    memory_mb: int = Field(512, ge=64, le=65536, description="address-space limit of one sandboxed run (MiB)")
    per_test_s: int = Field(2, ge=1, le=60, description="time limit of one hidden test inside the test run")
    output_chars: int = Field(400, ge=16, le=100_000, description="stdout/stderr shown to the model are cut to this")
    allow_unisolated_sandbox: bool = Field(
        False, description="where the sandbox has no namespaces (not root, or no unshare), run the code anyway "
                           "with rlimits only, as an unprivileged user; false: refuse to start")


class _TaskFile(PromptFile):
    @property
    def fix(self) -> str:
        return f"fix {self.path} (one JSON task per line: id, prompt, answer, meta.tests) or point workload.data elsewhere"


def tests_of(prompt: Prompt) -> list[str]:
    tests = prompt.meta.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
        from libra.errors import InvalidArgument

        raise InvalidArgument(f"code task {prompt.meta.get('row_id')!r} has no meta.tests (a list of Python "
                              "statements); add them to the task file")
    return tests


def _show(run: SandboxRun, chars: int) -> str:
    """What the model sees of a run: the status line, then the tails of stdout and stderr."""
    parts = [f"status: {run.status.value} ({run.reason})"]
    if run.stdout.strip():
        parts.append(run.stdout.strip()[-chars:])
    if run.stderr.strip():
        parts.append(run.stderr.strip()[-chars:])
    return "\n".join(parts)


class CodeEpisode(Episode):
    """A code-agent trajectory; its reward runs the hidden tests, so it is a coroutine."""

    async def reward(self, answer: FinalAnswer | None) -> float:  # type: ignore[override]
        if answer is None:
            return 0.0
        return await self.workload.pass_rate(self.prompt, answer.text)


class CodeAgentWorkload(TaggedWorkload):
    """Write-a-function tasks with a sandboxed Python tool; reward = hidden test pass rate."""

    name = "code_agent"
    grammar = GRAMMAR

    def __init__(self, config: CodeAgentConfig) -> None:
        self.config = config
        self.tasks = _TaskFile(config.data, "code_agent", config.limit)
        self.limits = SandboxLimits(wall_s=config.wall_s, cpu_s=config.cpu_s, memory_mb=config.memory_mb)
        check_isolation(config.allow_unisolated_sandbox)  # refuse to start rather than run code unisolated

    @property
    def num_prompts(self) -> int:
        return len(self.tasks)

    def prompt(self, prompt_id: int) -> Prompt:
        task = self.tasks.get(prompt_id)
        return Prompt(task.prompt_id, f"{task.text}\n{_INSTRUCTION}\n", task.answer, task.meta)

    def prompt_key(self, prompt_id: int) -> str:
        return self.tasks.key(prompt_id)

    def episode(self, prompt_id, sample_index, seed, budget) -> Episode:
        return CodeEpisode(self, self.prompt(prompt_id), sample_index, seed, budget)

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        if call.tool != TOOL:
            return ToolResult(call.tool, ToolStatus.FAILURE, f"unknown tool {call.tool!r}")
        limits = SandboxLimits(wall_s=min(self.limits.wall_s, timeout_s), cpu_s=self.limits.cpu_s,
                               memory_mb=self.limits.memory_mb)
        run = await run_in_sandbox(python_argv("main.py"), files={"main.py": call.arguments}, limits=limits,
                                   allow_unisolated=self.config.allow_unisolated_sandbox)
        status = {SandboxStatus.OK: ToolStatus.SUCCESS, SandboxStatus.ERROR: ToolStatus.FAILURE,
                  SandboxStatus.TIMEOUT: ToolStatus.TIMEOUT}[run.status]
        shown = self.grammar.defang(_show(run, self.config.output_chars))  # must not close our markup
        return ToolResult(TOOL, status, shown, detail=run.reason)

    def render_tool_result(self, result: ToolResult) -> str:
        return self.grammar.wrap(result.payload)  # the payload's own status line says how the run ended

    def reward(self, prompt: Prompt, answer: FinalAnswer | None) -> float:
        raise TypeError("the code agent's reward runs tests in a sandbox: use `await episode.reward(answer)` "
                        "or `await workload.pass_rate(prompt, code)`")

    async def pass_rate(self, prompt: Prompt, code: str) -> float:
        """Share of the prompt's hidden tests that `code` passes (each test under its own alarm)."""
        tests = tests_of(prompt)
        return sum(outcome == "pass" for outcome in await self.test_outcomes(code, tests)) / len(tests)

    async def test_outcomes(self, code: str, tests: list[str]) -> list[str]:
        """"pass", "timeout" or the error of each test; a test with no result line failed ("no result")."""
        nonce = secrets.token_hex(8)
        harness = _HARNESS % {"per_test_s": self.config.per_test_s, "prefix": _RESULT_PREFIX}
        limits = SandboxLimits(wall_s=self.limits.wall_s + self.config.per_test_s * len(tests),
                               cpu_s=self.limits.cpu_s + self.config.per_test_s * len(tests),
                               memory_mb=self.limits.memory_mb, output_bytes=64 * 1024)
        run = await run_in_sandbox(python_argv("harness.py"), limits=limits, env={"LIBRA_NONCE": nonce},
                                   files={"harness.py": harness, "solution.py": code, "tests.json": json.dumps(tests)},
                                   allow_unisolated=self.config.allow_unisolated_sandbox)
        outcomes = ["no result"] * len(tests)
        for line in run.stdout.splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[0] == _RESULT_PREFIX and parts[1] == nonce and parts[2].isdigit():
                index = int(parts[2])
                if 0 <= index < len(tests) and outcomes[index] == "no result":
                    try:
                        outcomes[index] = str(json.loads(parts[3]))
                    except ValueError:
                        pass
        return outcomes

    def demonstrations(self, count: int, seed: int) -> list[list[Segment]]:
        rng = random.Random(f"code-demo:{seed}")
        prompts = list(self.tasks.valid())
        return [self._demonstration(rng.choice(prompts), rng) for _ in range(count)]

    def _demonstration(self, prompt: Prompt, rng: random.Random) -> list[Segment]:
        segments: list[Segment] = [(self.prompt(prompt.prompt_id).text, False)]
        example = prompt.meta.get("example")
        if example and rng.random() < 0.5:
            code = f"{prompt.answer}\nprint({example})"
            segments.append((f"<python>{code}</python>", True))
            shown = ToolResult(TOOL, ToolStatus.SUCCESS, f"status: ok (exit code 0)\n{prompt.meta.get('example_output', '')}")
            segments.append((self.render_tool_result(shown), False))
        segments.append((f"<answer>{prompt.answer}</answer>", True))
        return segments

    def corpus(self, count: int, seed: int) -> Iterator[str]:
        for demonstration in self.demonstrations(count, seed):
            yield "".join(text for text, _ in demonstration)
        for reason in ("status: error (exit code 1)\nNameError: name 'x' is not defined",
                       "status: timeout (wall-clock limit 5.0s)", "status: error (killed by SIGXFSZ (file size limit))"):
            yield self.render_tool_result(ToolResult(TOOL, ToolStatus.FAILURE, reason))
