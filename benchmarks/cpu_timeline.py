"""Every process of a running `libra up`, its CPU seconds in each 0.1 s: where a run's cores go, and
when one sits idle (a start-up's serial chain, a trainer alone on a long step).

    .venv/bin/python benchmarks/cpu_timeline.py OUT.txt SECONDS &      # then start `libra up`
    .venv/bin/python benchmarks/cpu_timeline.py --show OUT.txt          # one line per sample, UTC

Samples /proc every 0.1 s for SECONDS, for the processes that benchmarks/process_tree.py's
`component` names a Libra service, an engine worker, redis or `libra up` itself; writes
"unix-time {name:pid: CPU-s in the interval}" lines.
"""

from __future__ import annotations

import ast
import datetime
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from process_tree import _cpu_seconds, component  # noqa: E402  (the race's own /proc readers)

SERVICES = {"planner", "scheduler", "trainer", "rollout", "elastic"}
OTHERS = {"engine workers", "redis", "libra up"}


def sample(out_path: str, seconds: float) -> None:
    previous: dict[int, float] = {}
    names: dict[int, str | None] = {}
    started = time.time()
    with open(out_path, "w") as out:
        while time.time() - started < seconds:
            now, row = time.time(), {}
            for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
                if pid not in names:
                    name = component(pid)
                    names[pid] = name if name in SERVICES | OTHERS else None
                cpu = _cpu_seconds(pid) if names[pid] else None
                if cpu is None:
                    continue  # not one of the run's, or gone meanwhile
                if pid in previous:
                    row[f"{names[pid]}:{pid}"] = round(cpu - previous[pid], 2)
                previous[pid] = cpu
            out.write(f"{now:.2f} {row}\n")
            out.flush()
            time.sleep(0.1)


def show(path: str) -> None:
    for line in open(path):
        when, _, rest = line.partition(" ")
        row = ast.literal_eval(rest)
        stamp = datetime.datetime.fromtimestamp(float(when), datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-4]
        print(stamp, f"{sum(row.values()):.2f}",
              " ".join(f"{name}:{cpu}" for name, cpu in sorted(row.items()) if cpu > 0))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--show":
        show(sys.argv[2])
    elif len(sys.argv) == 3:
        sample(sys.argv[1], float(sys.argv[2]))
    else:
        sys.exit(__doc__)
