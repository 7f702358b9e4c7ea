"""Preflight: plan for a cluster, a model and a length trace without starting anything.

Turns the search's candidates into plans (`libra.v1.Plan`) and a decision record: the chosen
plan, the alternatives with their predicted times, and why the best one won. Rollout buckets
come from the TP multiset: one bucket per TP degree, ordered by TP, each serving the outputs up to
a quantile of the trace (bucket i of k serves up to the (i+1)/k quantile; the last one up to the
longest output), so longer trajectories go to wider instances.

The Preflight RPC goes through `bounded_preflight`: its request is bounded (GPUs by
security.limits.max_gpus, the trace by MAX_TRACE, each YAML text by MAX_SPEC_BYTES and without
aliases); one search runs at a time (another call gets RESOURCE_EXHAUSTED), in a child process
that is killed when it passes security.limits.preflight_timeout_s (DEADLINE_EXCEEDED) or when the
call ends (its deadline, the planner stopping): a search never holds a core, or the planner's
shutdown, beyond its call.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import time
from typing import Any, Sequence

import yaml
from pydantic import ValidationError

from libra import log as liblog
from libra.errors import ConfigError, DeadlineExceeded, InvalidArgument, ResourceExhausted
from libra.security.credentials import child_environment
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.search import Candidate, SearchConfig, search
from libra.traces import files, spec
from libra.v1 import common_pb2, planner_pb2

_log = liblog.get("libra.planner")
MAX_TOKENS = 10_000_000
MAX_TRACE = 1_000_000  # length samples a Preflight request may carry
MAX_SPEC_BYTES = 64 * 1024  # each of its YAML texts
MAX_TOP_K = 100
_searching: list[bool] = []  # non-empty while this process runs a Preflight search
CHILD_INVALID, CHILD_FAILED = 3, 4  # exit codes of the search process: bad input, the search failed


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


def load_batch(path: str | pathlib.Path, batch: int = 0, group_size: int = 1) -> tuple[list[tuple[int, int]], str]:
    """One training step's (prompt, output) pairs from a trace file, and a line saying which
    (`load_batch_specs`, as the cost model sees them)."""
    specs, note = load_batch_specs(path, batch, group_size)
    return spec.pairs(specs), note


def load_batch_specs(path: str | pathlib.Path, batch: int = 0,
                     group_size: int = 1) -> tuple[list[spec.TrajectorySpec], str]:
    """One training step's trajectories from a trace file (their turns, where the file has them:
    what a replay on the simulator needs), and a line saying which.

    A trace that carries its steps (trajectory JSONL) gives its last step's batch (the most
    recent lengths); any other format the whole file. `batch` > 0 draws that many sequences
    (seed 0) instead: e.g. one step out of a whole recorded run. A whole file that is not a
    whole number of GRPO groups of `group_size` (a run's recording leaves failed trajectories
    out) is refused with the `--batch` that fixes it."""
    try:
        specs = files.read(path)
    except InvalidArgument as error:
        raise ConfigError(str(error)) from None
    steps = sorted({s.step for s in specs})
    note = f"{path}: {sum(s.copies for s in specs)} sequences"
    if len(steps) > 1 and not batch:
        specs = [s for s in specs if s.step == steps[-1]]
        note = f"{path}: step {steps[-1]}'s batch (the last of {len(steps)} steps in the file)"
    try:
        pairs = check_trace(spec.pairs(specs), str(path))
    except InvalidArgument as error:
        raise ConfigError(str(error)) from None
    if not batch and group_size > 1 and len(pairs) % group_size:
        fit = len(pairs) // group_size * group_size
        raise ConfigError(f"{note}, not a whole number of GRPO groups of {group_size} (a run's recording leaves "
                          f"failed trajectories out): pass --batch N, a multiple of {group_size} up to {fit} "
                          f"(e.g. --batch {min(fit, 1024 // group_size * group_size) or group_size}), to plan "
                          f"for N sequences drawn from it, or the group size the run used")
    if batch:
        if batch > len(pairs):
            raise ConfigError(f"--batch {batch} is larger than the trace ({len(pairs)} sequences)")
        import dataclasses
        import random

        each = [dataclasses.replace(s, trajectory_id=f"{s.trajectory_id}-{c}", copies=1)
                for s in specs for c in range(s.copies)]
        specs = random.Random(0).sample(each, batch)
        note = f"{path}: {batch} of its {len(pairs)} sequences, drawn with seed 0"
    return list(specs), note


def spec_from_yaml(kind: type, text: str, what: str):
    """A GpuSpec/ModelSpec from YAML text (as the Preflight RPC carries it)."""
    if len(text) > MAX_SPEC_BYTES:
        raise InvalidArgument(f"{what} is {len(text)} characters; at most {MAX_SPEC_BYTES}")
    try:
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise InvalidArgument(f"{what} uses YAML aliases (*name): write the values out")
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


def search_config(gpus: int, top_k: int = 5, options: dict | None = None) -> SearchConfig:
    """The search's config for `gpus` GPUs with `options` (SearchConfig fields: group_size,
    tp_choices, min_train_gpus, min_rollout_gpus, whole_nodes, ...); a bad one names its field."""
    if gpus < 2:
        raise InvalidArgument(f"gpus must be >= 2 (one to train, one to roll out), got {gpus}")
    try:
        return SearchConfig(total_gpus=gpus, top_k=max(1, top_k), **(options or {}))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "search options"
        raise InvalidArgument(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None


def preflight(model: ModelSpec, gpu: GpuSpec, trace: Sequence[tuple[int, int]], gpus: int,
              top_k: int = 5, options: dict | None = None) -> planner_pb2.PlanDecision:
    """Search the allocations of `gpus` GPUs; the decision lists the best plan and its rivals."""
    trace = check_trace(trace)
    config = search_config(gpus, top_k, options)
    if len(trace) % config.group_size:
        raise InvalidArgument(f"the batch of {len(trace)} sequences is not a whole number of GRPO groups of "
                              f"{config.group_size}: give a batch that is a multiple of the group size, or "
                              f"the group size the run uses")
    result = search(model, gpu, trace, config)
    now = time.time()
    rejected = "; ".join(f"{count} x {reason}" for reason, count in result.rejected.most_common()) or "none"
    candidates = [planner_pb2.Candidate(plan=to_plan(c, trace, now), predicted_train_seconds=c.train_s,
                                        predicted_rollout_seconds=c.rollout_s, feasible=True, note=c.describe())
                  for c in result.alternatives]
    best = result.best
    reason = (f"lowest predicted step time {best.step_s:.2f}s of {result.evaluated} training layouts costed "
              f"({result.pruned} pruned by the bound); {result.placement}; layouts rejected: {rejected}")
    return planner_pb2.PlanDecision(timestamp=now, chosen=to_plan(best, trace, now), candidates=candidates,
                                    applied=False, reason=reason)


async def bounded_preflight(request: Any, limits: Any) -> planner_pb2.PlanDecision:
    """The Preflight RPC's search (see the module docstring); `limits`: security.limits."""
    if not 2 <= request.gpus <= limits.max_gpus:
        raise InvalidArgument(f"gpus must be in 2..{limits.max_gpus} (security.limits.max_gpus), got {request.gpus}")
    if len(request.trace) > MAX_TRACE:
        raise InvalidArgument(f"trace: at most {MAX_TRACE} samples, got {len(request.trace)}")
    if request.top_k > MAX_TOP_K:
        raise InvalidArgument(f"top_k must be <= {MAX_TOP_K}, got {request.top_k}")
    gpu = spec_from_yaml(GpuSpec, request.cluster_yaml, "cluster_yaml")
    model = spec_from_yaml(ModelSpec, request.model_yaml, "model_yaml")
    trace = check_trace([(s.prompt_tokens, s.output_tokens) for s in request.trace])
    if _searching:
        raise ResourceExhausted("a Preflight search is running on this planner; retry when it is done")
    _searching.append(True)
    try:
        decision = await _in_child(model, gpu, trace, request.gpus, request.top_k or 5, limits.preflight_timeout_s)
    finally:
        _searching.clear()
    decision.reason = "preflight (not applied): " + decision.reason
    return decision


async def _in_child(model: ModelSpec, gpu: GpuSpec, trace: list, gpus: int, top_k: int,
                    timeout_s: float) -> planner_pb2.PlanDecision:
    """preflight() in a child process (`python -m libra.services.planner.preflight`: the request as
    JSON on stdin, the decision on stdout), killed at `timeout_s` or when this call is cancelled."""
    request = json.dumps({"model": model.model_dump(mode="json"), "gpu": gpu.model_dump(mode="json"),
                          "trace": trace, "gpus": gpus, "top_k": top_k}).encode()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "libra.services.planner.preflight", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=child_environment(dict(os.environ)))
    try:
        out, err = await asyncio.wait_for(child.communicate(request), timeout_s)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(f"the preflight search ran past security.limits.preflight_timeout_s ({timeout_s:g}s); "
                               f"ask for fewer GPUs or a shorter trace") from None
    finally:  # cancelled (the call's deadline, the service stopping) or timed out: the child goes now
        if child.returncode is None:
            child.kill()
            await child.wait()
    message = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
    if child.returncode == CHILD_INVALID:
        raise InvalidArgument(message[0])
    if child.returncode == CHILD_FAILED:  # the input passed the checks but the cost model cannot use it
        _log.warning("preflight search failed", error=message[0])
        raise InvalidArgument(f"the preflight search cannot cost this cluster, model and trace: {message[0]}")
    if child.returncode != 0:
        raise ResourceExhausted(f"the preflight search process died (exit code {child.returncode}; out of memory?)")
    return planner_pb2.PlanDecision.FromString(out)


def _child_main() -> int:
    """The child's side of `_in_child`: one preflight; exit CHILD_INVALID / CHILD_FAILED with the
    reason as the last line of stderr."""
    try:
        request = json.loads(sys.stdin.buffer.read())
        decision = preflight(ModelSpec.model_validate(request["model"]), GpuSpec.model_validate(request["gpu"]),
                             [tuple(pair) for pair in request["trace"]], request["gpus"], request["top_k"])
    except InvalidArgument as error:
        print(str(error).replace("\n", " "), file=sys.stderr)
        return CHILD_INVALID
    except Exception as error:  # noqa: BLE001 - reported to the parent, which fails the call
        print(f"{type(error).__name__}: {error}".replace("\n", " "), file=sys.stderr)
        return CHILD_FAILED
    sys.stdout.buffer.write(decision.SerializeToString())
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
