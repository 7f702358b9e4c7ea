"""The sandbox contains what a program does: time, CPU, forks, disk, memory, network, output, files."""

from __future__ import annotations

import asyncio
import os
import pathlib
import time

import pytest

from libra.workloads.code_agent import CodeAgentConfig, CodeAgentWorkload
from libra.workloads.sandbox import (UID_BASE, UIDS_PER_PROCESS, SandboxLimits, SandboxStatus, SandboxUnavailable,
                                     check_isolation, isolation_available, python_argv, run_in_sandbox, run_python)
from libra.workloads.sandbox_guard import network_namespace_available

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, output_bytes=400)


def run(code: str, limits: SandboxLimits = LIMITS, **kwargs):
    return asyncio.run(run_python(code, limits, **kwargs))


def test_output_and_exit_status_are_captured():
    result = run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (result.status, result.exit_code, result.stdout, result.stderr) == (SandboxStatus.ERROR, 3, "out\n", "err\n")
    ok = run("print(sum(range(10)))")
    assert ok.status is SandboxStatus.OK and ok.stdout == "45\n" and ok.reason == "exit code 0"


def test_an_infinite_loop_hits_the_cpu_limit():
    result = run("while True:\n    pass")
    assert result.status is SandboxStatus.TIMEOUT and result.signal in ("SIGXCPU", "SIGKILL")


def test_a_sleeping_program_hits_the_wall_clock():
    started = time.monotonic()
    result = run("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0, cpu_s=5))
    assert result.status is SandboxStatus.TIMEOUT and "wall-clock" in result.reason
    assert time.monotonic() - started < 10


def test_a_fork_bomb_is_contained_and_leaves_nothing_behind():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run(code, SandboxLimits(wall_s=2.0, cpu_s=2, max_processes=16))
    assert result.status is SandboxStatus.TIMEOUT
    time.sleep(0.5)
    if isolation_available():  # the pid namespace is gone, and every process in it
        ours = range(UID_BASE, UID_BASE + UIDS_PER_PROCESS)  # the uids this process's sandboxes run as
        stray = [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) in ours]
        assert not stray


def _uid(pid: str) -> int | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def test_a_huge_file_fails_and_the_disk_is_bounded():
    big = run("open('x', 'wb').write(b'0' * (64 * 1024 * 1024))", SandboxLimits(wall_s=5, cpu_s=4, max_file_mb=8))
    assert big.status is SandboxStatus.ERROR and ("File too large" in big.stderr or big.signal == "SIGXFSZ")
    many = run("for i in range(64):\n    open(f'f{i}', 'wb').write(b'0' * (4 * 1024 * 1024))",
               SandboxLimits(wall_s=5, cpu_s=4, max_file_mb=8, disk_mb=32))
    if isolation_available():
        assert many.status is SandboxStatus.ERROR and "No space left" in many.stderr


def test_memory_is_bounded():
    result = run("x = bytearray(2 * 1024 ** 3)", SandboxLimits(wall_s=5, cpu_s=4, memory_mb=256))
    assert result.status is SandboxStatus.ERROR and "MemoryError" in result.stderr


def test_the_network_is_unreachable():
    result = run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('connected')")
    assert result.status is SandboxStatus.ERROR and "connected" not in result.stdout
    assert result.isolation == ("namespaces" if isolation_available() else "guard")


def test_nothing_is_written_outside_and_the_scratch_directory_goes(tmp_path):
    target = tmp_path / "escaped"
    before = set(pathlib.Path("/tmp").glob("libra-sandbox-*"))
    result = run(f"open({str(target)!r}, 'w').write('x')")
    assert not target.exists()
    if isolation_available():
        assert result.status is SandboxStatus.ERROR
    assert set(pathlib.Path("/tmp").glob("libra-sandbox-*")) <= before


def test_output_is_cut_to_the_bound_keeping_head_and_tail():
    result = run("print('A' * 5000)\nprint('END')")
    assert result.stdout_truncated and len(result.stdout) < 600
    assert result.stdout.startswith("AAAA") and result.stdout.rstrip().endswith("END")


def test_files_and_a_source_tree_are_copied_in_and_left_unchanged(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "data.txt").write_text("snapshot")
    result = asyncio.run(run_in_sandbox(python_argv("main.py"), source=tmp_path, limits=LIMITS, files={
        "main.py": "print(open('pkg/data.txt').read())\nopen('pkg/data.txt', 'w').write('changed')"}))
    assert result.status is SandboxStatus.OK and result.stdout == "snapshot\n"
    assert (tmp_path / "pkg" / "data.txt").read_text() == "snapshot"
    with pytest.raises(ValueError):
        asyncio.run(run_in_sandbox(python_argv("main.py"), files={"../out.py": "x"}))
    with pytest.raises(ValueError):
        SandboxLimits(wall_s=0)


def test_without_namespaces_a_run_is_refused_unless_the_workload_allows_it(monkeypatch):
    from libra.workloads import sandbox

    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)  # as on a machine without unshare
    with pytest.raises(SandboxUnavailable, match="allow_unisolated_sandbox"):
        run("print('hi')")
    with pytest.raises(SandboxUnavailable, match="allow_unisolated_sandbox"):
        check_isolation(False)
    with pytest.raises(SandboxUnavailable, match="allow_unisolated_sandbox"):
        CodeAgentWorkload(CodeAgentConfig())  # a workload refuses to start, before any model turn


def test_the_guard_isolation_never_runs_as_root_and_blocks_the_network(monkeypatch, tmp_path):
    from libra.workloads import sandbox

    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)
    script = "id -u; readlink /proc/self/ns/net; touch here; ls -n . | tail -1"
    result = asyncio.run(run_in_sandbox(["/bin/sh", "-c", script], limits=LIMITS, allow_unisolated=True))
    assert (result.status, result.isolation) == (SandboxStatus.OK, "guard"), result
    uid, namespace, listing = result.stdout.splitlines()[:3]
    if os.geteuid() == 0:
        assert int(uid) != 0 and int(uid) in range(UID_BASE, UID_BASE + UIDS_PER_PROCESS)
        assert listing.split()[2] == uid  # its scratch directory is its own
    if network_namespace_available(os.geteuid() == 0):
        assert namespace != os.readlink("/proc/self/ns/net")  # an empty network namespace
    spin = asyncio.run(run_in_sandbox(["/bin/sh", "-c", "while :; do :; done"], limits=LIMITS, allow_unisolated=True))
    assert spin.status is SandboxStatus.TIMEOUT
    big = asyncio.run(run_in_sandbox(["/bin/sh", "-c", "head -c 67108864 /dev/zero > x"], allow_unisolated=True,
                                     limits=SandboxLimits(wall_s=5, cpu_s=4, max_file_mb=8)))
    assert big.status is SandboxStatus.ERROR


def test_the_guard_isolation_blocks_python_sockets_and_limits(monkeypatch):
    """As a user other than root (dropping root needs an interpreter other users can reach, which
    this test cannot count on), Python programs run with rlimits and without sockets."""
    from libra.workloads import sandbox

    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # take the non-root path (no uid to drop to)
    hello = run("print('hi')", allow_unisolated=True)
    assert (hello.status, hello.stdout, hello.isolation) == (SandboxStatus.OK, "hi\n", "guard")
    if network_namespace_available(False):  # as a user: an empty network namespace of its own too
        seen = run("import os\nprint(os.readlink('/proc/self/ns/net'))", allow_unisolated=True)
        assert seen.status is SandboxStatus.OK and seen.stdout.strip() != os.readlink("/proc/self/ns/net")
    network = run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)", allow_unisolated=True)
    assert network.status is SandboxStatus.ERROR and "network access is disabled" in network.stderr
    assert run("while True:\n    pass", allow_unisolated=True).status is SandboxStatus.TIMEOUT
    big = run("open('x', 'wb').write(b'0' * (64 * 1024 * 1024))", SandboxLimits(wall_s=5, cpu_s=4, max_file_mb=8),
              allow_unisolated=True)
    assert big.status is SandboxStatus.ERROR and "File too large" in big.stderr


def test_dropping_root_refuses_an_interpreter_other_users_cannot_reach(monkeypatch):
    from libra.workloads import sandbox, sandbox_guard

    monkeypatch.setattr(sandbox, "isolation_available", lambda: False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox_guard, "unreachable_dirs", lambda program: ["/root"])
    with pytest.raises(SandboxUnavailable, match="cannot reach .* under /root"):
        check_isolation(True)
