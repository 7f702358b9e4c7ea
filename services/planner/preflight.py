"""Preflight: plan for a cluster, a model and a length trace without starting anything.

Turns the search's candidates into plans (`libra.v1.Plan`) and a decision record: the chosen
plan, the alternatives with their predicted times, and why the best one won. Rollout buckets
come from the TP multiset: one bucket per TP degree, ordered by TP, each serving the outputs up to
a quantile of the trace (bucket i of k serves up to the (i+1)/k quantile; the last one up to the
longest output), so longer trajectories go to wider instances.
"""

from __future__ import annotations

import pathlib
import time
from typing import Sequence

import yaml
from pydantic import ValidationError

from libra.errors import ConfigError, InvalidArgument
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.search import Candidate, SearchConfig, search
from libra.traces import files, spec
from libra.v1 import common_pb2, planner_pb2

MAX_TOKENS = 10_000_000


def check_trace(trace: Sequence[tuple[int, int]], source: str = "trace") -> list[tuple[int, int]]:
    """Lengths must be positive and sane; the error names the first bad entry."""
    if not trace:
        raise InvalidArgument(f"{source} is empty: give at least one (prompt_tokens, output_tokens) pair")
    for index, (prompt, output) in enumerate(trace):
        if not (1 <= prompt <= MAX_TOKENS and 1 <= output <= MAX_TOKENS):
            raise InvalidArgument(f"{source} entry {index}: prompt_tokens={prompt}, output_tokens={output}; "
                                  f"both must be in 1..{MAX_TOKENS}")
    return [(int(p), int(o)) for p, o in trace]


def load_trace(path: str | pathlib.Path) -> list[tuple[int, int]]:
    """The (prompt, output) pairs of a trace file in any format `libra.traces.files` reads (CSV
    prompt_tokens,output_tokens, JSON lines with those fields, a trajectory JSONL, or the
    `trace.jsonl` a run recorded): each trajectory counts as (prompt + tool-result tokens, all
    generated tokens); failed recorded trajectories are left out."""
    try:
        return check_trace(spec.pairs(files.read(path)), str(path))
    except InvalidArgument as error:
        raise ConfigError(str(error)) from None


def spec_from_yaml(kind: type, text: str, what: str):
    """A GpuSpec/ModelSpec from YAML text (as the Preflight RPC carries it)."""
    try:
        data = yaml.safe_load(text) or {}
        return kind.model_validate(data)
    except (yaml.YAMLError, ValidationError, TypeError) as error:
        raise InvalidArgument(f"{what} is not a valid {kind.__name__}: {error}") from None


def to_plan(candidate: Candidate, trace: Sequence[tuple[int, int]], now: float) -> common_pb2.Plan:
    outputs = sorted(o for _, o in trace)
    groups = sorted(candidate.rollout)
    buckets = []
    for index, (tp, count) in enumerate(groups):
        last = index == len(groups) - 1
        quantile = outputs[-1] if last else outputs[min(len(outputs) - 1, len(outputs) * (index + 1) // len(groups))]
        buckets.append(common_pb2.BucketSpec(name=f"tp{tp}", tp=tp, replicas=count, max_tokens=quantile))
    layout = candidate.layout
    return common_pb2.Plan(
        training=common_pb2.TrainingLayout(gpus=layout.gpus, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                                           micro_batch=layout.micro_batch),
        buckets=buckets, source="search", reason=candidate.describe(),
        predicted_step_seconds=candidate.step_s, created_at=now)


def preflight(model: ModelSpec, gpu: GpuSpec, trace: Sequence[tuple[int, int]], gpus: int,
              top_k: int = 5) -> planner_pb2.PlanDecision:
    """Search the allocations of `gpus` GPUs; the decision lists the best plan and its rivals."""
    trace = check_trace(trace)
    if gpus < 2:
        raise InvalidArgument(f"gpus must be >= 2 (one to train, one to roll out), got {gpus}")
    result = search(model, gpu, trace, SearchConfig(total_gpus=gpus, top_k=max(1, top_k)))
    now = time.time()
    rejected = ", ".join(f"{reason} {count}" for reason, count in sorted(result.rejected.items())) or "none"
    candidates = [planner_pb2.Candidate(plan=to_plan(c, trace, now), predicted_train_seconds=c.train_s,
                                        predicted_rollout_seconds=c.rollout_s, feasible=True, note=c.describe())
                  for c in result.alternatives]
    best = result.best
    reason = (f"lowest predicted step time {best.step_s:.2f}s of {result.evaluated} training layouts costed "
              f"({result.pruned} pruned by the bound); layouts rejected: {rejected}")
    return planner_pb2.PlanDecision(timestamp=now, chosen=to_plan(best, trace, now), candidates=candidates,
                                    applied=False, reason=reason)
