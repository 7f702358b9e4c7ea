"""Replays of one window under several plans, in this process or in worker processes.

A replanner's decision plays the recent window once per candidate (`rank.SimRanker`), and the
replays are independent: each starts from an empty pipeline and reads nothing but its inputs. With
`planner.replan.sim_workers` above 1 they run in a pool of worker processes, so a round of
replays takes about as long as its slowest instead of their sum (the CPU spent about the same:
each worker unpickles the window once per decision, and the online judge plays a few replays
ahead that a recalibration may make it play again, evaluate.by_simulation). The results are the
same as one after the other: `play_one` is the only code that plays, in either place
(tests/unit/test_replays_parallel.py). Each worker keeps the last window it read until the next
decision brings another: memory of one window per worker.

    ReplayPool(workers).map(context, window, replays) ─▶ [Played], in the order of `replays`

The window travels pickled once per `map` call and each worker keeps the last one it unpickled,
so a worker that plays several candidates of one decision reads it once. Workers come from a
forkserver (a spawn on platforms without one): safe beside gRPC's threads in the planner service,
and they load the simulator once, when the pool starts.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from libra.errors import InvalidArgument
from libra.services.planner.evaluate import Played, Replay
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.search import SearchConfig
from libra.traces.spec import Trace

MAX_AUTO_WORKERS = 16
OWNER_POLL_S = 1.0  # how often a worker checks that the pool's owner is alive


@dataclass(frozen=True)
class Context:
    """What every replay of a ranker shares besides the window."""

    model: ModelSpec
    gpu: GpuSpec
    search: SearchConfig
    sim: object  # cluster.SimConfig (not imported here: the simulator imports the planner's modules)
    warm: int


def play_one(context: Context, window: Trace, replay: Replay) -> Played:
    """The window from an empty pipeline (`run.run_plan`); a plan that cannot run it plays as steps
    that never end (never chosen; a plan in force that cannot is moved off)."""
    from libra.services.planner.sim.run import run_plan

    search = context.search.model_copy(update={"rollout": replay.rollout, "train": replay.train})
    try:
        result = run_plan(context.model, context.gpu, window, replay.plan, search, context.sim,
                          move_to=replay.move_to, transition_s=replay.transition_s, move_after=context.warm)
    except InvalidArgument:
        steps, warm = len(window.steps), context.warm
        return Played((0.0,) * (warm + 1) + (math.inf,) * (steps - 1 - warm), (math.inf,) * steps, warm)
    return Played(tuple(s.time_s for s in result.steps), tuple(s.rollout_s for s in result.steps), context.warm)


def resolve_workers(workers: int, cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """0: one per core this process may run on (its CPU affinity, and a container's CPU quota),
    at most `MAX_AUTO_WORKERS`; else as given."""
    if workers > 0:
        return workers
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:  # cgroup v2: "max 100000" (no quota) or "200000 100000" (2 CPUs)
        with open(cpu_max) as limits:
            quota, period = limits.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, min(cores, MAX_AUTO_WORKERS))


class ReplayPool:
    """`workers` processes, started at the first `map` with more than one replay; `close()` stops
    them (also at interpreter exit)."""

    _keys = itertools.count()

    def __init__(self, workers: int):
        self.workers = resolve_workers(workers)
        self.worker_cpu_s = 0.0  # CPU seconds the workers spent on replays (this process's own not counted)
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    def map(self, context: Context, window: Trace, replays: Sequence[Replay]) -> list[Played]:
        if self.workers <= 1 or len(replays) <= 1:
            return [play_one(context, window, replay) for replay in replays]
        executor = self._start()
        key = f"{os.getpid()}-{next(self._keys)}"
        blob = pickle.dumps((context, window), protocol=pickle.HIGHEST_PROTOCOL)
        futures = [executor.submit(_play_in_worker, key, blob, replay) for replay in replays]
        try:
            done = [future.result() for future in futures]
        except concurrent.futures.process.BrokenProcessPool as error:  # a worker killed (out of memory?)
            self.close()
            raise RuntimeError(f"a replay worker process died ({error}); the decision was not made. Out of "
                               f"memory? lower planner.replan.sim_workers (now {self.workers}). From a script of "
                               f"your own? start it under `if __name__ == '__main__':` (each worker imports the "
                               f"main module)") from None
        self.worker_cpu_s += sum(cpu_s for _, cpu_s in done)
        return [played for played, _ in done]

    def __getstate__(self) -> dict:  # a checkpointed run's pool: its settings, not its processes (restarted
        return {**self.__dict__, "_executor": None}  # at the next map)

    def _start(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._executor is None:
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            if "forkserver" in methods:
                context.set_forkserver_preload(["libra.services.planner.sim.run"])
                _start_forkserver_deaf()
            self._executor = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=context,
                                                                    initializer=_watch_owner,
                                                                    initargs=(os.getpid(), OWNER_POLL_S))
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def _start_forkserver_deaf() -> None:
    """Start the forkserver with SIGINT and SIGTERM blocked, which it and every worker it forks keep.
    A Ctrl-C or a `timeout` reaches the whole process group, the forkserver too; had it died, every
    worker's sentinel (a pipe from the forkserver) would close and the pool would count its workers
    dead mid-decision, though they live ("a replay worker process died" at the moment a run was
    asked to save and stop). Blocked in this thread only for the start, so a signal meant for the
    owner arrives here once it is done. A forkserver already running is left as it is. (The resource
    tracker first: its own start unblocks both signals when it is done, which inside the block would
    start the forkserver with them unblocked.)"""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_last: tuple[str, Context, Trace] | None = None  # in a worker: the window it last unpickled


def _watch_owner(owner: int, every_s: float) -> None:
    """In a worker: end this process once the pool's owner is gone. A planner killed outright
    (SIGKILL, the OOM killer) cannot stop its pool, and its idle workers would wait for work forever
    (their parent is the forkserver, which stays while they do). SIGINT and SIGTERM are left to the
    owner: a Ctrl-C or a batch system's notice reaches the whole process group, and the owner may
    finish its step and save (sim/checkpoint.py) with the workers it has, then stop them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    born = _started(owner)

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if not _alive(owner, born):
                os._exit(0)

    threading.Thread(target=watch, name="replay-owner-watch", daemon=True).start()


def _started(pid: int) -> str | None:
    """The process's start time (Linux /proc), to tell it from a later process given its pid."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, born: str | None) -> bool:
    """A zombie (killed, not yet reaped by its parent) or a new process with its pid is not alive."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return fields[0] not in ("Z", "X") and (born is None or fields[19] == born)
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _play_in_worker(key: str, blob: bytes, replay: Replay) -> tuple[Played, float]:
    """The replay, and the CPU seconds this worker spent on it (unpickling included)."""
    global _last
    cpu = time.process_time()
    if _last is None or _last[0] != key:
        context, window = pickle.loads(blob)
        _last = (key, context, window)
    return play_one(_last[1], _last[2], replay), time.process_time() - cpu
