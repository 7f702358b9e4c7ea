"""Routing decisions per second of the scheduler cores, in process, C-MLFQ beside load balance.

Both policies replay the same synthetic agentic workload: `--trajectories` live trajectories over
`--workers` workers in three buckets, each turn is routed, reported done and followed by a tool
return (C-MLFQ learns from those; load balance ignores them); every `--turns` turns a trajectory
finishes and a new one starts. The C-MLFQ tree is warmed first so tool returns find signal and
trajectories really move. Deterministic: the workload comes from a seeded `random.Random`.

    .venv/bin/python benchmarks/scheduler_decisions.py [--decisions 200000]

Prints decisions/s for each policy twice: for the whole cycle (Route plus the turn, tool and finish
reports, which is where C-MLFQ learns), and for the time inside Route alone; and the C-MLFQ /
load-balance ratios. The target is >= 50,000 C-MLFQ decisions/s for the whole cycle.
"""

from __future__ import annotations

import argparse
import random
import time

from libra.routing.baselines import LoadBalance
from libra.routing.cmlfq import CMLFQ
from libra.routing.policy import Policy, Turn, Worker
from libra.routing.prefix_tree import PrefixForest

BUCKETS = [("short", 4_000), ("medium", 12_000), ("long", 30_000)]
TOOLS = ("search", "python", "browse")
STATUSES = ("success", "success", "success", "failure", "timeout")
TARGET = 50_000


TP = {"short": 1, "medium": 2, "long": 4}


def build(policy: Policy, workers: int) -> Policy:
    for i in range(workers):
        bucket = BUCKETS[i % len(BUCKETS)][0]
        policy.register(Worker(f"w{i}", bucket, f"http://w{i}", TP[bucket]))
    return policy


def workload(seed: int, decisions: int, trajectories: int, turns: int, prompts: int) -> list[tuple]:
    """(trajectory, prompt, turn, output tokens, tool, status, payload tokens, finishes) per decision."""
    rng = random.Random(seed)
    live = [(f"t{i}", f"p{rng.randrange(prompts)}", 0) for i in range(trajectories)]
    events, next_id = [], trajectories
    for _ in range(decisions):
        slot = rng.randrange(trajectories)
        tid, prompt, turn = live[slot]
        finishes = turn + 1 >= turns
        events.append((tid, prompt, turn, rng.randrange(50, 3000), rng.choice(TOOLS), rng.choice(STATUSES),
                       rng.choice((20, 800, 6000)), finishes))
        if finishes:
            live[slot] = (f"t{next_id}", f"p{rng.randrange(prompts)}", 0)
            next_id += 1
        else:
            live[slot] = (tid, prompt, turn + 1)
    return events


def replay(policy: Policy, events: list[tuple]) -> tuple[float, float]:
    """Seconds for the whole cycle (route and every report) and seconds inside Route alone."""
    produced: dict[str, int] = {}
    clock, in_route = time.perf_counter, 0.0
    start = clock()
    for tid, prompt, turn, output, tool, status, payload, finishes in events:
        before = clock()
        decision = policy.route(Turn(tid, prompt, turn, 1_000, 2_000))
        in_route += clock() - before
        policy.turn_done(tid, decision.worker_id, output)
        produced[tid] = produced.get(tid, 0) + output
        if finishes:
            policy.finish(tid, prompt, produced.pop(tid))
        else:
            policy.tool_returned(tid, tool, status, payload)
    return clock() - start, in_route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=200_000, help="routing decisions per policy")
    parser.add_argument("--workers", type=int, default=12, help="workers, spread over three buckets")
    parser.add_argument("--trajectories", type=int, default=256, help="live trajectories at a time")
    parser.add_argument("--turns", type=int, default=8, help="turns per trajectory")
    parser.add_argument("--prompts", type=int, default=500, help="distinct prompt ids")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    args = parser.parse_args()
    events = workload(args.seed, args.decisions, args.trajectories, args.turns, args.prompts)
    warm = CMLFQ(1_000_000, buckets=BUCKETS, forest=PrefixForest(min_visits=3))
    replay(build(warm, args.workers), workload(args.seed + 1, args.decisions, args.trajectories, args.turns,
                                               args.prompts))
    cmlfq = build(CMLFQ(1_000_000, buckets=BUCKETS, forest=warm.forest), args.workers)
    load_balance = build(LoadBalance(1_000_000), args.workers)
    rates = {}
    for name, policy in (("load_balance", load_balance), ("cmlfq", cmlfq)):
        cycle, in_route = replay(policy, events)
        rates[name] = (len(events) / cycle, len(events) / in_route)
        print(f"{name:>12}: {rates[name][0]:>10,.0f} decisions/s with reports   "
              f"{rates[name][1]:>10,.0f} decisions/s in Route alone   "
              f"reasons {dict(policy.state.reasons.most_common(4))}")
    ratios = [rates["cmlfq"][i] / rates["load_balance"][i] for i in (0, 1)]
    print(f"{'cmlfq/lb':>12}: {ratios[0]:.2f}x with reports, {ratios[1]:.2f}x in Route alone; target "
          f"{TARGET:,}/s with reports: {'met' if rates['cmlfq'][0] >= TARGET else 'NOT met'}")
    print(f"{'signals':>12}: {dict(cmlfq.signals)}   prompt trees {len(cmlfq.forest.prompt_trees)}")


if __name__ == "__main__":
    main()
