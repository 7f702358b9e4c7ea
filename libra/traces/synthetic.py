"""Generated traces, deterministic by seed.

- `drifting`: the long-tailed agentic trace of `libra sim`, one batch per training step, whose
  lengths grow as training proceeds (what the planner's online replanning must follow).
- `signal` / `no_signal`: the scheduler evaluation's single window of trajectories. In `signal`
  the first tool outcome predicts the rest (`search:large:success` -> a long continuation,
  `search:small:success` -> medium, `calc:small:failure` -> short); `no_signal` keeps the very
  same lengths and draws every tool outcome at random, so outcomes carry no information; its
  `tool_calls` option (`equal_depth`) also re-cuts every trajectory to the same number of tool
  calls, since in `signal` long trajectories make more calls than short ones.

All randomness comes from a seeded `random.Random`; output lengths are log-uniform inside a class
(a long tail inside each class).
"""

from __future__ import annotations

import random

from libra.errors import InvalidArgument
from libra.traces.spec import Trace, TrajectorySpec, TurnSpec, check

# -- the drifting trace of `libra sim` -----------------------------------------------------------
# class -> first tool (name, status, payload range), output tokens in all (range, before drift),
#          model turns (range), tool between later turns
DRIFT_CLASSES = {
    "short": (("calc", "failure", (5, 60)), (300, 1_500), (2, 2), ("calc", "success", (5, 60))),
    "medium": (("search", "success", (60, 250)), (1_500, 6_000), (2, 4), ("python", "success", (20, 200))),
    "long": (("search", "success", (2_000, 5_000)), (6_000, 20_000), (3, 6), ("search", "success", (300, 1_500))),
}


def drifting(steps: int, prompts_per_step: int, group_size: int, seed: int = 0, drift: float = 1.0,
             copies: int = 1) -> Trace:
    """A drifting long-tailed agentic trace: the lengths grow as training proceeds.

    At progress p = step / (steps - 1), output lengths are scaled by (1 + drift * p) and a prompt's
    share of long trajectories by (1 + drift * p) too (capped at 0.6), so late steps are longer on
    average and in the tail. The first tool outcome predicts a trajectory's class (what C-MLFQ
    learns from). Each generated trajectory stands for `copies` identical ones (`copies` must
    divide prompts_per_step * group_size).
    """
    batch = prompts_per_step * group_size
    if steps < 1 or prompts_per_step < 1 or group_size < 1:
        raise InvalidArgument(f"steps ({steps}), prompts_per_step ({prompts_per_step}) and group_size "
                              f"({group_size}) must be >= 1")
    if copies < 1 or batch % copies:
        raise InvalidArgument(f"copies ({copies}) must divide the batch of {batch} trajectories")
    if not 0 <= drift <= 10:
        raise InvalidArgument(f"drift must be in 0..10 (lengths grow by 1 + drift over the run), got {drift}")
    rng = random.Random(seed)
    pool = max(1, prompts_per_step * 4)
    p_long = [rng.choice((0.05, 0.1, 0.2)) for _ in range(pool)]
    prompt_len = [int(min(8_000, rng.lognormvariate(6.7, 0.5))) + 16 for _ in range(pool)]
    out = []
    for step in range(steps):
        growth = 1.0 + drift * (step / (steps - 1) if steps > 1 else 0.0)
        specs = []
        for unit in range(batch // copies):
            prompt = (step * prompts_per_step + unit * copies // group_size) % pool
            specs.append(_drifting_one(rng, f"s{step}-u{unit}", f"p{prompt}", step, prompt_len[prompt],
                                       min(0.6, p_long[prompt] * growth), growth, copies))
        out.append(tuple(specs))
    return check(Trace(tuple(out), f"synthetic(seed={seed}, drift={drift})"))


def _drifting_one(rng: random.Random, tid: str, prompt_id: str, step: int, prompt_tokens: int, p_long: float,
                  growth: float, copies: int) -> TrajectorySpec:
    draw = rng.random()
    cls = "long" if draw < p_long else "medium" if draw < p_long + 0.35 else "short"
    first, (low, high), (t_low, t_high), later = DRIFT_CLASSES[cls]
    turns = rng.randint(t_low, t_high)
    total = max(turns, int(low * (high / low) ** rng.random() * growth))
    cuts = sorted(rng.sample(range(1, total), turns - 1)) if turns > 1 else []
    outputs = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    specs = []
    for index, output in enumerate(outputs):
        if index + 1 == len(outputs):
            specs.append(TurnSpec(output))
            continue
        name, status, (p_low, p_high) = first if index == 0 else later
        latency = min(60.0, rng.lognormvariate(0.0, 0.8) * (2.0 if name == "search" else 0.5))
        specs.append(TurnSpec(output, name, status, rng.randint(p_low, p_high), latency))
    return TrajectorySpec(tid, prompt_id, step, prompt_tokens, tuple(specs), copies)


# -- the scheduler evaluation's signal / no-signal windows --------------------------------------
# class -> (first tool, continuation tokens range, further turns range, tool between further turns)
SIGNAL_CLASSES = {
    "long": (("search", "success", (3000, 6000)), (8000, 24000), (3, 5), ("search", "success", (400, 1500))),
    "medium": (("search", "success", (60, 250)), (1500, 5000), (2, 3), ("python", "success", (20, 200))),
    "short": (("calc", "failure", (5, 60)), (100, 600), (1, 1), None),
}
RANDOM_TOOLS = [("search", "success", (3000, 6000)), ("search", "success", (60, 250)),
                ("calc", "failure", (5, 60)), ("python", "success", (20, 200)), ("search", "success", (400, 1500))]


def _tool(rng: random.Random, kind: tuple) -> tuple[str, str, int, float]:
    name, status, (low, high) = kind
    return name, status, rng.randint(low, high), rng.uniform(0.5, 3.0)


def _with_tools(outputs: tuple[int, ...], tools: list[tuple[str, str, int, float]]) -> tuple[TurnSpec, ...]:
    """Turns from per-turn outputs and the tool call between consecutive turns."""
    return tuple(TurnSpec(output, *tool) for output, tool in zip(outputs, tools)) + (TurnSpec(outputs[-1]),)


def signal(n: int, seed: int, n_prompts: int | None = None, prefix: str = "t") -> list[TrajectorySpec]:
    """Long-tailed trajectories whose first tool outcome predicts how much is left to generate."""
    rng = random.Random(seed)
    prompt_mix = random.Random(f"prompts:{seed // 1000}")  # same prompt pool for seeds of one family
    n_prompts = n_prompts or max(1, n // 4)
    p_long = [prompt_mix.choice((0.03, 0.1, 0.3)) for _ in range(n_prompts)]
    trace = []
    for i in range(n):
        prompt = rng.randrange(n_prompts)
        draw = rng.random()
        cls = "long" if draw < p_long[prompt] else "medium" if draw < p_long[prompt] + 0.35 else "short"
        first, (low, high), (t_low, t_high), between = SIGNAL_CLASSES[cls]
        turns = rng.randint(t_low, t_high)
        total = int(low * (high / low) ** rng.random())
        cuts = sorted(rng.randint(1, total - 1) for _ in range(turns - 1))
        continuation = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        tools = [_tool(rng, first)] + [_tool(rng, between) for _ in range(turns - 1)]
        prompt_tokens = rng.randint(200, 1200)
        outputs = (rng.randint(150, 400), *continuation)
        trace.append(TrajectorySpec(f"{prefix}{i}", f"p{prompt}", 0, prompt_tokens, _with_tools(outputs, tools)))
    return trace


def no_signal(n: int, seed: int, n_prompts: int | None = None, prefix: str = "t",
              tool_calls: int | None = None) -> list[TrajectorySpec]:
    """The same trajectories as `signal(n, seed)` with every tool outcome drawn at random.

    With `tool_calls` every trajectory is re-cut to exactly that many tool calls (tool_calls + 1
    model turns): the first turn keeps its length, the rest of the output is cut at random points,
    so that neither the outcomes nor the *number* of calls says how long a trajectory runs.
    """
    if tool_calls is not None and not 1 <= tool_calls <= 64:
        raise InvalidArgument(f"tool_calls must be in 1..64 (tool calls per trajectory), got {tool_calls}")
    rng = random.Random(f"noise:{seed}")
    out = []
    for spec in signal(n, seed, n_prompts, prefix):
        outputs = spec.outputs if tool_calls is None else _recut(rng, spec.outputs, tool_calls)
        tools = [_tool(rng, rng.choice(RANDOM_TOOLS)) for _ in outputs[:-1]]
        out.append(TrajectorySpec(spec.trajectory_id, spec.prompt_id, 0, spec.prompt_tokens,
                                  _with_tools(outputs, tools)))
    return out


def equal_depth(n: int, seed: int, n_prompts: int | None = None, prefix: str = "t",
                tool_calls: int = 3) -> list[TrajectorySpec]:
    """`no_signal` with every trajectory re-cut to `tool_calls` tool calls (the evaluation's third trace)."""
    return no_signal(n, seed, n_prompts, prefix, tool_calls)


def _recut(rng: random.Random, outputs: tuple[int, ...], tool_calls: int) -> tuple[int, ...]:
    """The first turn as it was, the rest of the output cut into `tool_calls` turns (each >= 1 token)."""
    rest = sum(outputs[1:])
    if rest < tool_calls:
        rest = tool_calls  # a continuation shorter than the turns it must fill: one token each
    cuts = sorted(rng.sample(range(1, rest), tool_calls - 1)) if tool_calls > 1 else []
    return (outputs[0], *(b - a for a, b in zip([0] + cuts, cuts + [rest])))
