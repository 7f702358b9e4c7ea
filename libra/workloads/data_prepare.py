"""`libra data prepare`: public datasets in their own formats -> Libra's prompt files (JSONL).

    libra data prepare gsm8k     --source gsm8k/main/train-00000-of-00001.parquet --out data/gsm8k.jsonl
    libra data prepare dapo_math --source dapo-math-17k.parquet
    libra data prepare search_r1 --source nq_hotpotqa_train/train.parquet

Sources (parquet, or JSON lines with the same fields):

- GSM8K (openai/gsm8k): `question`, `answer` whose last line is ``#### N``; the text before it
  becomes `meta.solution` (calculator annotations ``<<6*7=42>>`` removed), N the answer.
- DAPO-Math-17K: `prompt` (a chat list; the user turn holds the problem between DAPO's own
  instruction lines, which are dropped), `reward_model.ground_truth`, `data_source`, `ability`,
  `extra_info.index`.
- Search-R1 (nq / hotpotqa, the processed parquet or FlashRAG's JSONL): `question`, and
  `golden_answers` (or `reward_model.ground_truth.target`).

A row with a missing or empty field is reported (its number and why) and skipped; the summary
counts rows read, written and skipped per reason. No valid row at all is an error (exit 2). The
output is written to a temporary file and renamed, so a failed run never leaves half a file.
This module reads files only: nothing is fetched.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import re
from typing import Any, Callable, Iterator

from libra.errors import ConfigError
from libra.workloads.prompts import row_problem

_ANNOTATION = re.compile(r"<<[^<>]*>>")
_DAPO_HEAD = "Solve the following math problem"
_DAPO_TAIL = "Remember to put your answer"


class RowError(ValueError):
    """Why a source row cannot become a prompt row."""


@dataclasses.dataclass
class Summary:
    """What a preparation did: rows read, written, skipped (per reason), and the first few skipped."""

    source: str
    out: str
    read: int = 0
    written: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        found = [f"read {self.read} rows from {self.source}; wrote {self.written} to {self.out}; "
                 f"skipped {sum(self.skipped.values())}"]
        found += [f"  skipped {count}: {reason}" for reason, count in self.skipped.most_common()]
        found += [f"  e.g. row {row}: {reason}" for row, reason in self.examples]
        return found


def _text(row: dict, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"missing field {field}")
    return value.strip()


def _nested(row: dict, *path: str) -> Any:
    value: Any = row
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _row_id(row: dict, fallback: str, *path: str) -> str:
    value = _nested(row, *path) if path else None
    return str(value) if value not in (None, "") else fallback


def gsm8k_row(row: dict, index: int) -> dict:
    question, answer = _text(row, "question"), _text(row, "answer")
    solution, sep, final = answer.rpartition("####")
    final = final.strip().replace(",", "")
    if not sep or not final:
        raise RowError("answer does not end with '#### N'")
    return {"id": _row_id(row, f"gsm8k-{index}", "id"), "prompt": question, "answer": final,
            "meta": {"solution": _ANNOTATION.sub("", solution).strip(), "source": "gsm8k"}}


def _dapo_problem(prompt: Any) -> str:
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise RowError("missing field prompt (a user message)")
    blocks = [block.strip() for block in prompt.strip().split("\n\n")]
    if len(blocks) > 1 and blocks[0].startswith(_DAPO_HEAD):
        blocks = blocks[1:]
    if len(blocks) > 1 and blocks[-1].startswith(_DAPO_TAIL):
        blocks = blocks[:-1]
    return "\n\n".join(blocks)


def dapo_row(row: dict, index: int) -> dict:
    truth = _nested(row, "reward_model", "ground_truth")
    if not isinstance(truth, str) or not truth.strip():
        raise RowError("missing field reward_model.ground_truth")
    meta = {key: row[key] for key in ("data_source", "ability") if isinstance(row.get(key), str)}
    return {"id": _row_id(row, f"dapo-{index}", "extra_info", "index"), "prompt": _dapo_problem(row.get("prompt")),
            "answer": truth.strip(), "meta": meta}


def search_r1_row(row: dict, index: int) -> dict:
    question = _text(row, "question")
    answers = row.get("golden_answers")
    if answers is None or len(answers) == 0:
        answers = _nested(row, "reward_model", "ground_truth", "target")
    if isinstance(answers, str):
        answers = [answers]
    answers = [str(a).strip() for a in (answers or []) if str(a).strip()]
    if not answers:
        raise RowError("missing field golden_answers")
    meta = {"data_source": row["data_source"]} if isinstance(row.get("data_source"), str) else {}
    return {"id": _row_id(row, f"search-{index}", "id"), "prompt": question, "answer": answers, "meta": meta}


CONVERTERS: dict[str, Callable[[dict, int], dict]] = {
    "gsm8k": gsm8k_row, "dapo_math": dapo_row, "search_r1": search_r1_row,
}


def read_source(path: pathlib.Path) -> Iterator[Any]:
    """Rows of a parquet file (in batches) or a JSON-lines file; a line that is not JSON yields its error."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    yield RowError(f"not valid JSON ({error.msg})")


def prepare(workload: str, source: str | os.PathLike, out: str | os.PathLike, limit: int = 0) -> Summary:
    """Convert `source` into a prompt file at `out`; ConfigError when nothing valid comes out."""
    if workload not in CONVERTERS:
        raise ConfigError(f"workload {workload!r} has no data to prepare; choose one of {', '.join(sorted(CONVERTERS))}")
    source_path, out_path = pathlib.Path(source), pathlib.Path(out)
    if not source_path.is_file():
        raise ConfigError(f"--source: no file at {source_path}; pass the dataset's parquet or JSONL file")
    if source_path.suffix not in (".parquet", ".jsonl", ".json"):
        raise ConfigError(f"--source: {source_path.name} is neither .parquet nor .jsonl/.json (JSON lines)")
    summary, convert = Summary(str(source_path), str(out_path)), CONVERTERS[workload]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8") as handle:
            for index, row in enumerate(_rows(source_path)):
                if limit and summary.written >= limit:
                    break
                summary.read += 1
                try:
                    record = _convert(convert, row, index)
                except RowError as error:
                    summary.skipped[str(error)] += 1
                    if len(summary.examples) < 5:
                        summary.examples.append((index + 1, str(error)))
                    continue
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                summary.written += 1
        if summary.written == 0:
            reasons = "; ".join(f"{count} x {reason}" for reason, count in summary.skipped.most_common(3)) or "no rows"
            raise ConfigError(f"--source: no valid {workload} rows in {source_path} ({reasons}); "
                              f"check that it is the {workload} dataset (see docs/workloads.md)")
        partial.replace(out_path)
    finally:
        partial.unlink(missing_ok=True)
    return summary


def _rows(path: pathlib.Path) -> Iterator[Any]:
    try:
        yield from read_source(path)
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--source: cannot read {path}: {error}") from None
    except Exception as error:  # pyarrow raises its own types for a corrupt file
        if type(error).__module__.startswith("pyarrow"):
            raise ConfigError(f"--source: {path} is not a readable parquet file: {error}") from None
        raise


def _convert(convert: Callable[[dict, int], dict], row: Any, index: int) -> dict:
    if isinstance(row, RowError):
        raise row
    if not isinstance(row, dict):
        raise RowError(f"expected an object per row, got {type(row).__name__}")
    record = convert(row, index)
    problem = row_problem(record)
    if problem:
        raise RowError(problem)
    return record
