"""A restarted service stops what its dead predecessor left running (libra/procs.py `adopt`), and
never touches the children of a live one; a hybrid process dies with its coordinator. Real
processes: an "owner" that adopts a key and starts a child (a plain sleep, without a parent-death
signal), then is killed; a coordinator that launches a hybrid as the elastic service does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

from libra import procs

OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from libra import procs
    procs.adopt(sys.argv[1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(120)
""")


def _owner(key: str) -> tuple[subprocess.Popen, int]:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, key], stdout=subprocess.PIPE, text=True)
    return owner, int(owner.stdout.readline())


def _alive(pid: int) -> bool:
    return procs.alive(pid)


def test_adopt_stops_a_dead_owners_children_and_leaves_a_live_ones():
    key = f"test:{uuid.uuid4().hex[:8]}:x"
    dead, orphan = _owner(key)
    live, kept = _owner(key)
    try:
        assert procs.orphans(key) == []  # both owners live: nothing is anyone's to reclaim
        dead.kill()
        dead.wait()
        assert procs.orphans(key) == [orphan]
        started = time.monotonic()
        assert procs.reclaim(key, grace_s=5.0) == [orphan]
        assert time.monotonic() - started < 5.0  # a plain sleep dies on SIGTERM: no wait for the grace
        deadline = time.monotonic() + 5
        while _alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(orphan) and _alive(kept)
        assert os.environ.get(procs.OWNER_ENV) is None  # reclaim alone does not mark this process
    finally:
        for process in (dead, live):
            process.kill()
            process.wait()
        for pid in (orphan, kept):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_owner_key_may_not_hide_the_owner_pid():
    try:
        procs.adopt("bad@key")
        raise AssertionError("adopt accepted '@' in a key")
    except ValueError as error:
        assert "'@'" in str(error)


COORDINATOR = textwrap.dedent("""
    import pathlib, sys, time
    from libra.services.elastic.driver import HybridProcesses
    processes = HybridProcesses(("{python}", "-c", "import time; time.sleep(120)"), {}, pathlib.Path(sys.argv[1]))
    pid = processes.launch("hybrid-0", 1)
    print(f"PID {pid}", flush=True)
    time.sleep(120)
""")


def test_a_hybrid_process_dies_with_its_coordinator(tmp_path):
    coordinator = subprocess.Popen([sys.executable, "-c", COORDINATOR, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    hybrid = int(next(line for line in coordinator.stdout if line.startswith("PID ")).split()[1])
    try:
        assert _alive(hybrid)
        coordinator.kill()  # SIGKILL: nothing of the coordinator's code runs
        coordinator.wait()
        deadline = time.monotonic() + 10
        while _alive(hybrid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(hybrid), "the hybrid process outlived its coordinator"
    finally:
        coordinator.kill()
        coordinator.wait()
        try:
            os.kill(hybrid, signal.SIGKILL)
        except ProcessLookupError:
            pass
