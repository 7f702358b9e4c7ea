"""`libra data prepare`: each dataset's own format (parquet written here with pyarrow, and JSON lines)
becomes Libra's prompt file; bad rows are reported and skipped; no valid row is exit 2; the output
loads as the workload's data."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from libra.cli import main
from libra.errors import ConfigError
from libra.workloads.base import FinalAnswer, build_workload
from libra.workloads.config import DapoMathConfig, Gsm8kConfig, SearchR1Config
from libra.workloads.data_prepare import prepare

DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.")
DAPO_TAIL = 'Remember to put your answer on its own line after "Answer:".'


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gsm8k_parquet(tmp_path, capsys):
    source = tmp_path / "train.parquet"
    pq.write_table(pa.table({
        "question": ["Ada has 2 bags of 5 plums. How many plums?", "Bo buys 1,200 nails and uses 200. How many remain?",
                     "A question with no final line", None],
        "answer": ["2 bags of 5 is <<2*5=10>>10 plums.\n#### 10", "1200-200=<<1200-200=1000>>1000\n#### 1,000",
                   "it is 4", "#### 3"],
    }), source)
    out = tmp_path / "gsm8k.jsonl"
    assert main(["data", "prepare", "gsm8k", "--source", str(source), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "read 4 rows" in printed and "wrote 2" in printed and "skipped 2" in printed
    assert "row 3: answer does not end with '#### N'" in printed and "row 4: missing field question" in printed
    rows = _lines(out)
    assert [row["answer"] for row in rows] == ["10", "1000"]
    assert rows[0] == {"id": "gsm8k-0", "prompt": "Ada has 2 bags of 5 plums. How many plums?", "answer": "10",
                       "meta": {"solution": "2 bags of 5 is 10 plums.", "source": "gsm8k"}}
    workload = build_workload(Gsm8kConfig(data=str(out)))
    assert workload.num_prompts == 2 and workload.reward(workload.prompt(1), FinalAnswer("1000")) == 1.0


def test_dapo_parquet_strips_the_dataset_instructions(tmp_path):
    source = tmp_path / "dapo.parquet"
    content = f"{DAPO_HEAD}\n\nFind the number of divisors of 12.\n\n{DAPO_TAIL}"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "math_dapo", "prompt": [{"content": content, "role": "user"}], "ability": "MATH",
         "reward_model": {"ground_truth": "6", "style": "rule-lighteval/MATH_v2"}, "extra_info": {"index": "a-1"}},
        {"data_source": "math_dapo", "prompt": [{"content": "What is 1+1?", "role": "user"}], "ability": "MATH",
         "reward_model": {"ground_truth": "", "style": "rule"}, "extra_info": {"index": "a-2"}},
    ]), source)
    out = tmp_path / "dapo.jsonl"
    summary = prepare("dapo_math", source, out)
    assert (summary.read, summary.written) == (2, 1)
    assert dict(summary.skipped) == {"missing field reward_model.ground_truth": 1}
    assert _lines(out) == [{"id": "a-1", "prompt": "Find the number of divisors of 12.", "answer": "6",
                            "meta": {"data_source": "math_dapo", "ability": "MATH"}}]
    workload = build_workload(DapoMathConfig(data=str(out)))
    assert workload.reward(workload.prompt(0), FinalAnswer(r"\boxed{6}")) == 1.0


def test_search_r1_parquet_and_flashrag_jsonl(tmp_path):
    source = tmp_path / "nq.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"id": "train_0", "question": "who wrote the ballad of tolmar", "golden_answers": ["Ana Reyes", "Reyes"],
         "data_source": "nq", "reward_model": {"ground_truth": {"target": ["Ana Reyes", "Reyes"]}, "style": "rule"}},
        {"id": "train_1", "question": "where is calder", "golden_answers": [], "data_source": "nq",
         "reward_model": {"ground_truth": {"target": ["Vessia"]}, "style": "rule"}},
        {"id": "train_2", "question": "", "golden_answers": ["x"], "data_source": "nq",
         "reward_model": {"ground_truth": {"target": ["x"]}, "style": "rule"}},
    ]), source)
    out = tmp_path / "search.jsonl"
    summary = prepare("search_r1", source, out)
    assert (summary.written, dict(summary.skipped)) == (2, {"missing field question": 1})
    rows = _lines(out)
    assert rows[0]["answer"] == ["Ana Reyes", "Reyes"] and rows[1]["answer"] == ["Vessia"]  # falls back to target
    workload = build_workload(SearchR1Config(data=str(out)))
    assert workload.reward(workload.prompt(0), FinalAnswer("reyes")) == 1.0
    flashrag = tmp_path / "hotpotqa.jsonl"
    flashrag.write_text(json.dumps({"id": "h1", "question": "q?", "golden_answers": ["a"], "metadata": {}}) + "\n"
                        + "{broken\n")
    summary = prepare("search_r1", flashrag, tmp_path / "h.jsonl")
    assert summary.written == 1 and summary.examples[0][0] == 2 and "not valid JSON" in summary.examples[0][1]


def test_no_valid_rows_is_exit_2_and_leaves_no_file(tmp_path, capsys):
    source = tmp_path / "wrong.jsonl"
    source.write_text(json.dumps({"text": "a dataset of something else"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["data", "prepare", "gsm8k", "--source", str(source), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "no valid gsm8k rows" in error and "1 x missing field question" in error
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    assert main(["data", "prepare", "gsm8k", "--source", str(tmp_path / "nope.parquet")]) == 2
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(ConfigError, match="neither .parquet nor"):
        prepare("gsm8k", tmp_path / "data.csv", out)
    (tmp_path / "corrupt.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="not a readable parquet"):
        prepare("gsm8k", tmp_path / "corrupt.parquet", out)


def test_limit_stops_after_enough_valid_rows(tmp_path):
    source = tmp_path / "g.jsonl"
    source.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(10)))
    summary = prepare("gsm8k", source, tmp_path / "o.jsonl", limit=3)
    assert summary.written == 3 and len(_lines(tmp_path / "o.jsonl")) == 3
