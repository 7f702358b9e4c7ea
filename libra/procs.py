"""Child processes that die with their parent, and stopping everything a job started.

`libra up` starts Redis and the five services with `start_group`; the rollout service starts its
engine workers (vLLM, hf) the same way. Each child is the leader of its own session, so one
`signal_group` reaches whatever it forked in turn, and the kernel sends it a signal when its
parent dies, even by SIGKILL (Linux PR_SET_PDEATHSIG, armed by util-linux's `setpriv --pdeathsig`,
which then execs the command: no Python code runs between fork and exec, which is what keeps this
safe in processes with threads — gRPC's among them; a `preexec_fn` there crashed engine starts):

```
 libra up ──┬─ redis-server        ─┐ own session each; SIGKILL when libra up dies
            ├─ libra serve trainer  │
            └─ libra serve rollout ─┘
                 └─ vLLM api_server    own session; SIGTERM when rollout dies, so vLLM stops
                      └─ EngineCore, Worker   its EngineCore and workers itself (a SIGKILLed
                                              api_server leaves them running: measured)
```

The kernel signals a child when the *thread* that started it ends, not the process: start
children from a thread that lives as long as they should (the main thread, an event loop's).
(`libra up`'s services and CPU hf workers are forked by a zygote started this way, which arms the
same signal in each child: libra/zygote.py.)

`sweep` is the last resort of a stop: every process whose environment holds a marker that the
job gave its children (children inherit their parent's environment, vLLM's included).

`adopt` is what a restarted service does first: its predecessor's children (engine workers,
hybrids, trainer ranks) carry `LIBRA_OWNER=KEY@PID` with the dead predecessor's pid; they got their
parent-death signal but may still be shutting down, holding ports. `adopt` stops them (SIGTERM,
then SIGKILL after a grace) and marks this process as the owner of whatever it starts next. A
live owner's children are never touched (a second copy of a running service leaves them alone):

```
 libra serve rollout (pid 41, killed) ─▶ vLLM api_server  LIBRA_OWNER=rollout:run@41  (still exiting)
 libra serve rollout (pid 77, restart) ─ adopt("rollout:run") ─▶ 41 is gone: stop it ─▶ ports free
                                                                  LIBRA_OWNER=rollout:run@77 from now on
```

Must not know: which services or engines exist.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable

OWNER_ENV = "LIBRA_OWNER"
"""Environment variable naming the service process that owns a child: `KEY@PID` (`adopt`)."""
ADOPT_GRACE_S = 15.0
"""Seconds a predecessor's children get to exit on SIGTERM before `adopt` SIGKILLs them."""
SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


def with_parent_death_signal(argv: list[str], sig: int) -> list[str]:
    """`argv` wrapped so that the process it becomes receives `sig` when its parent (the thread that
    started it) dies; unchanged where `setpriv` is missing (not Linux): then only the stop and the
    `sweep` reclaim children, and `libra up` says so at start (`PARENT_DEATH`)."""
    if SETPRIV is None:
        return list(argv)
    # The signal is armed only once setpriv runs; a parent that died before that (a SIGKILL right
    # after the start, on a loaded machine) would leave the child running for good. So the shell
    # that setpriv starts checks, after arming, that its parent is still the process starting it.
    check = f'[ "$PPID" = {os.getpid()} ] || exit 143; exec "$@"'
    return [SETPRIV, "--pdeathsig", signal.Signals(sig).name.removeprefix("SIG"), "--", "/bin/sh", "-c", check,
            "sh", *argv]


PARENT_DEATH = SETPRIV is not None
"""Whether children die with their parent here (util-linux `setpriv` found)."""


def start_group(argv: list[str], death_signal: int, **popen: object) -> subprocess.Popen:
    """Start `argv` as the leader of a new session (its own process group; the group id is its
    pid) that receives `death_signal` when this process, or the thread calling, dies."""
    return subprocess.Popen(with_parent_death_signal(argv, death_signal), start_new_session=True,
                            **popen)  # type: ignore[arg-type]


def signal_group(group: int, sig: int) -> None:
    """Send `sig` to every process of process group `group`; nothing if the group is gone."""
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(process: subprocess.Popen, timeout_s: float, hurry: Callable[[], bool] = lambda: False) -> int:
    """SIGTERM the group `process` leads, wait up to `timeout_s` (less once `hurry()` is true)
    for the leader, then SIGKILL the group, so nothing it left behind survives; its exit code."""
    if process.poll() is None:
        signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
    signal_group(process.pid, signal.SIGKILL)
    return process.wait()


def marked(name: str, value: str) -> list[int]:
    """Pids of the processes (other than this one) whose environment has `name=value`."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def sweep(name: str, value: str, grace_s: float = 3.0) -> list[int]:
    """Wait up to `grace_s` for the processes marked `name=value` to exit, then SIGKILL the rest
    until none is left (bounded); the pids that had to be killed."""
    deadline = time.monotonic() + grace_s
    while marked(name, value) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed: list[int] = []
    for _ in range(20):  # a killed parent's children may still be starting; a few rounds catch them
        left = marked(name, value)  # a zombie's environment reads empty: only the living match
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return sorted(set(killed))



def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def orphans(key: str) -> list[int]:
    """Pids of the processes owned (`OWNER_ENV`) under `key` by an owner that is no longer alive."""
    prefix = f"{OWNER_ENV}={key}@".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                owner = next((item[len(prefix):] for item in handle.read().split(b"\0") if item.startswith(prefix)),
                             None)
        except OSError:
            continue
        if owner is not None and owner.isdigit() and int(owner) != os.getpid() and not alive(int(owner)):
            found.append(int(entry))
    return found


def reclaim(key: str, grace_s: float = ADOPT_GRACE_S) -> list[int]:
    """Stop what a dead owner under `key` left running: SIGTERM, wait up to `grace_s` (vLLM stops its
    engine processes itself on SIGTERM), then SIGKILL the rest; the pids that were found."""
    found = orphans(key)
    for pid in found:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while any(alive(pid) for pid in found) and time.monotonic() < deadline:
        time.sleep(0.1)
    for _ in range(20):  # an orphan's own children may still be starting: a few rounds catch them
        left = orphans(key)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        found = sorted(set(found) | set(left))
        time.sleep(0.1)
    return found


def adopt(key: str, grace_s: float = ADOPT_GRACE_S) -> list[int]:
    """Stop the children a dead predecessor under `key` left behind (`reclaim`), then mark every
    process this one starts from now on as owned by it; the pids that were stopped."""
    if "@" in key or "\0" in key:
        raise ValueError(f"an owner key must not contain '@' or NUL: {key!r}")
    stopped = reclaim(key, grace_s)
    os.environ[OWNER_ENV] = f"{key}@{os.getpid()}"
    return stopped
