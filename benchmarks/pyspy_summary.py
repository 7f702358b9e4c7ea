"""Top frames of py-spy's raw output (`py-spy record -f raw`), one file per process: the share of
the samples each frame is the leaf of (self) and is on the stack of (inclusive).

    .venv/bin/python benchmarks/pyspy_summary.py PROFILE.txt [...]     (benchmarks/profile_quickstart.sh)
"""

from __future__ import annotations

import collections
import sys


def summary(path: str, top: int = 12, floor: float = 0.03) -> str:
    leaf, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        frames, n = stack.split(";"), int(count)
        total += n
        leaf[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"== {path}: {total} samples", " self:"]
    lines += [f"  {n / total:6.1%} {frame[:140]}" for frame, n in leaf.most_common(top)]
    lines.append(" inclusive:")
    lines += [f"  {n / total:6.1%} {frame[:140]}" for frame, n in inclusive.most_common(60) if n / total >= floor]
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(summary(name))
