"""libra/procs.py with real processes: a child dies with its parent even when the parent is
SIGKILLed, a group stop takes what the leader left behind, and a sweep finds a job's processes
by their environment marker wherever they were re-parented."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from libra import procs

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _gone(pid: int, within_s: float) -> bool:
    """True once `pid` no longer runs (zombies count as gone), polling up to `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


@pytest.mark.parametrize("death_signal", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_dies_when_its_parent_is_sigkilled(tmp_path, death_signal):
    pid_file = tmp_path / "child.pid"
    parent_code = textwrap.dedent(f"""
        import sys, time
        from libra import procs
        child = procs.start_group({SLEEPER!r}, {int(death_signal)})
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    child = 0
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, "the parent never started its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert os.getpgid(child) == child  # its own process group (start_new_session)
        assert not _gone(child, 0.3)
        parent.kill()  # SIGKILL: the parent has no chance to stop anything itself
        parent.wait()
        assert _gone(child, 10), f"child {child} outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.wait()
        if child and not _gone(child, 0):
            os.kill(child, signal.SIGKILL)


def test_stop_group_kills_what_the_leader_leaves_behind():
    # The leader starts a grandchild in its group that ignores SIGTERM, then exits on SIGTERM itself.
    code = textwrap.dedent("""
        import signal, subprocess, sys, time
        grandchild = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)"],
            stdout=subprocess.PIPE)
        grandchild.stdout.readline()  # its SIGTERM handler is in place
        print(grandchild.pid, flush=True)
        time.sleep(120)
    """)
    leader = procs.start_group([sys.executable, "-c", code], signal.SIGKILL, stdout=subprocess.PIPE, text=True)
    grandchild = int(leader.stdout.readline())
    assert procs.stop_group(leader, timeout_s=10) == -signal.SIGTERM
    assert _gone(grandchild, 5), "the group stop left the SIGTERM-ignoring grandchild running"


def test_sweep_kills_marked_processes_wherever_they_went(tmp_path):
    token = uuid.uuid4().hex
    pid_file = tmp_path / "orphan.pid"
    # A double fork: the marked process is re-parented to init, no longer anyone's child here.
    code = textwrap.dedent(f"""
        import os, subprocess, sys
        orphan = subprocess.Popen({SLEEPER!r}, start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(orphan.pid))
    """)
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "LIBRA_TEST_MARK": token}, check=True)
    orphan = int(pid_file.read_text())
    unmarked = subprocess.Popen(SLEEPER)
    try:
        assert procs.marked("LIBRA_TEST_MARK", token) == [orphan]
        assert procs.sweep("LIBRA_TEST_MARK", token, grace_s=0.2) == [orphan]
        assert _gone(orphan, 5) and procs.marked("LIBRA_TEST_MARK", token) == []
        assert unmarked.poll() is None  # only the marked one
    finally:
        unmarked.kill()
        unmarked.wait()


def test_a_child_whose_parent_died_before_the_signal_was_armed_does_not_run_on():
    # The parent exits the moment the child is forked, before setpriv can arm the parent-death
    # signal: the child must notice (its parent is no longer its launcher) and not run its command.
    code = textwrap.dedent("""
        import os, subprocess, sys
        from libra import procs
        child = subprocess.Popen(procs.with_parent_death_signal(
            [sys.executable, "-c", "import time; time.sleep(120)"], 15), start_new_session=True)
        print(child.pid, flush=True)
        os._exit(0)
    """)
    for _ in range(5):
        parent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        child = int(parent.stdout)
        assert _gone(child, 10), "the child outlived the parent that died while it started"
