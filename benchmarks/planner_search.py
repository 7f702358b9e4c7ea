"""Benchmark: how long the planner's allocation search takes for a 1,024-GPU cluster.

H200 nodes, Qwen3-14B, one GRPO step of 256 prompts x 16 samples with a synthetic long-tailed
trace (log-normal prompt and output lengths, outputs capped at 32k). Prints the search time next
to the 1 s target, and the plan it found. `--whole-nodes auto` (the default, as `libra plan`)
searches twice on a cluster of whole nodes (whole-node splits and packed ones, then compares);
`on` or `off` searches once.

    .venv/bin/python benchmarks/planner_search.py [--gpus 1024] [--prompts 256] [--repeat 3]
                                                  [--whole-nodes auto|on|off]

`--design FILE --set KEY=VALUE ...` searches instead as a run's first plan does at cluster scale
(`libra sim --config FILE`, services/planner/sim/rank.first_plan): the design's cluster, step 0 of
its R2E-like trace (`--prompts` prompts, its group size), the search's shortlist of distinct splits.
`--compare` times, interleaved in this process and in CPU seconds, the search as it is and a
baseline that costs every fleet afresh in each search (the packed and the whole-node one, each
table per training TP: the search before fleets were shared), and checks that both return the same.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import yaml

from libra.services.planner import search as search_module
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


def design_search(path: str, sets: list[str], prompts: int):
    """(model, gpu, step 0's (prompt, output) pairs, the first plan's search config) of a run config."""
    from libra.config import load_run_config
    from libra.services.planner.sim import design as sim_design
    from libra.services.planner.sim.run import build_trace
    from libra.traces.spec import pairs

    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in sets)}
    design = sim_design.design_of(load_run_config(path, overrides, env={}))
    group = design.search.group_size
    trace = build_trace("r2e", 1, prompts, group, 0, 0.0, max_units=1024)
    config = design.search.model_copy(update={"distinct_splits": True, "fleets_per_split": 2,
                                              "top_k": design.replan.shortlist + 1})
    return design.model, design.gpu, pairs(trace.steps[0]), config


@contextlib.contextmanager
def fleets_afresh():
    """The baseline: every fleet costed again whenever a search asks (nothing shared)."""
    shared = search_module._FleetCosts.seconds
    search_module._FleetCosts.seconds = search_module._FleetCosts.afresh
    try:
        yield
    finally:
        search_module._FleetCosts.seconds = shared


def compare(model, gpu, trace, config, repeat: int) -> None:
    cpu = {"shared": [], "afresh": []}
    results = {}
    for _ in range(repeat):
        for name in ("afresh", "shared"):
            with fleets_afresh() if name == "afresh" else contextlib.nullcontext():
                start = time.process_time()
                results[name] = search(model, gpu, trace, config)
                cpu[name].append(time.process_time() - start)
    same = all(getattr(results["shared"], f) == getattr(results["afresh"], f)
               for f in ("best", "alternatives", "rejected", "placement"))
    print(f"planner search, {config.total_gpus} x {gpu.name}, {model.name}, {len(trace)} requests, "
          f"tp {list(config.tp_choices)}; CPU s per search, {repeat} interleaved pairs")
    for name in ("afresh", "shared"):
        print(f"  {name:7s} {' '.join(f'{t:6.2f}' for t in cpu[name])}   min {min(cpu[name]):6.2f}")
    print(f"  shared / afresh (min): {min(cpu['shared']) / min(cpu['afresh']):.2f}x; same result: {same}")
    print(f"  best: {results['shared'].best.describe()}; {results['shared'].placement[:60]}")
    if not same:
        raise SystemExit("the shared search returned a different result")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=None, help="default 256 (4,096 with --design)")
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--whole-nodes", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--design", help="a run config (configs/headline/*.yaml): its first plan's search")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="with --design")
    parser.add_argument("--compare", action="store_true", help="against fleets costed afresh (see above)")
    args = parser.parse_args()
    if args.design:
        model, gpu, trace, config = design_search(args.design, args.set, args.prompts or 4096)
    else:
        model, gpu = model_named("qwen3-14b"), gpu_named("h200-141g")
        trace = long_tailed_trace(args.prompts or 256, args.group)
        config = SearchConfig(total_gpus=args.gpus, group_size=args.group, whole_nodes=args.whole_nodes)
    if args.compare:
        compare(model, gpu, trace, config, args.repeat)
        return
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
