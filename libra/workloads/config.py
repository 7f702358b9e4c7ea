"""Typed configs of the workloads (a discriminated union on `name`).

A config without `name` is the calculator (what configs written before the union meant). Dataset
workloads read a prepared JSONL (`data`); a missing file is a config error that names the field
and the command that writes it (`libra data prepare WORKLOAD --source RAW --out FILE`). Relative
paths are relative to the directory `libra` runs in, like `run_dir`.

Adding a workload: its config class here (a `Literal` name, joined to `WorkloadConfig`) and its
"module:Class" in `libra.workloads.base.WORKLOADS`.
"""

from __future__ import annotations

import pathlib
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from libra.configbase import Section


class CalculatorConfig(Section):
    """Arithmetic word problems the model solves by calling a calculator tool, then answering."""

    name: Literal["calculator"] = Field("calculator", description="workload name")
    num_prompts: int = Field(2000, ge=1, le=10_000_000, description="size of the prompt set")
    min_operand: int = Field(0, ge=0, le=10**9, description="smallest operand")
    max_operand: int = Field(99, ge=1, le=10**9, description="largest operand")
    max_operations: int = Field(2, ge=1, le=8, description="operations per problem (each needs one tool call)")
    seed: int = Field(0, ge=0, description="seed of the prompt set")
    direct_answer_fraction: float = Field(
        0.0, ge=0.0, le=1.0,
        description="share of warm-start demonstrations that answer at once, without the tool (a habit RL must unlearn)")

    @model_validator(mode="after")
    def _range(self) -> "CalculatorConfig":
        if self.min_operand > self.max_operand:
            raise ValueError("workload.min_operand must be <= workload.max_operand")
        return self


def _check_file(path: str, field: str, fix: str) -> None:
    if not pathlib.Path(path).is_file():
        raise ValueError(f"{field}: no file at {path!r} (relative to {pathlib.Path.cwd()}); {fix}")


class DatasetWorkload(Section):
    """Fields every dataset workload has: the prepared prompt file and how much of it to use."""

    data: str = Field(..., min_length=1, description="prepared prompt file (JSONL: id, prompt, answer, meta)")
    limit: int = Field(0, ge=0, le=100_000_000, description="use only the first `limit` rows (0: all)")

    @model_validator(mode="after")
    def _data_exists(self) -> "DatasetWorkload":
        name = getattr(self, "name", "WORKLOAD")
        _check_file(self.data, "workload.data",
                    f"write it with `libra data prepare {name} --source RAW_FILE --out {self.data}` "
                    "or point workload.data at a prepared JSONL")
        return self


class Gsm8kConfig(DatasetWorkload):
    """GSM8K grade-school math word problems, answered in one turn; reward by math-verify."""

    name: Literal["gsm8k"] = Field("gsm8k", description="workload name")
    data: str = Field("configs/data/gsm8k_sample.jsonl", min_length=1,
                      description="prepared prompt file (JSONL: id, prompt, answer, meta)")
    reasoning_in_demonstrations: bool = Field(
        True, description="warm-start demonstrations show the worked solution before the answer (when the row has one)")


class DapoMathConfig(DatasetWorkload):
    """DAPO-Math-17K competition problems; a checker tool says whether a boxed answer parses, the model may revise."""

    name: Literal["dapo_math"] = Field("dapo_math", description="workload name")
    data: str = Field("configs/data/dapo_sample.jsonl", min_length=1,
                      description="prepared prompt file (JSONL: id, prompt, answer, meta)")
    max_checks: int = Field(2, ge=0, le=100, description="checker calls allowed per trajectory (then the checker refuses)")
    check_demonstrations: float = Field(
        0.5, ge=0.0, le=1.0, description="share of warm-start demonstrations that call the checker before answering")


class RetrieverConfig(Section):
    """Where `<search>` queries go: a local BM25 index over a corpus file, or a Search-R1 retrieval server."""

    kind: Literal["bm25", "http"] = Field("bm25", description="bm25: local index over `corpus`; http: POST url/retrieve")
    corpus: str = Field("configs/data/search_corpus_sample.jsonl", min_length=1,
                        description="JSONL corpus for bm25: one document per line with `contents` (or `title` + `text`)")
    url: str = Field("", description="base URL of the retrieval server (kind: http), e.g. http://127.0.0.1:8000")
    topk: int = Field(3, ge=1, le=100, description="documents returned per query")
    max_doc_chars: int = Field(300, ge=16, le=100_000, description="each document is cut to this many characters")

    @model_validator(mode="after")
    def _source(self) -> "RetrieverConfig":
        if self.kind == "http" and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"workload.retriever.url must be an http(s):// URL when kind is http, got {self.url!r}")
        if self.kind == "bm25":
            _check_file(self.corpus, "workload.retriever.corpus",
                        "point it at a JSONL corpus (one {\"contents\": ...} per line) or use kind: http")
        return self


class SearchR1Config(DatasetWorkload):
    """Search-R1 question answering: `<search>` calls answered by a retriever; exact-match reward plus format checks."""

    name: Literal["search_r1"] = Field("search_r1", description="workload name")
    data: str = Field("configs/data/search_r1_sample.jsonl", min_length=1,
                      description="prepared prompt file (JSONL: id, prompt, answer, meta)")
    retriever: RetrieverConfig = Field(default_factory=RetrieverConfig, description="the search tool's backend")
    format_reward: float = Field(
        0.0, ge=0.0, le=1.0,
        description="reward of a well-formed trajectory whose answer is wrong (every turn parsed, one answer)")


def _workload_name(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("name", "calculator")
    return getattr(value, "name", "calculator")


from libra.workloads.code_agent import CodeAgentConfig  # noqa: E402  (code and SWE workloads keep their configs)
from libra.workloads.swe import SweConfig  # noqa: E402

WorkloadConfig = Annotated[
    Union[Annotated[CalculatorConfig, Tag("calculator")], Annotated[Gsm8kConfig, Tag("gsm8k")],
          Annotated[DapoMathConfig, Tag("dapo_math")], Annotated[SearchR1Config, Tag("search_r1")],
          Annotated[CodeAgentConfig, Tag("code_agent")], Annotated[SweConfig, Tag("swe")]],
    Discriminator(_workload_name, custom_error_type="unknown_workload",
                  custom_error_message="unknown workload name; known workloads: calculator, code_agent, dapo_math, gsm8k, search_r1, swe"),
]
"""The `workload` section: one of the workload configs, chosen by `name` (default: calculator)."""
