"""libra/zygote.py: children forked from a zygote behave as the `python -m MODULE` that
`procs.start_group` would have started (argv, environment, directory, log, own session, exit code,
command line, death with the zygote), and a zygote that cannot fork says so instead of forking."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from libra import procs
from libra.zygote import Zygote, ZygoteError

pytestmark = pytest.mark.skipif(not procs.PARENT_DEATH, reason="Linux with util-linux setpriv")

PROBE = textwrap.dedent("""
    import json, os, sys, threading, time
    record = {"argv": sys.argv, "probe": os.environ.get("PROBE"), "cwd": os.getcwd(),
              "session_leader": os.getsid(0) == os.getpid(), "grpc_preloaded": "grpc" in sys.modules,
              "name": __name__}
    print(json.dumps(record), flush=True)
    if "--sleep" in sys.argv:
        time.sleep(120)
    if "--thread" in sys.argv:  # a non-daemon thread: the interpreter's shutdown waits for it
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    import atexit
    atexit.register(lambda: print("exit handler ran", flush=True))
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
""")
THREADED = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"


@pytest.fixture
def zygote_env(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "threaded.py").write_text(THREADED)
    return {**os.environ, "PYTHONPATH": str(tmp_path), "LIBRA_TEST_MARK": tmp_path.name}


def _zygote(tmp_path, env, preload=("grpc",), death_signal=signal.SIGKILL) -> Zygote:
    return Zygote(list(preload), env, death_signal, tmp_path / "zygote.log")


def _spawn(zygote, tmp_path, args, env, death_signal=signal.SIGKILL, cwd=None, name="child"):
    with open(tmp_path / f"{name}.log", "ab") as log:
        return zygote.spawn([sys.executable, "-m", "probe", *args], env, log, death_signal, cwd=cwd)


def _records(tmp_path, name="child") -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"{name}.log").read_text().splitlines() if line.startswith("{")]


def test_a_child_runs_its_module_as_main_with_its_argv_environment_directory_and_code(tmp_path, zygote_env):
    zygote = _zygote(tmp_path, zygote_env)
    try:
        child = _spawn(zygote, tmp_path, ["7", "--thread"], {**zygote_env, "PROBE": "yes"}, cwd=str(tmp_path))
        assert child.wait(30) == 7 and child.poll() == 7
        record = _records(tmp_path)[0]
        assert record["argv"][1:] == ["7", "--thread"] and record["argv"][0].endswith("probe.py")
        assert record["probe"] == "yes" and record["cwd"] == str(tmp_path) and record["name"] == "__main__"
        assert record["session_leader"] and record["grpc_preloaded"]
        log = (tmp_path / "child.log").read_text()
        assert "thread done" in log and "exit handler ran" in log  # the interpreter's own shutdown
        other = _spawn(zygote, tmp_path, [], zygote_env, name="other")  # the zygote forks again
        assert other.wait(30) == 0 and _records(tmp_path, "other")[0]["probe"] is None
    finally:
        zygote.close()
        zygote.process.wait(10)  # it leaves once its owner hangs up


def test_a_child_shows_its_own_command_line_and_carries_the_zygotes_environment_marker(tmp_path, zygote_env):
    zygote = _zygote(tmp_path, zygote_env)
    child = _spawn(zygote, tmp_path, ["--sleep", "--port", "1234"], zygote_env)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "child.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        argv = [part for part in open(f"/proc/{child.pid}/cmdline", "rb").read().split(b"\0") if part]
        assert argv == [sys.executable.encode(), b"-m", b"probe", b"--sleep", b"--port", b"1234"]
        shown = subprocess.run(["ps", "-o", "args=", "-p", str(zygote.process.pid)], capture_output=True, text=True)
        assert shown.stdout.split() == [sys.executable, "-m", "libra.zygote", "grpc"]
        assert child.pid in procs.marked("LIBRA_TEST_MARK", tmp_path.name)  # what sweep and adopt look for
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.1)
        procs.signal_group(child.pid, signal.SIGTERM)  # its own group: libra up's stop reaches it
        assert child.wait(30) == -signal.SIGTERM
    finally:
        procs.signal_group(child.pid, signal.SIGKILL)
        zygote.close()


def test_children_die_with_the_zygote_and_a_dead_zygote_refuses(tmp_path, zygote_env):
    zygote = _zygote(tmp_path, zygote_env, death_signal=signal.SIGTERM)
    child = _spawn(zygote, tmp_path, ["--sleep"], zygote_env, death_signal=signal.SIGTERM)
    try:
        zygote.process.send_signal(signal.SIGTERM)  # as its own parent's death would
        assert child.wait(30) == -signal.SIGTERM
        assert not procs.alive(child.pid) and not zygote.alive
        with pytest.raises(ZygoteError, match="exited"):
            _spawn(zygote, tmp_path, [], zygote_env)
    finally:
        procs.signal_group(child.pid, signal.SIGKILL)


@pytest.mark.parametrize("preload, reason", [(("threaded",), "started 1 thread"),
                                             (("no_such_module_here",), "ModuleNotFoundError")])
def test_a_zygote_that_cannot_fork_safely_refuses_every_spawn(tmp_path, zygote_env, preload, reason):
    zygote = _zygote(tmp_path, zygote_env, preload=preload)
    with pytest.raises(ZygoteError, match=reason):
        _spawn(zygote, tmp_path, [], zygote_env)
    assert zygote.refusal and not zygote.alive
    zygote.process.wait(30)


def test_only_python_modules_are_forked(tmp_path, zygote_env):
    zygote = _zygote(tmp_path, zygote_env)
    try:
        with open(tmp_path / "x.log", "ab") as log, pytest.raises(ZygoteError, match="python -m MODULE"):
            zygote.spawn(["/bin/true"], zygote_env, log, signal.SIGKILL)
    finally:
        zygote.close()
