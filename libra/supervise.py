"""`libra up`'s supervision: a service (or the private Redis) that dies is started again, with a
growing delay, until it crashes too often; then the run stops, saying why.

```
 every tick:  a process exited ─▶ the trainer with 0? the job is done (up.py)
                   │ any other exit
                   ▼
              CrashLoop.crashed(now, ran_s) ─▶ None: a crash loop ─▶ `check` returns the reason; the run stops (exit 1)
                   │ delay: 1 s, 2 s, 4 s … 30 s (back to 1 s after 5 min of running well)
                   ▼
              its process group SIGKILLed (nothing of it survives), its port held (PortHold)
                   │ after the delay
                   ▼
              port released, the same command started again (same environment, same log file, appended)
```
A crash loop: more than RestartPolicy.max_restarts restarts of one process within window_s.

Ports: a port bound by `libra up` (not listened on) is never handed out by the kernel to an
outgoing connection, so holding a service's port while the service is down (and, at start, until
it is started) keeps the run's own connections from taking it: the quickstart's ports 50051–50055
lie inside Linux's default ephemeral range (32768–60999).

Pure bookkeeping around processes it is given; knows no service.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from libra import procs


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a process that died is started again."""

    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    factor: float = 2.0
    max_restarts: int = 5  # within window_s; one more crash stops the run
    window_s: float = 600.0
    healthy_after_s: float = 300.0  # a process that ran this long starts its backoff again from first_delay_s


class CrashLoop:
    """The restart decisions for one process (a deterministic step function of time)."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.restarts: deque[float] = deque()
        self.delay_s = policy.first_delay_s

    def crashed(self, now: float, ran_s: float) -> float | None:
        """It died at `now` after running `ran_s`: the delay before its restart, or None (give up)."""
        policy = self.policy
        if ran_s >= policy.healthy_after_s:
            self.delay_s = policy.first_delay_s
        while self.restarts and now - self.restarts[0] > policy.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= policy.max_restarts:
            return None
        self.restarts.append(now)
        delay, self.delay_s = self.delay_s, min(policy.max_delay_s, self.delay_s * policy.factor)
        return delay


class PortHold:
    """A TCP port bound by this process (not listened on), so nothing else gets it until `release`."""

    def __init__(self, host: str, port: int):
        self.port = port
        self.sock: socket.socket | None = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a dead server is no obstacle
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            self.sock = None

    @property
    def held(self) -> bool:
        return self.sock is not None

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


@dataclass
class Supervised:
    """One process `libra up` keeps running: how to start it, and its restart state."""

    name: str
    start: Callable[[], None]  # (re)starts it
    process: Callable[[], subprocess.Popen | None]  # the current process
    port: tuple[str, int] | None = None  # held while it is down
    loop: CrashLoop = field(default_factory=lambda: CrashLoop(RestartPolicy()))
    started_at: float = 0.0
    restart_at: float | None = None
    hold: PortHold | None = None
    last_code: int | None = None


class Supervisor:
    """Restarts the processes it was given when they die (module doc); `check` once per tick."""

    def __init__(self, policy: RestartPolicy, warn: Callable[[str], None], inform: Callable[[str], None],
                 log_tail: Callable[[str], str], finished: Callable[[str, int], bool] = lambda name, code: False,
                 clock: Callable[[], float] = time.monotonic):
        """`warn`: a process died (with its log's tail); `inform`: it runs again; `finished(name,
        code)`: an exit that ends the job rather than a crash (the trainer's 0)."""
        self.policy, self.warn, self.inform, self.log_tail = policy, warn, inform, log_tail
        self.finished, self.clock = finished, clock
        self.units: dict[str, Supervised] = {}
        self.restarts: dict[str, int] = {}

    def add(self, name: str, start: Callable[[], None], process: Callable[[], subprocess.Popen | None],
            port: tuple[str, int] | None = None) -> None:
        self.units[name] = Supervised(name, start, process, port, CrashLoop(self.policy), started_at=self.clock())
        self.restarts[name] = 0

    def check(self) -> str | None:
        """Note the processes that died, restart those whose delay is over; the reason to stop the
        run (a crash loop), or None."""
        now = self.clock()
        for unit in self.units.values():
            reason = self._died(unit, now) if unit.restart_at is None else self._restart_if_due(unit, now)
            if reason is not None:
                return reason
        return None

    def _died(self, unit: Supervised, now: float) -> str | None:
        process = unit.process()
        code = process.poll() if process is not None else None
        if code is None or self.finished(unit.name, code):
            return None
        procs.signal_group(process.pid, signal.SIGKILL)  # whatever it left in its group goes with it
        return self._schedule(unit, now, code, f"exited with code {code} after {now - unit.started_at:.0f}s")

    def _schedule(self, unit: Supervised, now: float, code: int | None, what: str) -> str | None:
        unit.last_code = code
        delay = unit.loop.crashed(now, now - unit.started_at)
        policy = self.policy
        if delay is None:
            return (f"{unit.name} {what}, its {policy.max_restarts + 1}th crash within {policy.window_s / 60:.0f} "
                    f"min: a crash loop, so the run stops here. Last lines of its log:\n{self.log_tail(unit.name)}")
        if unit.port is not None:
            unit.hold = PortHold(*unit.port)
        unit.restart_at = now + delay
        self.warn(f"{unit.name} {what}; starting it again in {delay:.0f}s (restart {len(unit.loop.restarts)} of at "
                 f"most {policy.max_restarts} within {policy.window_s / 60:.0f} min). Last lines of its log:\n"
                 f"{self.log_tail(unit.name)}")
        return None

    def _restart_if_due(self, unit: Supervised, now: float) -> str | None:
        if now < unit.restart_at:
            return None
        if unit.hold is not None:
            unit.hold.release()
            unit.hold = None
        unit.restart_at, unit.started_at = None, now
        try:
            unit.start()
        except Exception as error:  # noqa: BLE001 - it could not start (a port, Redis's file): a crash too
            return self._schedule(unit, now, None, f"did not start ({type(error).__name__}: {error})")
        self.restarts[unit.name] += 1
        process = unit.process()
        self.inform(f"{unit.name} started again (pid {process.pid if process is not None else '?'})")
        return None

    def release(self) -> None:
        """Let go of every held port (the run stops)."""
        for unit in self.units.values():
            if unit.hold is not None:
                unit.hold.release()
                unit.hold = None
