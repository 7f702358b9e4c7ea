"""Every process of a running `libra up`, its CPU seconds in each 0.1 s: where a run's cores go, and
when one sits idle (a start-up's serial chain, a trainer alone on a long step).

    .venv/bin/python benchmarks/cpu_timeline.py OUT.txt SECONDS &      # then start `libra up`
    .venv/bin/python benchmarks/cpu_timeline.py --show OUT.txt          # one line per sample, UTC

Samples /proc every 0.1 s for SECONDS, for the processes whose command line is a Libra service
(`serve NAME`), an hf engine worker (`hf_server`, named engine + the last digit of its port),
redis-server or `libra up` itself; writes "unix-time {name+pid: CPU-s in the interval}" lines.
"""

from __future__ import annotations

import ast
import datetime
import os
import re
import sys
import time

WANTED = re.compile(r"serve (\w+)|hf_server|redis-server|libra(\.cli)? up")


def name_of(command: str) -> str:
    service = re.search(r"serve (\w+)", command)
    if service:
        return service.group(1)
    if "hf_server" in command:
        port = re.search(r"--port (\d+)", command)
        return "engine" + (port.group(1)[-1] if port else "")
    return "redis" if "redis-server" in command else "libra-up"


def sample(out_path: str, seconds: float) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    previous: dict[str, float] = {}
    started = time.time()
    with open(out_path, "w") as out:
        while time.time() - started < seconds:
            now, row = time.time(), {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                    if not WANTED.search(command):
                        continue
                    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # gone meanwhile
                cpu = (int(fields[11]) + int(fields[12])) / tick
                if pid in previous:
                    row[f"{name_of(command)}:{pid}"] = round(cpu - previous[pid], 2)
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
              " ".join(f"{name.split(':')[0]}:{cpu}" for name, cpu in sorted(row.items()) if cpu > 0))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--show":
        show(sys.argv[2])
    elif len(sys.argv) == 3:
        sample(sys.argv[1], float(sys.argv[2]))
    else:
        sys.exit(__doc__)
