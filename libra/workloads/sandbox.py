"""Running untrusted programs (model-written code, a repository's tests) in a contained subprocess.

What a run gets: a fresh copy of a source directory as its working directory, a minimal
environment, CPU / memory / file-size / process / open-file limits, a wall-clock limit, and bounded
stdout/stderr. What it returns is a structured `SandboxRun` (status ok/error/timeout, exit code,
signal, captured output), never an exception for anything the program itself does.

Two isolation levels; `SandboxRun.isolation` says which one a run had:

``namespaces`` (root and a working ``unshare``; the default here)::

    rollout process ── unshare --net --mount --pid --fork --kill-child ──▶ launcher (pid 1, root)
       │ wall clock: SIGKILL the process group                              │ tmpfs of disk_mb as /tmp,
       │ (the kernel then kills the whole pid namespace)                     │ a copy of the source in /tmp/work,
       └─ reads stdout/stderr up to output_bytes, drains the rest             │ empty tmpfs on /dev/shm, /var/tmp
                                                                              └─ fork ▶ rlimits, setuid(unique uid)
                                                                                        ▶ exec the program
    No network (an empty network namespace), no other process visible, a fork bomb stops at
    `max_processes` (RLIMIT_NPROC of a uid no one else uses), disk use stops at `disk_mb`. The
    program runs as that uid: it can write only to the tmpfs (gone with the namespace) and to
    world-writable directories other than /tmp, /var/tmp, /dev/shm (none on a usual system), and
    read what any user may read. A directory on the interpreter's path that others cannot
    traverse (e.g. /root holding a pyenv Python) is replaced, in the namespace only, by an empty
    tmpfs showing just the interpreter's subdirectory.

``guard`` (not root, or no ``unshare``): refused (`SandboxUnavailable`) unless the caller allows
an unisolated run (`allow_unisolated=True`, from the workload's `allow_unisolated_sandbox`). Then:
rlimits in a new session, an empty network namespace where the kernel allows one, root dropped to
an unused uid (never root), a scratch directory deleted afterwards, and a ``sitecustomize`` that
makes ``socket`` unusable for Python programs (sandbox_guard.py). Weaker: the program sees the
host's files and processes and can write to world-writable directories; as a non-root user,
RLIMIT_NPROC counts all of the user's processes.

This module knows nothing about workloads, tokens or Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from libra import log as liblog
from libra import procs
from libra.workloads.sandbox_guard import (GUARD_SITECUSTOMIZE, HINT, UNSHARE_NET, SandboxUnavailable,
                                           check_unisolated, give_to, network_namespace_available, preexec)
from libra.workloads.sandbox_launcher import LAUNCHER

_log = liblog.get("libra.sandbox")
UIDS_PER_PROCESS = 256
UID_FIRST = 100_000
"""Sandboxed programs run as uids UID_FIRST.. (unused by anyone else), one per concurrent run of a
process (cycling through UIDS_PER_PROCESS), so RLIMIT_NPROC counts only that run's processes."""
UID_BASE = UID_FIRST + (os.getpid() % 4096) * UIDS_PER_PROCESS
_uids = itertools.count()
_warned: list[bool] = []  # the unisolated mode was logged once


class SandboxStatus(str, enum.Enum):
    OK = "ok"  # exit code 0
    ERROR = "error"  # non-zero exit, a signal, or a limit other than time
    TIMEOUT = "timeout"  # wall-clock or CPU-time limit


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run (all enforced by the kernel, the wall clock by the caller)."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    disk_mb: int = 64  # size of the tmpfs the program may write to (namespaces isolation)
    max_file_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE)
    max_processes: int = 32  # processes and threads of the program (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 16_384  # stdout and stderr are each cut to this many bytes

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "disk_mb", "max_file_mb", "max_processes",
                     "max_open_files", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class SandboxRun:
    """What a program did: how it ended and what it printed (each stream cut to output_bytes)."""

    status: SandboxStatus
    reason: str  # "exit code 1", "killed by SIGXFSZ (file size limit)", "wall-clock limit 2.0s" ...
    exit_code: int | None
    signal: str | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    seconds: float
    isolation: str  # "namespaces" or "guard"


_SIGNAL_REASONS = {"SIGXCPU": "CPU-time limit", "SIGXFSZ": "file size limit", "SIGKILL": "killed",
                   "SIGSEGV": "segmentation fault", "SIGABRT": "aborted"}

@functools.lru_cache(maxsize=1)
def isolation_available() -> bool:
    """True when runs get the `namespaces` isolation (root, and unshare works here)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    try:
        probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                                "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _next_uid() -> int:
    return UID_BASE + next(_uids) % UIDS_PER_PROCESS


def _reveal_list(stash_root: pathlib.Path) -> list[list[str]]:
    """Directories on the interpreter's path that other users cannot traverse, and what to show."""
    reveal, seen = [], set()
    for target in {pathlib.Path(sys.base_prefix).resolve(), pathlib.Path(sys.prefix).resolve(),
                   pathlib.Path(os.path.realpath(sys.executable)).parent}:
        parts = target.parts
        for depth in range(1, len(parts) - 1):
            blocked = pathlib.Path(*parts[:depth + 1])
            if not os.stat(blocked).st_mode & 0o001:
                child = pathlib.Path(*parts[:depth + 2])
                if str(blocked) not in seen:
                    seen.add(str(blocked))
                    reveal.append([str(blocked), str(child), str(stash_root / f"reveal{len(reveal)}")])
                break
    return reveal


def _under_tmp() -> list[str]:
    """The interpreter's directories that live under /tmp, which the sandbox's own /tmp would hide."""
    paths = {pathlib.Path(sys.base_prefix).resolve(), pathlib.Path(sys.prefix).resolve(),
             pathlib.Path(os.path.realpath(sys.executable)).parent, pathlib.Path(sys.executable).parent.resolve()}
    tmp = pathlib.Path("/tmp").resolve()
    under = sorted(str(path) for path in paths if tmp in path.parents)
    return [path for path in under if not any(path.startswith(other + "/") for other in under)]  # outermost only


def _rlimits(limits: SandboxLimits) -> dict[str, list[int]]:
    """(soft, hard) per limit; CPU time gets SIGXCPU at the soft limit, SIGKILL a second later."""
    mib = 1024 * 1024
    same = {"RLIMIT_AS": limits.memory_mb * mib, "RLIMIT_FSIZE": limits.max_file_mb * mib,
            "RLIMIT_NPROC": limits.max_processes, "RLIMIT_NOFILE": limits.max_open_files, "RLIMIT_CORE": 0}
    return {"RLIMIT_CPU": [limits.cpu_s, limits.cpu_s + 1], **{name: [v, v] for name, v in same.items()}}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0"}
    env.update(extra or {})
    return env


async def _read_bounded(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    """The head and the tail of a stream, `limit` bytes in all (the tail holds a traceback's last
    line); everything in between is read and dropped, so the writer never blocks on a full pipe."""
    head, tail, seen = bytearray(), bytearray(), 0
    half = limit // 2
    while chunk := await stream.read(65536):
        seen += len(chunk)
        take = min(len(chunk), limit - half - len(head))
        head += chunk[:take]
        tail = (tail + chunk[take:])[-half:] if half else tail
    if seen <= limit:
        return bytes(head + tail), False
    return bytes(head) + b"\n[... output truncated ...]\n" + bytes(tail), True


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def check_isolation(allow_unisolated: bool, program: str = sys.executable) -> str:
    """The isolation a run of `program` gets here, "namespaces" or "guard"; raises SandboxUnavailable
    when it is "guard" and that is not allowed, or could not start `program`. Workloads call it at
    start (for this interpreter), so a run that would be refused never gets that far."""
    if isolation_available():
        return "namespaces"
    if not allow_unisolated:
        why = "not root" if os.geteuid() != 0 else "`unshare` of mount, pid and network namespaces fails"
        raise SandboxUnavailable(f"the sandbox has no namespace isolation here ({why}); {HINT}")
    check_unisolated(program)
    return "guard"


async def run_in_sandbox(argv: Sequence[str], source: str | os.PathLike[str] | None = None,
                         files: dict[str, str] | None = None, limits: SandboxLimits = SandboxLimits(),
                         env: dict[str, str] | None = None, allow_unisolated: bool = False) -> SandboxRun:
    """Run `argv` (argv[0] an absolute path) in a copy of `source` plus `files` (relative path → text).

    Without namespaces the run is refused (SandboxUnavailable) unless `allow_unisolated`."""
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError(f"argv[0] must be an absolute path of a program, got {list(argv)[:1]}")
    isolation = check_isolation(allow_unisolated, argv[0])
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="libra-sandbox-"))
    try:
        stage = scratch / "stage"
        if source is not None:
            shutil.copytree(source, stage, symlinks=True)
        stage.mkdir(exist_ok=True)
        for relative, text in (files or {}).items():
            path = (stage / relative).resolve()
            if stage.resolve() not in path.parents:
                raise ValueError(f"file {relative!r} would be written outside the sandbox directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if isolation == "namespaces":
            return await _run_namespaced(list(argv), scratch, stage, limits, env)
        return await _run_guarded(list(argv), scratch, stage, limits, env)
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)


async def _run_namespaced(argv: list[str], scratch: pathlib.Path, stage: pathlib.Path, limits: SandboxLimits,
                          env: dict[str, str] | None) -> SandboxRun:
    (scratch / "box").mkdir()
    params = {"status": str(scratch / "status.json"), "box": str(scratch / "box"), "source": str(stage),
              "uid": _next_uid(), "disk_mb": limits.disk_mb, "reveal": _reveal_list(scratch),
              "keep": _under_tmp(),
              "rlimits": _rlimits(limits), "argv": argv, "env": _env(env)}
    # SIGKILL when the rollout process dies: `--kill-child` then takes the whole namespace down.
    command = procs.with_parent_death_signal(
        ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
         sys.executable, "-I", "-c", LAUNCHER, json.dumps(params)], signal.SIGKILL)
    result = await _supervise(command, None, limits, "namespaces")
    status_path = scratch / "status.json"
    try:
        ended = json.loads(status_path.read_text())
    except (OSError, ValueError):
        ended = None  # killed before the program ended: _supervise's verdict stands
    if ended is None or result.status is SandboxStatus.TIMEOUT:
        if ended is None and result.status is not SandboxStatus.TIMEOUT:
            return dataclasses.replace(result, status=SandboxStatus.ERROR,
                                       reason=f"the sandbox failed to start the program ({result.reason})")
        return result
    return _verdict(result, ended["exit"], ended["signal"], limits)


async def _run_guarded(argv: list[str], scratch: pathlib.Path, stage: pathlib.Path, limits: SandboxLimits,
                       env: dict[str, str] | None) -> SandboxRun:
    guard = scratch / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD_SITECUSTOMIZE)
    rlimits = _rlimits(limits)
    uid = None
    if os.geteuid() == 0:  # never root: an unused uid (RLIMIT_NPROC then counts this run only)
        uid = _next_uid()
        give_to(scratch, uid)
    else:  # RLIMIT_NPROC counts every process of the user: allow the ones running
        running = sum(1 for entry in os.listdir("/proc") if entry.isdigit())
        rlimits["RLIMIT_NPROC"] = [n + running for n in rlimits["RLIMIT_NPROC"]]
    root = uid is not None
    network = network_namespace_available(root)
    if not _warned:
        _warned.append(True)
        _log.warning("sandboxed code runs without namespaces (workload.allow_unisolated_sandbox)",
                     uid=uid if root else os.geteuid(),
                     network="empty namespace" if network else "open (Python sockets blocked only)")
    if network and not root:
        argv = [*UNSHARE_NET, *argv]
    set_up = preexec(rlimits, uid, network and root)
    return await _supervise(argv, dict(cwd=str(stage), preexec_fn=set_up,
                                       env=_env({**(env or {}), "PYTHONPATH": str(guard), "TMPDIR": str(stage)})),
                            limits, "guard")


async def _supervise(command: list[str], options: dict | None, limits: SandboxLimits, isolation: str) -> SandboxRun:
    """Start the process in its own session, enforce the wall clock, capture bounded output."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True, **(options or {"env": _env()}))
    readers = asyncio.gather(_read_bounded(process.stdout, limits.output_bytes),
                             _read_bounded(process.stderr, limits.output_bytes))
    timed_out = False
    try:
        await asyncio.wait_for(process.wait(), limits.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        if process.returncode is None or timed_out:
            _kill_group(process.pid)
            await process.wait()
    try:  # a grandchild that escaped the group could hold the pipes open: bound the wait
        (out, out_cut), (err, err_cut) = await asyncio.wait_for(readers, 5.0)
    except asyncio.TimeoutError:
        readers.cancel()
        (out, out_cut), (err, err_cut) = (b"", True), (b"", True)
    seconds = time.monotonic() - started
    code = process.returncode
    base = SandboxRun(SandboxStatus.OK, "exit code 0", code, None, _decode(out), _decode(err),
                      out_cut, err_cut, seconds, isolation)
    if timed_out:
        return dataclasses.replace(base, status=SandboxStatus.TIMEOUT, reason=f"wall-clock limit {limits.wall_s}s",
                                   exit_code=None, signal="SIGKILL")
    if code is not None and code < 0:
        return _verdict(base, None, -code, limits)
    return _verdict(base, code, None, limits)


def _verdict(base: SandboxRun, exit_code: int | None, signum: int | None, limits: SandboxLimits) -> SandboxRun:
    if signum is not None:
        name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
        status = SandboxStatus.TIMEOUT if name == "SIGXCPU" else SandboxStatus.ERROR
        reason = f"killed by {name} ({_SIGNAL_REASONS.get(name, 'signal')})"
        return dataclasses.replace(base, status=status, reason=reason, exit_code=None, signal=name)
    if exit_code == 0:
        return dataclasses.replace(base, exit_code=0)
    return dataclasses.replace(base, status=SandboxStatus.ERROR, reason=f"exit code {exit_code}", exit_code=exit_code)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def run_python(code: str, limits: SandboxLimits = SandboxLimits(), files: dict[str, str] | None = None,
                     source: str | os.PathLike[str] | None = None, allow_unisolated: bool = False) -> SandboxRun:
    """Run Python source `code` as ``main.py`` in the sandbox (with `files` beside it)."""
    return await run_in_sandbox(python_argv("main.py"), source=source, files={**(files or {}), "main.py": code},
                                allow_unisolated=allow_unisolated,
                                limits=limits)


def python_argv(*args: str) -> list[str]:
    """argv running this interpreter with `args` the way the active isolation allows."""
    return [sys.executable, "-I" if isolation_available() else "-s", *args]
