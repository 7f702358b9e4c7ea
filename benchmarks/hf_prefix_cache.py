"""The hf engine with and without its prefix cache (`rollout.worker.engine.prefix_cache_mib`), under
the quickstart's shape of agentic traffic, side by side in one process: CPU per turn, prompt
positions computed, turns per second.

    .venv/bin/python benchmarks/hf_prefix_cache.py [--rounds 3] [--trajectories 512] [--swap-every 0.3]

Trajectories come in groups of 8 sharing a prompt (20-40 ids), up to 64 in flight; a turn samples
up to 8-40 new ids (temperature 1, its own seed), the "tool" answers 3-8 ids `--gap` seconds later,
and the trajectory's next turn continues the whole conversation, for 1-4 turns. Every
`--swap-every` seconds a weight load runs in the engine (the same weights: what it costs is the
running rows' KV recomputed and, with the cache, the cache emptied), as the quickstart's trainer
publishes a version about every 0.3 s. The engine is the quickstart's warm-started model from the
model cache, on one torch thread. Rounds are interleaved (each setting once, then again) and draw
the same trajectories. Prints per setting the median over rounds: process CPU seconds, wall
seconds, prompt positions computed, prefix-cache hits, the engine thread's CPU by what it ran
(prefills, decode steps, the KV refresh of a weight load), and the ratios to no cache.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import tempfile
import threading
import time

import torch

from libra.config import load_run_config
from libra.services.rollout.engines.hf_engine import HFEngine, Request
from libra.services.trainer.model_state import base_model


def play(engine: HFEngine, trajectories: int, in_flight: int, gap_s: float, swap_every_s: float,
         seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = engine.vocab_size
    plans = []  # per trajectory: its prompt, and per turn (max new ids, tool ids)
    for group in range(0, trajectories, 8):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 41))]
        for _ in range(min(8, trajectories - group)):
            turns = [(rng.randrange(8, 41), [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 9))])
                     for _ in range(rng.randrange(1, 5))]
            plans.append((prompt, turns))
    wake = threading.Condition()
    due: list[tuple[float, int, int, list[int]]] = []  # (when, trajectory, turn, context)
    finished = [0]

    def send(index: int, turn: int, context: list[int]) -> None:
        max_tokens, tool = plans[index][1][turn]
        generator = torch.Generator().manual_seed(seed * 100_003 + index * 17 + turn)

        def done(request: Request) -> None:
            with wake:
                if turn + 1 < len(plans[index][1]):
                    heapq.heappush(due, (time.perf_counter() + gap_s, index, turn + 1,
                                         request.prompt + request.generated + tool))
                else:
                    finished[0] += 1
                wake.notify()

        engine.submit(Request(context, max_tokens, 1.0, 1.0, frozenset(), generator, done))

    started_cpu, started = time.process_time(), time.perf_counter()
    computed, hits, cpu = engine.prefill_tokens, engine.prefix.hits, dict(engine.cpu_s)
    next_swap = started + swap_every_s
    launched = 0
    for launched in range(min(in_flight, trajectories)):
        send(launched, 0, list(plans[launched][0]))
    launched += 1
    with wake:
        while finished[0] < trajectories:
            now = time.perf_counter()
            if swap_every_s and now >= next_swap:
                engine.control(engine.refresh_kv, lambda result, error: None)
                next_swap = now + swap_every_s
            while due and due[0][0] <= now:
                _, index, turn, context = heapq.heappop(due)
                send(index, turn, context)
            while launched < trajectories and launched - finished[0] < in_flight:
                send(launched, 0, list(plans[launched][0]))
                launched += 1
            wake.wait(timeout=min(0.005, max(0.0, (due[0][0] - now) if due else 0.005)))
    return {"cpu_s": time.process_time() - started_cpu, "wall_s": time.perf_counter() - started,
            "computed": engine.prefill_tokens - computed, "hits": engine.prefix.hits - hits,
            **{f"{kind}_cpu_s": engine.cpu_s[kind] - cpu[kind] for kind in cpu}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=512)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--gap", type=float, default=0.005, help="seconds from a reply to the next turn")
    parser.add_argument("--swap-every", type=float, default=0.3, help="seconds between weight loads (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_run_config("configs/quickstart.yaml")
    with tempfile.TemporaryDirectory() as scratch:
        base_model(config, f"{scratch}/base")
        settings = {"no cache": 0.0, "cache 256 MiB": 256.0}
        engines = {name: HFEngine(f"{scratch}/base", max_model_len=512, max_num_seqs=64, prefix_cache_mib=mib)
                   for name, mib in settings.items()}
        results: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
        try:
            for round_ in range(args.rounds):
                for name, engine in engines.items():
                    results[name].append(play(engine, args.trajectories, args.in_flight, args.gap,
                                              args.swap_every, seed=round_))
                    print(name, round_, {k: round(v, 3) for k, v in results[name][-1].items()}, flush=True)
        finally:
            for engine in engines.values():
                engine.stop()
    base = statistics.median(r["cpu_s"] for r in results["no cache"])
    prefill = statistics.median(r["prefill_cpu_s"] for r in results["no cache"])
    print(f"\n{'setting':15s} {'CPU s':>7s} {'wall s':>7s} {'positions':>10s} {'hits':>6s} {'prefill CPU s':>14s} "
          f"{'decode':>7s} {'refresh':>8s} {'CPU, prefill CPU vs no cache':>29s}")
    for name, rows in results.items():
        median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(f"{name:15s} {median['cpu_s']:7.2f} {median['wall_s']:7.2f} {median['computed']:10.0f} "
              f"{median['hits']:6.0f} {median['prefill_cpu_s']:14.2f} {median['decode_cpu_s']:7.2f} "
              f"{median['refresh_cpu_s']:8.2f} {median['cpu_s'] / base:14.2f}x {median['prefill_cpu_s'] / prefill:13.2f}x")


if __name__ == "__main__":
    main()
