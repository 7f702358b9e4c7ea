"""A process tree's peak memory and CPU over time, sampled from /proc (quickstart_race.py and
headline_cpu.py measure their contenders with it): the sum of PSS (and of RSS) over every process
of the tree every SAMPLE_S, and each process's CPU seconds, by what the process is (`component`).
"""

from __future__ import annotations

import os
import pathlib
import threading
import time

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.2


def _parents() -> dict[int, int]:
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            found[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _memory_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in KiB (0, 0 when it is gone)."""
    try:
        text = pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("Pss:", "Rss:"):
            values[parts[0]] = int(parts[1])
    return values.get("Pss:", 0), values.get("Rss:", 0)


def component(pid: int) -> str:
    """What a process of the tree is: a service's name, an engine worker, redis, the launcher."""
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    text = " ".join(argv)
    if "serve" in argv:
        return argv[argv.index("serve") + 1]
    for marker, name in (("hf_server", "engine workers"), ("vllm", "engine workers"), ("redis-server", "redis"),
                         ("libra.cli up", "libra up"), ("bin/libra up", "libra up"), ("sync_grpo_loop", "sync loop"),
                         ("libra.zygote", "zygote")):  # (the hf engine's zygote preloads hf_server: engine workers)
        if marker in text:
            return name
    return pathlib.Path(argv[0]).name or "?"


class TreeMonitor(threading.Thread):
    """Samples a process tree every SAMPLE_S: peak summed PSS and RSS, cumulative CPU over time."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root = root
        self.stopping = threading.Event()
        self.peak_pss_kib = self.peak_rss_kib = 0
        self.cpu_by_pid: dict[int, float] = {}  # last seen CPU seconds of every process of the tree
        self.names: dict[int, str] = {}  # what each process is (component())
        self.cpu_series: list[tuple[float, float]] = []  # (wall clock, CPU seconds of the tree so far)

    def run(self) -> None:
        while not self.stopping.is_set():
            pss = rss = 0
            for pid in _tree(self.root):
                cpu = _cpu_seconds(pid)
                if cpu is not None:
                    self.cpu_by_pid[pid] = max(cpu, self.cpu_by_pid.get(pid, 0.0))
                    if self.names.get(pid, "zygote") == "zygote":  # a child just forked from a zygote
                        self.names[pid] = component(pid)              # reads as one until it renames itself
                p, r = _memory_kib(pid)
                pss, rss = pss + p, rss + r
            self.peak_pss_kib, self.peak_rss_kib = max(self.peak_pss_kib, pss), max(self.peak_rss_kib, rss)
            self.cpu_series.append((time.time(), sum(self.cpu_by_pid.values())))
            self.stopping.wait(SAMPLE_S)

    def cpu_by_component(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for pid, cpu in self.cpu_by_pid.items():
            found[self.names.get(pid, "?")] = round(found.get(self.names.get(pid, "?"), 0.0) + cpu, 1)
        return dict(sorted(found.items(), key=lambda item: -item[1]))

    def cpu_at(self, when: float) -> float:
        earlier = [cpu for t, cpu in self.cpu_series if t <= when]
        return earlier[-1] if earlier else 0.0
