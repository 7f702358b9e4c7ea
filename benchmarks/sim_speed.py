"""Simulation speed at 4,096 GPUs (issue 16 item 5), this tree against a baseline tree, paired.

Runs the headline designs' `libra sim` commands at 4,096 GPUs × 100 steps from two source trees —
this checkout and a baseline (a directory, or a git revision this script extracts with `git
archive`) — as pairs that run at the same time, every run its own process, all at once (`--jobs`
bounds how many). Each run's CPU seconds are the simulator's own figure (its "CPU …s" line: the
search plus the simulation, the trace's generation excluded) and the whole process's (wait4). The
two trees' outputs must agree line for line apart from timings; the script says where they do not.
`--search-only` times the first plan's search alone instead (benchmarks/planner_search.py --design,
its own seconds: wall, which is its CPU when the run has a core to itself).

    .venv/bin/python benchmarks/sim_speed.py --baseline dfa247d [--pairs b=3 c=2] [--steps 100] [--search-only]

On a shared 2-core machine whole runs drift ±15% between rounds; run it where cores are idle
(the GPU machine's 16 CPU cores, `--jobs 2`: a pair at a time; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGNS = {
    "a": ["--config", "configs/headline/a-sync-colocated.yaml", "--set", "planner.cluster.tp_choices=[8]"],
    "b": ["--config", "configs/headline/b-async-even.yaml", "--set", "planner.cluster.min_train_gpus=2048",
          "--set", "planner.cluster.min_rollout_gpus=2048", "--set", "planner.cluster.tp_choices=[8]"],
    "c": ["--config", "configs/headline/c-libra-static.yaml"],
}
# A tree's `libra` and its services (installed as libra.services), both from the tree itself: sys.path
# first finds its libra/; libra.services is loaded from its services/ explicitly (an editable install
# would otherwise map it to the checkout's), and every submodule is then found under that.
DRIVER = """
import importlib.util, os, sys
tree = sys.argv[1]; os.chdir(tree); sys.path.insert(0, tree)
import libra
services = os.path.join(tree, "services")
spec = importlib.util.spec_from_file_location("libra.services", os.path.join(services, "__init__.py"),
                                              submodule_search_locations=[services])
module = importlib.util.module_from_spec(spec); sys.modules["libra.services"] = module; spec.loader.exec_module(module)
libra.services = module
import libra.services.planner.sim.cluster as probe
assert libra.__file__.startswith(tree) and probe.__file__.startswith(tree), (libra.__file__, probe.__file__)
if sys.argv[2] == "--script":  # a benchmark script of this checkout, on the tree's code
    import runpy
    sys.argv = sys.argv[3:]
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    from libra.cli import main
    try:
        main(sys.argv[2:])
    except SystemExit:
        pass
"""


def command(design: str, steps: int, search_only: bool) -> list[str]:
    if search_only:  # the first plan's search alone, as benchmarks/planner_search.py times it
        return ["--script", str(ROOT / "benchmarks" / "planner_search.py"), "--design", *DESIGNS[design][1:],
                "--set", "planner.cluster.gpus=4096", "--repeat", "1"]
    return ["sim", *DESIGNS[design], "--set", "planner.cluster.gpus=4096", "--trace", "r2e", "--steps", str(steps),
            "--prompts", "4096", "--seed", "0", "--drift", "1.0"]


def run(tree: Path, args: list[str], out: Path) -> tuple[float, float | None, str]:
    """(whole-process CPU s, the simulator's CPU s, its output) of one run."""
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tree), *args], stdout=sink, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    text = out.read_text()
    if proc.returncode:
        raise SystemExit(f"{out}: exit {proc.returncode}\n{text[-2000:]}")
    found = re.search(r"CPU ([0-9.]+)s", text) or re.search(r"seconds \(best of 1\): ([0-9.]+)", text)
    return usage.ru_utime + usage.ru_stime, float(found.group(1)) if found else None, text


def baseline_tree(spec: str, scratch: Path) -> Path:
    if Path(spec).is_dir():
        return Path(spec).resolve()
    tree = scratch / f"baseline-{spec}"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", spec, "libra", "services", "configs"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision or a source tree (holding libra/, services/)")
    parser.add_argument("--pairs", nargs="+", default=["b=3", "c=2"], help="DESIGN=PAIRS, designs a, b, c")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--search-only", action="store_true",
                        help="time the first plan's search alone (benchmarks/planner_search.py --design)")
    parser.add_argument("--jobs", type=int, default=0, help="runs at once (0: every run at once)")
    parser.add_argument("--out", default="", help="a folder for every run's output (default: a temporary one)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="libra-sim-speed-"))
    outs = Path(args.out) if args.out else scratch
    outs.mkdir(parents=True, exist_ok=True)
    trees = {"baseline": baseline_tree(args.baseline, scratch), "this": ROOT}
    jobs = []
    for item in args.pairs:
        design, _, count = item.partition("=")
        if design not in DESIGNS or not count.isdigit():
            raise SystemExit(f"--pairs {item!r}: give DESIGN=PAIRS with DESIGN one of {sorted(DESIGNS)}")
        for pair in range(int(count)):
            for name, tree in trees.items():
                jobs.append((design, pair, name, tree))
    print(f"{len(jobs)} runs, {args.jobs or len(jobs)} at once; {os.cpu_count()} CPUs; baseline {args.baseline}", flush=True)
    with ThreadPoolExecutor(args.jobs or len(jobs)) as pool:
        results = list(pool.map(lambda j: run(j[3], command(j[0], args.steps, args.search_only), outs / f"{j[0]}{j[1]}-{j[2]}.txt"), jobs))
    by = {(d, p, n): r for (d, p, n, _), r in zip(jobs, results)}
    timing = re.compile(r"wall [0-9.]+s, CPU [0-9.]+s|[0-9.]+ CPU-s|best of 1\): [0-9.]+ .*")
    print(f"{'design':8} {'pair':>4} {'own s baseline':>19} {'this':>7} {'ratio':>6}   "
          f"{'process CPU s baseline':>22} {'this':>7} {'ratio':>6}  output")
    for design, pair, name, _ in jobs:
        if name != "this":
            continue
        (pb, sb, tb), (pt, st, tt) = by[(design, pair, "baseline")], by[(design, pair, "this")]
        same = timing.sub("", tb) == timing.sub("", tt)
        sim = f"{sb:19.1f} {st:7.1f} {st / sb:6.3f}" if sb and st else f"{'?':>19} {'?':>7} {'?':>6}"
        print(f"{design:8} {pair:4d} {sim}   {pb:22.1f} {pt:7.1f} {pt / pb:6.3f}  "
              f"{'the same' if same else 'DIFFERENT'}")
    print(f"outputs: {outs}")


if __name__ == "__main__":
    main()
