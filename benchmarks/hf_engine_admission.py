"""The transformers engine under a closed loop of multi-turn clients, at several admission settings
(`rollout.worker.engine: {type: hf, prefill_ratio, prefill_wait_steps}`), side by side in one
process: how many turns per second it serves, their latency, and the CPU a turn costs.

    .venv/bin/python benchmarks/hf_engine_admission.py [--rounds 3] [--turns 600] [--users 32]
        [--baseline-file OLD_hf_engine.py]

Each of `--users` clients sends a turn (its context, 30-60 ids to start, the last 200 ids after),
waits for the reply, and sends its next turn `--gap` seconds later (the gateway's time between
turns): the quickstart's shape on one engine worker (32 trajectories in flight each, turns of 8-47
new tokens, temperature 1). The engine is the quickstart's own warm-started model from the model
cache, on one torch thread. Rounds are interleaved (every setting once, then again) and each round's
clients draw the same turns. `--baseline-file` adds the engine of another module (e.g. `git show
REV:services/rollout/engines/hf_engine.py > /tmp/old.py`) as the first contender, with its own
admission. Prints per contender the median over rounds of wall seconds for `--turns` turns, CPU
seconds of the process over them, turn latency p50 / p90, and the ratio of each to the first.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import pathlib
import random
import statistics
import sys
import tempfile
import threading
import time

import torch

from libra.config import load_run_config
from libra.services.rollout.engines import hf_engine
from libra.services.trainer.model_state import base_model

# (prefill_ratio, prefill_wait_steps): (0, 0) prefills every arrival at once; (0.5, 8) is the default
SETTINGS = ((0.0, 0), (0.5, 4), (0.5, 8), (1.0, 8), (64.0, 8))


def closed_loop(engine, module, users: int, turns: int, gap_s: float, seed: int) -> tuple[float, float, list[float]]:
    """(wall s, process CPU s, latencies) of `turns` turns from `users` clients, each next turn `gap_s`
    after the last reply."""
    rng = random.Random(seed)
    vocab = engine.vocab_size
    wake = threading.Condition()
    due: list[tuple[float, int]] = []
    contexts = {u: [rng.randrange(3, vocab) for _ in range(rng.randrange(30, 61))] for u in range(users)}
    latencies: list[float] = []

    def send(user: int) -> None:
        sent = time.perf_counter()

        def done(request, user=user, sent=sent) -> None:
            with wake:
                latencies.append(time.perf_counter() - sent)
                contexts[user] = (contexts[user] + request.generated)[-200:]
                heapq.heappush(due, (time.perf_counter() + gap_s, user))
                wake.notify()

        engine.submit(module.Request(list(contexts[user]), rng.randrange(8, 48), 1.0, 1.0, frozenset(), None, done))

    cpu, wall = time.process_time(), time.perf_counter()
    with wake:
        for user in range(users):
            send(user)
        while len(latencies) < turns:
            now = time.perf_counter()
            while due and due[0][0] <= now:
                send(heapq.heappop(due)[1])
            wake.wait(max(0.0005, due[0][0] - now) if due else 0.05)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    waiting = (lambda: engine.waiting) if hasattr(engine, "waiting") else engine._incoming.qsize  # an old module
    while engine.running or waiting():
        time.sleep(0.005)  # the turns still in flight finish before the next contender starts
    time.sleep(0.1)
    return wall, cpu, latencies[:turns]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=600)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between a reply and the next turn")
    parser.add_argument("--baseline-file", type=pathlib.Path, help="another hf_engine.py, run as the first contender")
    args = parser.parse_args()
    torch.set_num_threads(1)
    where = pathlib.Path(tempfile.mkdtemp()) / "base"
    base_model(load_run_config("configs/quickstart.yaml"), where)
    contenders = []  # (name, engine, module)
    if args.baseline_file:
        spec = importlib.util.spec_from_file_location("baseline_hf_engine", args.baseline_file)
        old = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look the module up
        spec.loader.exec_module(old)
        contenders.append((f"baseline {args.baseline_file.name}", old.HFEngine(str(where), max_model_len=512), old))
    for ratio, wait in SETTINGS:
        engine = hf_engine.HFEngine(str(where), max_model_len=512, prefill_ratio=ratio, prefill_wait_steps=wait)
        contenders.append((f"ratio {ratio} wait {wait}", engine, hf_engine))
    results: dict[str, list[tuple[float, float, list[float]]]] = {name: [] for name, _, _ in contenders}
    for index in range(args.rounds):
        for name, engine, module in contenders:
            results[name].append(closed_loop(engine, module, args.users, args.turns, args.gap, seed=index))
            print(f"round {index + 1}/{args.rounds} {name}: {results[name][-1][0]:.2f} s", flush=True)
    for _, engine, _ in contenders:
        engine.stop()
    print(f"\n{args.turns} turns, {args.users} clients, gap {args.gap} s, medians of {args.rounds} interleaved rounds")
    print(f"{'contender':<34} {'wall s':>7} {'ratio':>6} {'CPU ms/turn':>11} {'ratio':>6} {'p50 ms':>7} {'p90 ms':>7}")
    first = None
    for name, rows in results.items():
        wall = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows) / args.turns * 1000
        p50 = statistics.median(statistics.quantiles(r[2], n=10)[4] for r in rows) * 1000
        p90 = statistics.median(statistics.quantiles(r[2], n=10)[8] for r in rows) * 1000
        first = first or (wall, cpu)
        print(f"{name:<34} {wall:7.2f} {wall / first[0]:6.2f} {cpu:11.2f} {cpu / first[1]:6.2f} {p50:7.0f} {p90:7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
