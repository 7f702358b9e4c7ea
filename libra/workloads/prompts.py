"""Prepared prompt files: Libra's one prompt format for every dataset workload, and its reader.

One JSON object per line::

    {"id": "gsm8k-train-17", "prompt": "A baker ...", "answer": "18", "meta": {"solution": "..."}}

`prompt` is the task text (the workload adds its own turn-format instruction around it), `answer`
the reference (a string, or a non-empty list of acceptable strings), `meta` anything else the
workload may use. `libra data prepare` writes these files from the public datasets' own formats.

A row that cannot be used (bad JSON, a missing or empty field) keeps its position, so prompt ids
stay stable, and asking for it raises `InvalidArgument` naming the line and the fix: the runner
records that trajectory as failed and the service goes on. This module knows nothing about turns,
tools or rewards.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Iterator

from libra.errors import ConfigError, InvalidArgument
from libra.workloads.base import Prompt

FIELDS = ("id", "prompt", "answer")


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One line of a prompt file: the prompt it gives, or why it gives none."""

    line: int
    prompt: Prompt | None
    error: str = ""


def row_problem(record: Any) -> str:
    """Why a decoded line is not a valid prompt row ("" when it is)."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [name for name in FIELDS if name not in record or record[name] in (None, "", [])]
    if missing:
        return f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    if not isinstance(record["id"], (str, int)) or not isinstance(record["prompt"], str):
        return "id must be a string or integer and prompt a string"
    answer = record["answer"]
    if not isinstance(answer, str) and not (isinstance(answer, list) and all(isinstance(a, str) and a for a in answer)):
        return "answer must be a string or a list of non-empty strings"
    if not isinstance(record.get("meta", {}), dict):
        return "meta must be an object"
    return ""


def answers_of(prompt: Prompt) -> list[str]:
    """Every acceptable answer of a prompt (a prompt file may list several)."""
    return list(prompt.meta.get("answers") or [prompt.answer])


class PromptFile:
    """The rows of a prepared prompt file; prompt id i is line i + 1 (blank lines excepted)."""

    def __init__(self, path: str | pathlib.Path, workload: str, limit: int = 0):
        self.path, self.workload = pathlib.Path(path), workload
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"workload.data: cannot read {self.path}: {error}; {self.fix}") from None
        self.rows: list[PromptRow] = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            self.rows.append(self._row(len(self.rows), number, line))
            if limit and len(self.rows) >= limit:
                break
        if not any(row.prompt is not None for row in self.rows):
            first = self.rows[0].error if self.rows else "the file is empty"
            raise ConfigError(f"workload.data: {self.path} has no valid rows (line 1: {first}); {self.fix}")

    @property
    def fix(self) -> str:
        return f"prepare it with `libra data prepare {self.workload} --source RAW_FILE --out {self.path}`"

    def _row(self, prompt_id: int, number: int, line: str) -> PromptRow:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            return PromptRow(number, None, f"not valid JSON ({error.msg})")
        problem = row_problem(record)
        if problem:
            return PromptRow(number, None, problem)
        answers = record["answer"] if isinstance(record["answer"], list) else [record["answer"]]
        meta = {**record.get("meta", {}), "row_id": str(record["id"]), "answers": answers}
        return PromptRow(number, Prompt(prompt_id, record["prompt"], answers[0], meta))

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, prompt_id: int) -> Prompt:
        """The prompt with this id; `InvalidArgument` for an id out of range or an unusable row."""
        if not 0 <= prompt_id < len(self.rows):
            raise InvalidArgument(f"prompt_id must be in 0..{len(self.rows) - 1}, got {prompt_id}")
        row = self.rows[prompt_id]
        if row.prompt is None:
            raise InvalidArgument(f"{self.path} line {row.line} (prompt {prompt_id}): {row.error}; "
                                  f"fix the row or {self.fix}")
        return row.prompt

    def valid(self) -> Iterator[Prompt]:
        """Every usable prompt, in file order."""
        return (row.prompt for row in self.rows if row.prompt is not None)

    def key(self, prompt_id: int) -> str:
        row = self.rows[prompt_id] if 0 <= prompt_id < len(self.rows) else None
        return f"{self.workload}:{row.prompt.meta['row_id']}" if row and row.prompt else f"{self.workload}:{prompt_id}"
