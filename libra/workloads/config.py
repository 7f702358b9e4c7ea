"""Typed configs of the workloads (a discriminated union on `name`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

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


WorkloadConfig = CalculatorConfig
