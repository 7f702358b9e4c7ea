"""How many GRPO groups of kept runs had all their rewards equal (advantage 0 on every sequence):
the share of a batch the trainer leaves out of its passes (`trainer.skip_zero_advantage`).

    .venv/bin/python benchmarks/equal_reward_groups.py DIR [--window 10]

DIR is what `benchmarks/headline_cpu.py --keep-runs DIR` (or quickstart_race.py --keep) left: per
run a directory holding run/trace.jsonl (every finished trajectory with its reward, `gN-sM` ids)
and run/config.yaml (trainer.groups_per_step). Groups count in the order of their ids, which is
the order they were released in, `groups_per_step` to a step. Prints per run the share of groups
whose rewards were all equal over the whole run, its first `--window` steps and its last.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections import defaultdict

import yaml


def shares(run: pathlib.Path, window: int) -> tuple[float, float, float, int]:
    rewards: dict[int, list[float]] = defaultdict(list)
    for line in (run / "trace.jsonl").read_text().splitlines():
        record = json.loads(line)
        rewards[int(record["trajectory_id"].split("-")[0][1:])].append(record["reward"])
    equal = [len(set(rewards[g])) == 1 for g in sorted(rewards)]
    per_step = yaml.safe_load((run / "config.yaml").read_text())["trainer"]["groups_per_step"]
    cut = window * per_step
    share = lambda flags: sum(flags) / len(flags)  # noqa: E731
    return share(equal), share(equal[:cut]), share(equal[-cut:]), len(equal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=pathlib.Path)
    parser.add_argument("--window", type=int, default=10, help="steps at each end of a run")
    args = parser.parse_args()
    for trace in sorted(args.dir.glob("*/run/trace.jsonl")):
        whole, first, last, groups = shares(trace.parent, args.window)
        print(f"{trace.parent.parent.name:8} {groups:4d} groups: all rewards equal in {whole:.0%}; "
              f"first {args.window} steps {first:.0%}, last {args.window} steps {last:.0%}")


if __name__ == "__main__":
    main()
