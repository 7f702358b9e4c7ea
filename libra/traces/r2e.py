"""An R2E-Gym-like trace: software-engineering agents repairing repositories, one batch per training
step, lengths drifting as the policy learns. Deterministic by seed.

The shape follows what R2E-Gym/DeepSWE-style agents do (a 14B policy, a sandboxed repository, the
tools view_file / search / edit / run_tests): a long prompt (system prompt with the tool schemas,
then the issue), up to `MAX_TURNS` model turns, each ending in a tool call whose output comes back
as a payload, until the agent finishes or the budget of `MAX_NEW_TOKENS` generated tokens runs
out (such trajectories end at the budget: the pile-up at the cap of a long-tailed agentic run).
Test runs take seconds to a minute in the sandbox; file tools return in well under a second.

Per prompt (task), a difficulty draws the share of long trajectories; per trajectory a class:

    class    model turns   new tokens (before drift)   first tool call, as a rule
    short    2..5          1,500..6,000                search, small payload, success
    medium   4..8          5,000..14,000               view_file, medium payload, success
    long     7..12         12,000..30,000              run_tests, large payload, failure

The first tool outcome predicts the class `SIGNAL` of the time (else it is drawn from the other
classes' first calls), so the signal C-MLFQ learns from is there but imperfect. Drift: at progress
p = step / (steps - 1) the new tokens grow by (1 + drift * p), the turns by (1 + drift * p / 2) and
a task's share of long trajectories by (1 + drift * p) (capped at 0.6), each within the caps, so
late steps are longer and pile up at the budget. A trajectory's whole context (prompt, outputs,
payloads) stays within `MAX_CONTEXT` tokens: payloads are cut to fit.

Pure: all randomness from a seeded `random.Random`; no files.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random

from libra.errors import InvalidArgument
from libra.traces.spec import Trace, TrajectorySpec, TurnSpec, check

MAX_NEW_TOKENS = 30_000  # generated tokens per trajectory (all turns)
MAX_TURNS = 12  # model turns per trajectory
MAX_CONTEXT = 65_536  # prompt + outputs + tool payloads (a 64k context window)
SIGNAL = 0.8  # share of trajectories whose first tool call is their class's

# tool -> (payload tokens range, latency seconds: lognormal median, sigma, cap)
TOOLS = {
    "search": ((60, 800), (0.3, 0.6, 5.0)),
    "view_file": ((300, 2_500), (0.1, 0.5, 2.0)),
    "edit": ((40, 300), (0.1, 0.5, 2.0)),
    "run_tests": ((400, 4_000), (8.0, 0.9, 120.0)),
}
# class -> (model turns, new tokens before drift, first call (tool, payload range, status))
CLASSES = {
    "short": ((2, 5), (1_500, 6_000), ("search", (60, 240), "success")),
    "medium": ((4, 8), (5_000, 14_000), ("view_file", (600, 2_000), "success")),
    "long": ((7, 12), (12_000, 30_000), ("run_tests", (2_500, 4_000), "failure")),
}
LATER = (("view_file", 0.35), ("search", 0.15), ("edit", 0.25), ("run_tests", 0.25))
_LATER_NAMES = [name for name, _ in LATER]
_LATER_CUMULATIVE = [round(edge, 9) for edge in itertools.accumulate(weight for _, weight in LATER)]
_OTHERS = {cls: [other for other in CLASSES if other != cls] for cls in CLASSES}


def r2e_like(steps: int, prompts_per_step: int, group_size: int, seed: int = 0, drift: float = 1.0,
             copies: int = 1) -> Trace:
    """The trace (module docstring): `steps` batches of prompts_per_step x group_size trajectories,
    each generated trajectory standing for `copies` identical ones (`copies` divides the batch)."""
    batch = prompts_per_step * group_size
    if steps < 1 or prompts_per_step < 1 or group_size < 1:
        raise InvalidArgument(f"steps ({steps}), prompts_per_step ({prompts_per_step}) and group_size "
                              f"({group_size}) must be >= 1")
    if copies < 1 or batch % copies:
        raise InvalidArgument(f"copies ({copies}) must divide the batch of {batch} trajectories")
    if not 0 <= drift <= 10:
        raise InvalidArgument(f"drift must be in 0..10 (lengths grow by 1 + drift over the run), got {drift}")
    rng = random.Random(f"r2e:{seed}")
    pool = max(1, prompts_per_step * 4)  # tasks; each step takes the next prompts_per_step of them
    p_long = [rng.choice((0.1, 0.2, 0.35)) for _ in range(pool)]
    prompt_len = [int(min(8_000, 1_200 + rng.lognormvariate(7.0, 0.6))) for _ in range(pool)]
    out = []
    for step in range(steps):
        progress = step / (steps - 1) if steps > 1 else 0.0
        growth = 1.0 + drift * progress
        specs = []
        for unit in range(batch // copies):
            task = (step * prompts_per_step + unit * copies // group_size) % pool
            specs.append(_one(rng, f"s{step}-u{unit}", f"p{task}", step, prompt_len[task],
                              min(0.6, p_long[task] * growth), growth, 1.0 + drift * progress / 2, copies))
        out.append(tuple(specs))
    return check(Trace(tuple(out), f"r2e-like(seed={seed}, drift={drift})"))


def _uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An integer in low..high (one `random()` call: the generator's hot loop)."""
    return low + int(rng.random() * (high - low + 1))


def _one(rng: random.Random, tid: str, prompt_id: str, step: int, prompt_tokens: int, p_long: float,
         growth: float, turn_growth: float, copies: int) -> TrajectorySpec:
    draw = rng.random()
    cls = "long" if draw < p_long else "medium" if draw < p_long + 0.4 else "short"
    (t_low, t_high), (low, high), first = CLASSES[cls]
    if rng.random() >= SIGNAL:
        first = CLASSES[_OTHERS[cls][int(rng.random() * 2)]][2]
    turns = min(MAX_TURNS, round(_uniform_int(rng, t_low, t_high) * turn_growth))
    total = min(MAX_NEW_TOKENS, max(turns, int(low * (high / low) ** rng.random() * growth)))
    cuts = sorted(rng.sample(range(1, total), turns - 1)) if turns > 1 else []
    outputs = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    room = MAX_CONTEXT - prompt_tokens - total  # what the tool payloads may fill
    specs = []
    for index in range(turns - 1):
        if index == 0:
            name, (p_low, p_high), status = first
        else:
            pick = rng.random()
            name = _LATER_NAMES[bisect.bisect_right(_LATER_CUMULATIVE, pick)]  # the first edge above pick
            (p_low, p_high), status = TOOLS[name][0], "success"
            if name == "run_tests":
                status = "failure" if rng.random() < 0.6 else "success"
        median, sigma, cap = TOOLS[name][1]
        latency = min(cap, median * math.exp(sigma * rng.gauss(0.0, 1.0)))
        payload = min(max(0, room), _uniform_int(rng, p_low, p_high))
        room -= payload
        specs.append(TurnSpec(outputs[index], name, status, payload, round(latency, 3)))
    specs.append(TurnSpec(outputs[-1]))
    return TrajectorySpec(tid, prompt_id, step, prompt_tokens, tuple(specs), copies)
