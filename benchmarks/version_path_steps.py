"""Step time of the quickstart before and after the short policy-version path (issue 14 item 2).

    git worktree add /tmp/before 59bd6a8          # the commit before the path was shortened
    python -m venv /tmp/before/.venv && /tmp/before/.venv/bin/pip install --no-deps -e /tmp/before
    .venv/bin/python benchmarks/version_path_steps.py --before /tmp/before [--steps 14] [--rounds 2]

Runs `libra up` on each tree's own configs/quickstart.yaml, alternating before / after in every
round (so both see the same load), both on vLLM workers (the engine the quickstart had before),
each in a fresh run directory. From each trainer.log it takes the time between consecutive
"step" events (the first `--skip` steps left out: warm-up, first compile) and the publish time the
later tree logs per step. Prints the medians side by side and after / before.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def steps_of(trainer_log: pathlib.Path) -> list[dict]:
    events = []
    for line in trainer_log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "step":
            events.append(event)
    return events


def intervals(events: list[dict], skip: int) -> list[float]:
    stamps = [datetime.datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")) for e in events]
    return [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])][skip:]


def run(tree: pathlib.Path, run_dir: pathlib.Path, steps: int) -> tuple[float, list[dict]]:
    command = [str(tree / ".venv" / "bin" / "libra"), "up", "--config", str(tree / "configs" / "quickstart.yaml"),
               "--set", f"run_dir={run_dir}", "--set", f"trainer.steps={steps}",
               "--set", "rollout.worker.engine=vllm"]
    started = time.monotonic()
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return wall, steps_of(run_dir / "logs" / "trainer.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=pathlib.Path, required=True, help="checkout of the commit before")
    parser.add_argument("--after", type=pathlib.Path, default=ROOT, help="checkout of the commit after")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=2, help="first step intervals left out")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=pathlib.Path, help="write every run's figures here")
    args = parser.parse_args()
    if args.steps <= args.skip + 2:
        parser.error("--steps must leave at least two intervals after --skip")
    figures: dict[str, list] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="version-path-") as tmp:
        for round_ in range(args.rounds):
            for name, tree in (("before", args.before), ("after", args.after)):
                wall, events = run(tree.resolve(), pathlib.Path(tmp) / f"{name}-{round_}", args.steps)
                gaps = intervals(events, args.skip)
                publish = [e["publish_s"] for e in events[args.skip:] if "publish_s" in e]
                figures[name].append({"wall_s": wall, "step_s": gaps, "publish_s": publish})
                print(f"round {round_ + 1} {name:6s}: wall {wall:6.1f}s, median step {statistics.median(gaps):.3f}s"
                      + (f", median publish {statistics.median(publish):.3f}s" if publish else ""), flush=True)
    medians = {name: statistics.median([g for run_ in runs for g in run_["step_s"]]) for name, runs in figures.items()}
    print(f"\nmedian step over {args.rounds} round(s), steps {args.skip + 2}..{args.steps}: "
          f"before {medians['before']:.3f}s, after {medians['after']:.3f}s, after/before {medians['after'] / medians['before']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": figures,
                                         "median_step_s": medians}, indent=1))


if __name__ == "__main__":
    main()
