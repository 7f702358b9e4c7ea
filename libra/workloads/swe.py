"""SWE repair in the R2E-Gym / SWE-bench task format: fix a repository until its failing tests pass.

A task (one line of the tasks file) names a repository snapshot and the tests that decide it::

    {"instance_id": "libra__spans-1", "repo_name": "spans", "repo_path": "repos/spans",
     "commit_hash": "…", "docker_image": "", "problem_statement": "merge() leaves touching …",
     "FAIL_TO_PASS": ["tests/test_merge.py::test_touching_intervals_merge"],
     "PASS_TO_PASS": ["tests/test_merge.py::test_empty", …], "modified_files": ["spans/merge.py"],
     "test_cmd": "python -m pytest -q -rA -p no:cacheprovider -o pythonpath=.",
     "patch": "--- a/spans/merge.py …", "fix_edits": [{"path": …, "old": …, "new": …}]}

(``repo_path`` is relative to the tasks file; ``patch`` is the reference fix as a unified diff, as
in SWE-bench; ``fix_edits`` is the same fix as edit-tool calls, for warm-start demonstrations.)

Each trajectory works on its own copy of the snapshot (made when the episode opens, deleted when
it closes). The model calls tools over many turns, one JSON call per turn (the tags are `GRAMMAR`)::

    <call>{"name": "view_file", "arguments": {"path": "spans/merge.py"}}</call><result>…</result>
    <call>{"name": "edit", "arguments": {"path": …, "old": …, "new": …}}</call><result>…</result>
    <call>{"name": "run_tests", "arguments": {}}</call><result>…</result><answer>done</answer>

Tools: ``view_file`` (numbered lines, or a directory listing), ``search`` (regex over the files),
``edit`` (replace one exact occurrence), ``run_tests`` (pytest in the sandbox, on a copy: a test
run never changes the checkout). File tools never leave the checkout (no ``..``, no symlinks).
The reward is 1 when every FAIL_TO_PASS test and every PASS_TO_PASS test passes, run in the
sandbox with the snapshot's own test files restored (edits to tests do not count), else 0.
Backend: the subprocess sandbox (`libra.workloads.sandbox`); a container backend is not built.
"""

from __future__ import annotations

import json
import pathlib
import random
import re
import shlex
import shutil
import tempfile
from typing import Any, Iterator, Literal

from pydantic import Field, model_validator

from libra.configbase import Section
from libra.errors import ConfigError, InvalidArgument
from libra.workloads.base import Episode, FinalAnswer, Prompt, Segment, ToolCall, ToolResult, ToolStatus
from libra.workloads.sandbox import SandboxLimits, SandboxStatus, check_isolation, python_argv, run_in_sandbox
from libra.workloads.turns import Answer, Call, Result, TaggedWorkload, TurnGrammar

TOOLS = ("view_file", "search", "edit", "run_tests")
REQUIRED = ("instance_id", "repo_name", "repo_path", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS")
MAX_EDIT_CHARS = 20_000
MAX_MATCHES = 20
GRAMMAR = TurnGrammar(Call("call", "call", "a tool call"), Result("result"), Answer(empty_ok=True))
"""The answer's text is not scored (the tests are), so ``<answer></answer>`` finishes too."""
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.M)
_INSTRUCTION = ('Call one tool per turn as <call>{"name": NAME, "arguments": {...}}</call> with NAME one of '
                'view_file(path), search(pattern), edit(path, old, new), run_tests(); finish with <answer>done</answer>.')


class SweConfig(Section):
    """Repository repair tasks in the R2E-Gym format: fix the code until FAIL_TO_PASS pass and PASS_TO_PASS still pass."""

    name: Literal["swe"] = Field("swe", description="workload name")
    tasks: str = Field("configs/data/swe/tasks.jsonl", min_length=1,
                       description="tasks file (JSONL, R2E-Gym/SWE-bench fields; repo_path relative to the file)")
    limit: int = Field(0, ge=0, le=1_000_000, description="use only the first `limit` tasks (0: all)")
    backend: Literal["subprocess"] = Field("subprocess", description="where tests run: the subprocess sandbox")
    test_wall_s: float = Field(30.0, gt=0, le=3600, description="wall-clock limit of one test run")
    test_cpu_s: int = Field(20, ge=1, le=3600, description="CPU-time limit of one test run")
    memory_mb: int = Field(1024, ge=128, le=65536, description="address-space limit of one test run (MiB)")
    output_chars: int = Field(600, ge=32, le=100_000, description="tool output shown to the model is cut to this")
    allow_unisolated_sandbox: bool = Field(
        False, description="where the sandbox has no namespaces (not root, or no unshare), run the code anyway "
                           "with rlimits only, as an unprivileged user; false: refuse to start")

    @model_validator(mode="after")
    def _tasks_exist(self) -> "SweConfig":
        if not pathlib.Path(self.tasks).is_file():
            raise ValueError(f"workload.tasks: no file at {self.tasks!r} (relative to {pathlib.Path.cwd()}); "
                             "point it at a JSONL of R2E-Gym-format tasks (see configs/data/swe/tasks.jsonl)")
        return self


def load_tasks(path: str | pathlib.Path, limit: int = 0) -> list[dict[str, Any]]:
    """The tasks of a tasks file, checked; `ConfigError` naming the line and the field otherwise."""
    path = pathlib.Path(path)
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"workload.tasks: {path} line {number} is not JSON ({error.msg})") from None
        missing = [f for f in REQUIRED if not task.get(f) and f != "PASS_TO_PASS"]
        if missing or not isinstance(task.get("PASS_TO_PASS", None), list):
            raise ConfigError(f"workload.tasks: {path} line {number} lacks {missing or ['PASS_TO_PASS']}; "
                              f"every task needs {', '.join(REQUIRED)}")
        task["repo_dir"] = str((path.parent / task["repo_path"]).resolve())
        if not pathlib.Path(task["repo_dir"]).is_dir():
            raise ConfigError(f"workload.tasks: {path} line {number}: repo_path {task['repo_path']!r} is not a "
                              f"directory next to the tasks file")
        tasks.append(task)
        if limit and len(tasks) >= limit:
            break
    if not tasks:
        raise ConfigError(f"workload.tasks: {path} has no tasks")
    return tasks


def repo_files(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def parse_test_report(stdout: str) -> dict[str, str]:
    """test id -> PASSED/FAILED/ERROR/… from pytest's ``-rA`` summary lines."""
    return {test: outcome for outcome, test in _OUTCOME.findall(stdout)}


class Checkout:
    """A trajectory's private copy of a repository and the file tools over it."""

    def __init__(self, source: str, output_chars: int):
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="libra-swe-")) / "repo"
        shutil.copytree(source, self.root, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        self.output_chars = output_chars

    def close(self) -> None:
        shutil.rmtree(self.root.parent, ignore_errors=True)

    def resolve(self, relative: Any) -> pathlib.Path:
        """A path inside the checkout; `ValueError` for anything that would leave it."""
        if not isinstance(relative, str) or not relative.strip():
            raise ValueError("path must be a non-empty string")
        candidate = self.root / relative.strip().lstrip("/")
        for parent in [candidate, *candidate.parents]:
            if parent == self.root:
                break
            if parent.is_symlink():
                raise ValueError(f"{relative} goes through a symlink")
        resolved = candidate.resolve()
        if resolved != self.root and self.root not in resolved.parents:
            raise ValueError(f"{relative} is outside the repository")
        return resolved

    def cut(self, text: str) -> str:
        return text if len(text) <= self.output_chars else text[:self.output_chars] + "\n[... cut]"

    def view_file(self, path: Any, start: Any = 1, end: Any = None) -> str:
        target = self.resolve(path)
        if target.is_dir():
            return self.cut("\n".join(repo_files(target)) or "(empty directory)")
        if not target.is_file():
            raise ValueError(f"no file {path}")
        lines = target.read_text(errors="replace").splitlines()
        first = max(int(start or 1), 1)
        last = min(int(end), len(lines)) if end else len(lines)
        return self.cut("\n".join(f"{n:4d} {lines[n - 1]}" for n in range(first, last + 1)) or "(no lines)")

    def search(self, pattern: Any, path: Any = ".") -> str:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("pattern must be a non-empty string")
        try:
            regex = re.compile(pattern)
        except re.error:
            regex = re.compile(re.escape(pattern))
        base = self.resolve(path)
        files = [base] if base.is_file() else [self.root / f for f in repo_files(base)]
        hits = []
        for file in files:
            for number, line in enumerate(file.read_text(errors="replace").splitlines(), start=1):
                if regex.search(line):
                    hits.append(f"{file.relative_to(self.root)}:{number}: {line.strip()}")
                    if len(hits) >= MAX_MATCHES:
                        return self.cut("\n".join(hits) + "\n[... more matches]")
        return self.cut("\n".join(hits) or "no matches")

    def edit(self, path: Any, old: Any, new: Any) -> str:
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            raise ValueError("old must be a non-empty string and new a string")
        if len(new) > MAX_EDIT_CHARS:
            raise ValueError(f"new is longer than {MAX_EDIT_CHARS} characters")
        target = self.resolve(path)
        if not target.is_file():
            raise ValueError(f"no file {path}")
        text = target.read_text()
        count = text.count(old)
        if count != 1:
            raise ValueError(f"old occurs {count} times in {path}; it must occur exactly once")
        target.write_text(text.replace(old, new, 1))
        return f"edited {path}"


class SweEpisode(Episode):
    """One repair attempt: a private checkout, the tools over it, and a test-running reward."""

    def __init__(self, workload: "SweWorkload", prompt: Prompt, *args) -> None:
        super().__init__(workload, prompt, *args)
        self.task = workload.tasks[prompt.prompt_id]
        self.checkout = Checkout(self.task["repo_dir"], workload.config.output_chars)

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        try:
            request = json.loads(call.arguments)
        except json.JSONDecodeError as error:
            return ToolResult("format", ToolStatus.FAILURE, f"call is not JSON: {error.msg}")
        if not isinstance(request, dict) or request.get("name") not in TOOLS:
            return ToolResult("format", ToolStatus.FAILURE, f"name must be one of {', '.join(TOOLS)}")
        tool, arguments = request["name"], request.get("arguments") or {}
        if not isinstance(arguments, dict):
            return ToolResult(tool, ToolStatus.FAILURE, "arguments must be an object")
        if tool == "run_tests":
            return await self.workload.run_tests_tool(self.task, self.checkout, arguments, timeout_s)
        try:
            payload = getattr(self.checkout, tool)(**arguments)
        except (TypeError, ValueError, OSError) as error:
            return ToolResult(tool, ToolStatus.FAILURE, self.workload.grammar.defang(str(error)))
        return ToolResult(tool, ToolStatus.SUCCESS, self.workload.grammar.defang(payload))

    async def reward(self, answer: FinalAnswer | None) -> float:  # type: ignore[override]
        """1.0 iff FAIL_TO_PASS and PASS_TO_PASS all pass on the edited checkout (tests restored)."""
        if answer is None:
            return 0.0
        return await self.workload.resolved(self.task, self.checkout.root)

    async def close(self) -> None:
        self.checkout.close()


class SweWorkload(TaggedWorkload):
    """R2E-Gym-format repository repair with file/search/edit/test tools; binary reward."""

    name = "swe"
    grammar = GRAMMAR

    def __init__(self, config: SweConfig) -> None:
        self.config = config
        self.tasks = load_tasks(config.tasks, config.limit)
        self.limits = SandboxLimits(wall_s=config.test_wall_s, cpu_s=config.test_cpu_s, memory_mb=config.memory_mb,
                                    output_bytes=32_768)
        check_isolation(config.allow_unisolated_sandbox)  # refuse to start rather than run tests unisolated

    @property
    def num_prompts(self) -> int:
        return len(self.tasks)

    def prompt(self, prompt_id: int) -> Prompt:
        if not 0 <= prompt_id < len(self.tasks):
            raise InvalidArgument(f"prompt_id must be in 0..{len(self.tasks) - 1}, got {prompt_id}")
        task = self.tasks[prompt_id]
        files = ", ".join(repo_files(pathlib.Path(task["repo_dir"])))
        text = (f"Repository {task['repo_name']} (files: {files}).\nIssue: {task['problem_statement']}\n"
                f"{_INSTRUCTION}\n")
        return Prompt(prompt_id, text, "resolved", {"instance_id": task["instance_id"]})

    def prompt_key(self, prompt_id: int) -> str:
        return f"swe:{self.tasks[prompt_id]['instance_id']}"

    def episode(self, prompt_id, sample_index, seed, budget) -> Episode:
        return SweEpisode(self, self.prompt(prompt_id), sample_index, seed, budget)

    async def call_tool(self, call: ToolCall, timeout_s: float) -> ToolResult:
        return ToolResult(call.tool, ToolStatus.FAILURE, "swe tools need a checkout: open an episode")

    def render_tool_result(self, result: ToolResult) -> str:
        if result.status is ToolStatus.SUCCESS:
            return self.grammar.wrap(result.payload)
        return self.grammar.wrap(f"{result.status.value}: {result.payload}")

    def reward(self, prompt: Prompt, answer: FinalAnswer | None) -> float:
        raise TypeError("the swe reward runs the task's tests on a checkout: use `await episode.reward(answer)`")

    # -- tests -----------------------------------------------------------------------------------
    def _test_argv(self, task: dict[str, Any], tests: list[str]) -> list[str]:
        command = shlex.split(task.get("test_cmd") or "python -m pytest -q -rA -p no:cacheprovider -o pythonpath=.")
        if command[:1] != ["python"]:
            raise InvalidArgument(f"task {task['instance_id']}: test_cmd must start with `python`, got {command[:1]}")
        return python_argv(*command[1:], *tests)

    async def run_tests(self, task: dict[str, Any], root: pathlib.Path, tests: list[str],
                        limits: SandboxLimits | None = None) -> tuple[dict[str, str], Any]:
        run = await run_in_sandbox(self._test_argv(task, tests), source=root, limits=limits or self.limits,
                                   allow_unisolated=self.config.allow_unisolated_sandbox)
        return parse_test_report(run.stdout), run

    async def run_tests_tool(self, task: dict[str, Any], checkout: Checkout, arguments: dict,
                             timeout_s: float) -> ToolResult:
        tests = arguments.get("tests") or []
        if not isinstance(tests, list) or not all(isinstance(t, str) and not t.startswith("-") for t in tests):
            return ToolResult("run_tests", ToolStatus.FAILURE, "tests must be a list of test ids")
        limits = SandboxLimits(wall_s=min(self.limits.wall_s, timeout_s), cpu_s=self.limits.cpu_s,
                               memory_mb=self.limits.memory_mb, output_bytes=self.limits.output_bytes)
        run = await run_in_sandbox(self._test_argv(task, tests), source=checkout.root, limits=limits,
                                   allow_unisolated=self.config.allow_unisolated_sandbox)
        report = parse_test_report(run.stdout)
        if run.status is SandboxStatus.TIMEOUT:
            return ToolResult("run_tests", ToolStatus.TIMEOUT, f"test run stopped: {run.reason}", detail=run.reason)
        summary = "\n".join(f"{outcome} {test}" for test, outcome in sorted(report.items()))
        if not report:
            summary = (run.stdout.strip().splitlines() or [run.reason])[-1]
        failed = [t for t, outcome in report.items() if outcome in ("FAILED", "ERROR")]
        status = ToolStatus.SUCCESS if report and not failed else ToolStatus.FAILURE
        return ToolResult("run_tests", status, self.grammar.defang(checkout.cut(summary)), detail=run.reason)

    async def resolved(self, task: dict[str, Any], root: pathlib.Path) -> float:
        """1.0 iff the task's FAIL_TO_PASS and PASS_TO_PASS tests all pass on `root` (its test files restored)."""
        stage = pathlib.Path(tempfile.mkdtemp(prefix="libra-swe-eval-")) / "repo"
        try:
            shutil.copytree(root, stage, symlinks=True)
            original = pathlib.Path(task["repo_dir"])
            for test_file in {t.split("::")[0] for t in task["FAIL_TO_PASS"] + task["PASS_TO_PASS"]}:
                source, target = original / test_file, stage / test_file
                if target.is_symlink() or target.is_dir():
                    return 0.0
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
            tests = list(task["FAIL_TO_PASS"]) + list(task["PASS_TO_PASS"])
            report, _ = await self.run_tests(task, stage, tests)
        finally:
            shutil.rmtree(stage.parent, ignore_errors=True)
        return 1.0 if all(report.get(test) == "PASSED" for test in tests) else 0.0

    # -- warm start ------------------------------------------------------------------------------
    def demonstrations(self, count: int, seed: int) -> list[list[Segment]]:
        rng = random.Random(f"swe-demo:{seed}")
        return [self._demonstration(rng.randrange(len(self.tasks))) for _ in range(count)]

    def _demonstration(self, prompt_id: int) -> list[Segment]:
        task = self.tasks[prompt_id]
        checkout = Checkout(task["repo_dir"], self.config.output_chars)
        try:
            segments: list[Segment] = [(self.prompt(prompt_id).text, False)]
            for edit in task.get("fix_edits", []):
                calls = [("view_file", {"path": edit["path"]}, checkout.view_file),
                         ("edit", edit, checkout.edit)]
                for name, arguments, tool in calls:
                    segments.append((f"<call>{json.dumps({'name': name, 'arguments': arguments})}</call>", True))
                    payload = self.grammar.defang(tool(**arguments))
                    segments.append((self.render_tool_result(ToolResult(name, ToolStatus.SUCCESS, payload)), False))
            tests = sorted(task["FAIL_TO_PASS"] + task["PASS_TO_PASS"])
            segments.append(('<call>{"name": "run_tests", "arguments": {}}</call>', True))
            shown = "\n".join(f"PASSED {test}" for test in tests)
            segments.append((self.render_tool_result(ToolResult("run_tests", ToolStatus.SUCCESS, shown)), False))
            segments.append(("<answer>done</answer>", True))
            return segments
        finally:
            checkout.close()

    def corpus(self, count: int, seed: int) -> Iterator[str]:
        for demonstration in self.demonstrations(count, seed):
            yield "".join(text for text, _ in demonstration)
        for reason in ("old occurs 0 times in x.py; it must occur exactly once", "call is not JSON: Expecting value",
                       "no file x.py", "x is outside the repository", "FAILED tests/test_x.py::test_y"):
            yield self.render_tool_result(ToolResult("edit", ToolStatus.FAILURE, reason))
