"""A zygote: one process that imports what a family of children needs once, then forks each of them.

Most of what a Python service spends before it serves is imports: each of Libra's five services
~0.65 CPU-s of grpc, protobuf, pydantic, structlog and its own modules, each hf engine worker ~1.4
CPU-s of torch. `libra up` on a small machine starts seven such processes at once, so its start-up
is short of CPU, not of waiting. A zygote pays those imports once; a child forked from it starts
with them done and shares their pages with its siblings (copy on write):

```
 libra up ──start_group──▶ zygote (libra's service modules) ─fork─▶ libra serve planner | elastic | ...
 libra serve rollout ─────▶ zygote (torch, the hf engine)   ─fork─▶ hf engine worker 0, 1, ...
       │   ▲                   │
       └───┴── SOCK_SEQPACKET ─┘  spawn {argv, env, cwd} + the log's fd ─▶ ◀─ pid, then exit code
```

A child behaves as `python -m MODULE ARGS` started with `procs.start_group` would: it leads its own
session, gets `death_signal` when the zygote dies (and the zygote, started by `start_group`, gets
its own when the thread that started it dies: the chain ends where the exec'd child's did), writes
to the log it was given, and runs MODULE as `__main__` with the environment it was given; it exits
through the interpreter's normal shutdown (threads joined, exit handlers run). Its
/proc/PID/environ is the zygote's (a forked process's initial environment is its parent's), so the
markers `procs.sweep` and `procs.adopt` look for must be in the zygote's environment: start the
zygote with the environment its children share.

A forked process's command line (/proc/PID/cmdline: what `ps` shows, what `pgrep -f` matches) is its
parent's; each child writes its own `python -m MODULE ARGS` over it, into room the zygote's command
line reserves (`TITLE_ROOM` bytes), and the zygote then shows itself as `python -m libra.zygote`
with its preloads.

Forking is safe only from a process with one thread: a zygote whose preloads started a thread
refuses every spawn (`ZygoteError`), and so does a dead one; the caller then starts the child the
ordinary way (`procs.start_group`). Linux only (PR_SET_PDEATHSIG).

Must not know: which services or engines exist.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, BinaryIO

MAX_MESSAGE = 1 << 20  # a spawn request (argv and environment) or a reply; bounded
SPAWN_TIMEOUT_S = 30.0  # for the zygote's reply to one spawn, once it is ready
PR_SET_PDEATHSIG = 1
TITLE_ROOM = 4096  # bytes of command line the zygote reserves for its children's


class ZygoteError(RuntimeError):
    """The zygote cannot fork this child (it is dead, never got ready, or refuses): start it another way."""


class ForkedProcess:
    """A child of a zygote, with the part of `subprocess.Popen` that its owner uses: `pid`,
    `returncode` (negative: the signal that ended it), `poll()` and `wait()`."""

    def __init__(self, pid: int, death_signal: int):
        self.pid, self.death_signal = pid, death_signal
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class Zygote:
    """The owner's side: starts the zygote, asks it to fork children, learns how they end."""

    def __init__(self, preload: list[str], env: dict[str, str], death_signal: int, log_path: Any,
                 ready_timeout_s: float = 120.0):
        from libra import procs

        self.preload, self.ready_timeout_s = list(preload), ready_timeout_s
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(log_path, "ab") as log:
            self.process = procs.start_group(
                [sys.executable, "-m", "libra.zygote", "--fd", str(theirs.fileno()), "--room=" + "." * TITLE_ROOM,
                 *self.preload], death_signal,
                env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        theirs.close()
        self._lock = threading.Lock()  # one spawn at a time: replies come in request order
        self._ready = threading.Event()
        self._reply: dict[str, Any] = {}
        self._replied = threading.Event()
        self._table = threading.Lock()  # the two tables below: the reader and spawn both write them
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # an exit read before its spawn's reply was handled
        self.refusal: str | None = None  # why it serves no spawn, once it does not
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.refusal is None and self.process.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], log: BinaryIO, death_signal: int,
              cwd: str | None = None) -> ForkedProcess:
        """Fork `argv` (`[python, "-m", MODULE, ARGS...]`) with environment `env`, its output to `log`."""
        if len(argv) < 3 or argv[1] != "-m":
            raise ZygoteError(f"a zygote forks `python -m MODULE ...` only, not {argv[:3]}")
        if not self._ready.wait(self.ready_timeout_s):
            self.refusal = self.refusal or f"not ready after {self.ready_timeout_s:.0f}s"
        if self.refusal is not None:
            raise ZygoteError(self.refusal)
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd(),
                              "death_signal": int(death_signal)}).encode()
        if len(request) > MAX_MESSAGE:
            raise ZygoteError(f"spawn request of {len(request)} bytes exceeds {MAX_MESSAGE}")
        with self._lock:
            self._replied.clear()
            try:
                socket.send_fds(self._socket, [request], [log.fileno()])
            except OSError as error:
                raise ZygoteError(f"the zygote is gone ({error})") from error
            if not self._replied.wait(SPAWN_TIMEOUT_S):  # a late reply would answer the next spawn: no more
                self.refusal = self.refusal or f"no reply to a spawn within {SPAWN_TIMEOUT_S:.0f}s"
            if self.refusal is not None or "pid" not in self._reply:
                raise ZygoteError(self._reply.get("error") or self.refusal or "no reply to a spawn")
            child = ForkedProcess(int(self._reply["pid"]), death_signal)
            with self._table:
                self._children[child.pid] = child
                if child.pid in self._early_exits:
                    child._exit(self._early_exits.pop(child.pid))
        return child

    def close(self) -> None:
        """Let the zygote go (it exits when its socket closes); children still running keep running
        until they exit or the zygote's end sends them their death signal."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read(self) -> None:
        from libra import procs

        while True:
            try:
                data = self._socket.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            if "ready" in message:
                self._ready.set()
            elif "refused" in message:
                self.refusal = f"the zygote refuses to fork: {message['refused']}"
                self._ready.set()
            elif "exited" in message:
                pid, code = int(message["exited"]), int(message["code"])
                with self._table:
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early_exits[pid] = code
                if child is not None:
                    child._exit(code)
            else:  # a spawn's reply: {"pid": N} or {"error": why}
                self._reply = message
                self._replied.set()
        # The zygote is gone: its children got their death signal. Not its children, so not ours to
        # reap: each counts as ended by that signal once /proc shows it gone.
        self.refusal = self.refusal or f"the zygote exited (code {self.process.wait()})"
        self._ready.set()
        self._replied.set()
        with self._table:
            orphaned = list(self._children.items())
        for pid, child in orphaned:
            while procs.alive(pid):
                time.sleep(0.05)
            child._exit(-child.death_signal)


# ---- the zygote process ---------------------------------------------------------------------------

@dataclass
class _Child:
    request: dict[str, Any]
    log_fd: int | None
    zygote_pid: int


def set_command_line(argv: list[str]) -> bool:
    """Write `argv` over this process's command line as /proc/PID/cmdline shows it (the memory the
    kernel reads it from, between arg_start and arg_end of /proc/self/stat), cut to fit; False where
    that cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # proc(5) fields 48 and 49
    except (OSError, IndexError, ValueError):
        return False
    if end <= start:
        return False
    text = b"\0".join(part.encode(errors="replace") for part in argv)[:end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)
    return True


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve(channel: socket.socket) -> _Child:
    """Fork a child per request and report how each ends, until the owner hangs up; returns only in a
    forked child, with what it must run."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the wakeup fd
    while True:
        try:
            ready, _, _ = select.select([channel, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            _reap(channel)
        if channel not in ready:
            continue
        data, fds, flags, _ = socket.recv_fds(channel, MAX_MESSAGE, 1)
        if not data:
            raise SystemExit(0)  # the owner is gone: its children get their death signal as this exits
        if flags & socket.MSG_TRUNC:
            for fd in fds:
                os.close(fd)
            _tell(channel, {"error": "spawn request truncated"})
            continue
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        zygote_pid = os.getpid()  # (the child checks its parent against it once its death signal is armed)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            channel.close()
            return _Child(request, fds[0] if fds else None, zygote_pid)
        for fd in fds:
            os.close(fd)
        _tell(channel, {"pid": pid})


def _tell(channel: socket.socket, message: dict[str, Any]) -> None:
    try:
        channel.send(json.dumps(message).encode())
    except OSError:  # the owner is gone: so is the reason to run
        raise SystemExit(0) from None


def _reap(channel: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _tell(channel, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _run(child: _Child) -> Any:
    """In the forked child: become what `python -m MODULE ARGS` with this environment would be."""
    request = child.request
    death_signal = int(request["death_signal"])
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, death_signal, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != child.zygote_pid:  # the zygote died before the signal was armed
        os._exit(128 + death_signal)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if child.log_fd is not None:
        os.dup2(child.log_fd, 1)
        os.dup2(child.log_fd, 2)
        os.close(child.log_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    argv = request["argv"]
    set_command_line(argv)
    sys.argv = [argv[0], *argv[3:]]
    # runpy warns that a preloaded module is run as __main__ again: that is the point here
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return done.code
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A zygote: imports modules once, forks children on request "
                                                 "(libra/zygote.py; started by its owner, not by hand)")
    parser.add_argument("--fd", type=int, required=True, help="the owner's SOCK_SEQPACKET socket")
    parser.add_argument("--room", default="", help="room for the children's command lines (ignored)")
    parser.add_argument("preload", nargs="*", help="modules to import before forking")
    args = parser.parse_args(argv)
    set_command_line([sys.executable, "-m", "libra.zygote", *args.preload])
    channel = socket.socket(fileno=args.fd)
    started = time.process_time()
    try:
        for module in args.preload:
            importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - told to the owner, who starts its children another way
        channel.send(json.dumps({"refused": f"preloading failed: {type(error).__name__}: {error}"}).encode())
        raise
    if _threads() != 1:  # a fork would copy locks other threads hold, never released in the child
        channel.send(json.dumps({"refused": f"its preloads ({', '.join(args.preload)}) started "
                                            f"{_threads() - 1} thread(s); forking is unsafe"}).encode())
        raise SystemExit(3)
    print(json.dumps({"event": "zygote ready", "preload": args.preload, "pid": os.getpid(),
                      "preload_cpu_s": round(time.process_time() - started, 3)}), flush=True)
    channel.send(json.dumps({"ready": os.getpid()}).encode())
    child = _serve(channel)
    sys.exit(_run(child))


if __name__ == "__main__":
    main()
