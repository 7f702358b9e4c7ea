"""A private redis-server for `libra up` and the tests (loopback only).

It runs in its own session and is SIGKILLed by the kernel when the process that started it dies
(libra/procs.py): a killed `libra up` or test session leaves no Redis behind.

`persistent=True` (what `libra up` uses) keeps an append-only file in its directory, by default
written and fsynced before each reply (`appendfsync always`; redis.appendfsync): a Redis killed and
started again (`restart`, same port, same directory) comes back with everything it had acknowledged,
as does one whose machine crashed. `everysec` does not promise that: while a background fsync is slow
(a busy disk: a checkpoint being written) Redis holds its writes back for up to 2 s but still replies,
and a killed redis-server loses them (in CI 148 of 200 acknowledged entries came back). The
tests' Redis keeps nothing on disk.
"""

from __future__ import annotations

import pathlib
import random
import shutil
import signal
import socket
import subprocess
import time
from typing import Mapping

from libra import procs
from libra.errors import FailedPrecondition

INSTALL_HINT = ("redis-server was not found on PATH. Install it (Debian/Ubuntu: `sudo apt-get install -y "
                "redis-server`; macOS: `brew install redis`) or point Libra at a running Redis with "
                "--redis-url redis://HOST:PORT/0 (or LIBRA_REDIS_URL)")

APPENDFSYNC = ("always", "everysec", "no")


PORT_FLOOR = 10_000  # the lowest port free_port hands out
_handed_out: set[int] = set()  # this process's earlier answers, not handed out twice


def _ephemeral_floor(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The lowest port the kernel picks by itself (for a bind to port 0, or a connection's own end)."""
    try:
        with open(path) as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port on `host` that nothing listens on now, for a server this process is about to start.

    Chosen below the kernel's ephemeral range (`ip_local_port_range`), where no connection's own end
    is ever placed: a port from that range (a bind to port 0) can be taken by any outgoing connection
    in the moment between this choice and the server's bind ("Address already in use", seen in CI).
    Never the same port twice in one process. Falls back to the kernel's choice where the range below
    is too narrow."""
    rng = rng or random.SystemRandom()
    ceiling = _ephemeral_floor()
    if ceiling - PORT_FLOOR >= 1_000:
        for _ in range(200):
            port = rng.randrange(PORT_FLOOR, ceiling)
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    _handed_out.add(port)
    return port


class PrivateRedis:
    """Start `redis-server` on a free loopback port in `directory`; stop it on `stop()`.

    `log_path`: where its output goes (default `directory`/redis.log, appended); `env`: its
    environment (default this process's).
    """

    def __init__(self, directory: pathlib.Path, port: int | None = None, log_path: pathlib.Path | None = None,
                 env: Mapping[str, str] | None = None, persistent: bool = False, appendfsync: str = "always"):
        if appendfsync not in APPENDFSYNC:
            raise ValueError(f"appendfsync must be one of {', '.join(APPENDFSYNC)}, got {appendfsync!r}")
        self.persistent = persistent
        self.appendfsync = appendfsync
        self.directory = pathlib.Path(directory)
        self.port = port or free_port()
        self.log_path = pathlib.Path(log_path) if log_path is not None else self.directory / "redis.log"
        self.env = dict(env) if env is not None else None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0, attempts: int = 3) -> "PrivateRedis":
        """Start and wait for PONG; a port taken meanwhile by someone else means another try."""
        for attempt in range(attempts):
            try:
                return self._start_once(timeout_s)
            except FailedPrecondition:
                if attempt == attempts - 1 or shutil.which("redis-server") is None:
                    raise
                self.stop()
                self.port = free_port()
        raise AssertionError("unreachable")

    def restart(self, timeout_s: float = 30.0) -> "PrivateRedis":
        """Start it again after it died: same port (its clients reconnect there), same directory (a
        persistent one reloads its append-only file, which can take a while for a large one)."""
        self.stop()
        return self._start_once(timeout_s)

    def _start_once(self, timeout_s: float) -> "PrivateRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            raise FailedPrecondition(INSTALL_HINT)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            persistence = ["--appendonly", "yes", "--appendfsync", self.appendfsync] if self.persistent else \
                ["--appendonly", "no"]
            self.process = procs.start_group(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence,
                 "--dir", str(self.directory), "--protected-mode", "yes"],
                signal.SIGKILL, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise FailedPrecondition(f"redis-server exited with {self.process.returncode}; see "
                                         f"{self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise FailedPrecondition(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
