"""Benchmark: how long the planner's allocation search takes for a 1,024-GPU cluster.

H200 nodes, Qwen3-14B, one GRPO step of 256 prompts x 16 samples with a synthetic long-tailed
trace (log-normal prompt and output lengths, outputs capped at 32k). Prints the search time next
to the 1 s target, and the plan it found. `--whole-nodes auto` (the default, as `libra plan`)
searches twice on a cluster of whole nodes (whole-node splits and packed ones, then compares);
`on` or `off` searches once.

    .venv/bin/python benchmarks/planner_search.py [--gpus 1024] [--prompts 256] [--repeat 3]
                                                  [--whole-nodes auto|on|off]
"""

from __future__ import annotations

import argparse
import random
import time

from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import SearchConfig, search

TARGET_S = 1.0


def long_tailed_trace(prompts: int, group: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, output) lengths: shared prompt per group, heavy-tailed outputs (agentic turns)."""
    rng = random.Random(seed)
    trace = []
    for _ in range(prompts):
        prompt = min(16_000, int(rng.lognormvariate(7.0, 0.6)))  # median ~1.1k tokens
        for _ in range(group):
            trace.append((prompt, max(16, min(32_000, int(rng.lognormvariate(7.5, 1.0))))))  # median ~1.8k
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--whole-nodes", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args()
    model, gpu = model_named("qwen3-14b"), gpu_named("h200-141g")
    trace = long_tailed_trace(args.prompts, args.group)
    config = SearchConfig(total_gpus=args.gpus, group_size=args.group, whole_nodes=args.whole_nodes)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        result = search(model, gpu, trace, config)
        times.append(time.perf_counter() - start)
    print(f"planner search: {args.gpus} GPUs, {model.name} on {gpu.name}, {len(trace)} requests")
    print(f"  seconds (best of {args.repeat}): {min(times):.3f}   target: <= {TARGET_S:.1f}   "
          f"{'OK' if min(times) <= TARGET_S else 'OVER'}")
    print(f"  training layouts costed: {result.evaluated}, pruned by bound: {result.pruned}; {result.placement}")
    print(f"  best: {result.best.describe()}  ({result.sequences_per_s:.1f} sequences/s)")
    for alt in result.alternatives[1:]:
        print(f"   alt: {alt.describe()}")


if __name__ == "__main__":
    main()
