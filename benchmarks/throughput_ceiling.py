"""The most trajectories per second any design could reach on a headline trace, under the simulator's
own cost model (services/planner/sim/ceiling.py): how far each simulated design could still move
(issue 16 item 3).

Training a trace's batches costs at least their decode (each token reads its KV cache once and a
share of the weights at the largest batch), their prefill (each prompt and tool payload once) and
their training compute, in GPU-seconds, whatever the design; over the GPUs that is a floor on the
makespan and a ceiling on the throughput. A design at fraction f of the ceiling can be beaten by
at most 1 / f (strictly for designs that reject no stale groups; ceiling.py says why).

    .venv/bin/python benchmarks/throughput_ceiling.py [--gpus 48] [--steps 100] [--seed 0] [--drift 1.0]
        [--rows benchmarks/results/headline_sim_48.json ...]

The trace and the efficiencies are those `libra sim --config configs/headline/*.yaml --trace r2e`
plays (design_trace, the configs' planner.cluster); --rows reads the simulated designs'
trajectories/s from headline_sim.py's outputs and prints each one's fraction of the ceiling.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from libra.config import load_run_config
from libra.services.planner.sim import design as sim_design
from libra.services.planner.sim.ceiling import ceiling

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/headline/d-libra-full.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=48)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=0, help="prompts per step (0: one per GPU, as headline_sim.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drift", type=float, default=1.0)
    parser.add_argument("--rows", nargs="*", default=[],
                        help="headline_sim.py's outputs: each design's fraction of the ceiling (later files' rows "
                             "replace earlier ones')")
    args = parser.parse_args()
    started = time.process_time()
    config = load_run_config(CONFIG, {"planner.cluster.gpus": args.gpus})
    design = sim_design.design_of(config)
    trace = sim_design.design_trace("r2e", args.steps, args.prompts or args.gpus, design.search.group_size,
                                    args.seed, args.drift)
    batches = trace.steps[:args.steps]
    found = ceiling(design.model, design.gpu, design.search, batches)
    print(f"{args.gpus} x {design.gpu.name}, {design.model.name}, r2e seed {args.seed} drift {args.drift}, "
          f"{len(batches)} steps x {trace.batch} trajectories")
    print(f"GPU-seconds at least: decode {found.decode_gpu_s:,.0f}, prefill {found.prefill_gpu_s:,.0f}, "
          f"training {found.train_gpu_s:,.0f}; makespan >= {found.makespan_floor_s:,.0f} s")
    print(f"ceiling: {found.trajectories_per_s:.3f} trajectories/s")
    rows: dict = {}
    for path in args.rows:
        try:
            scales = json.loads(pathlib.Path(path).read_text())["scales"]
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"--rows {path}: not headline_sim.py's output ({error})") from None
        rows.update(next((s["best"] for s in scales if s["gpus"] == args.gpus), {}))
    if args.rows and not rows:
        raise SystemExit(f"--rows: no design row at {args.gpus} GPUs in {', '.join(args.rows)}")
    same = [f"--steps {args.steps} ", f"--prompts {args.prompts or args.gpus} ", f"--seed {args.seed} ",
            f"--drift {args.drift}"]
    for key, row in sorted(rows.items()):
        if not all(flag in row.get("command", "") + " " for flag in same):
            print(f"  ({key}) skipped: its run was on another trace ({row.get('command', '?')})")
            continue
        share = row["trajectories_per_s"] / found.trajectories_per_s
        print(f"  ({key}) {row['label']:<28} {row['trajectories_per_s']:.3f} trajectories/s = {share:.1%} of the "
              f"ceiling: at most {1 / share:.2f}x by any design; rejected as stale {row.get('rejected', 0):,}")
    print(f"CPU {time.process_time() - started:.1f}s")


if __name__ == "__main__":
    main()
