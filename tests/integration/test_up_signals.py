"""`libra up` leaves nothing behind: SIGTERM, SIGHUP and Ctrl-C (SIGINT) stop everything it
started, and so does the kernel when `libra up` itself is SIGKILLed.

Each case is a real `libra up` (private Redis, the five services, two engine workers of the
transformers engine — the cheapest that runs the whole loop — and a few GRPO steps) given one
signal once training runs. Every process the job started inherits an environment marker from the
test, however it was started (vLLM's and the engines' processes included): after the signal,
within a bound, no process carries it and every port those processes listened on is free again.

The SIGTERM case first serves as the live system for `libra status`: with a short
elastic.heartbeat_timeout_s, well past it, every pool member is still alive (the rollout gateway
lists its workers, the trainer answers the coordinator), not "offline … missed heartbeats".
"""

from __future__ import annotations

import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from libra import procs

pytestmark = pytest.mark.slow
MARK = "LIBRA_TEST_UP_SIGNALS"
HEARTBEAT_TIMEOUT_S = 4.0
STOP_BOUND_S = 90.0  # libra up's own: 60 s for the services, then Redis and the sweep; slack for a busy machine


def _free_ports(count: int) -> list[int]:
    """`count` consecutive free ports below the kernel's ephemeral range: a port picked inside it
    (bind to port 0) can be taken by an earlier service's outgoing connection before the service
    it was meant for binds it (seen here: the trainer, started last, found its port in use)."""
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        first = random.randrange(20_000, low - count)
        if all(_port_free(p) for p in range(first, first + count)):
            return list(range(first, first + count))
    raise AssertionError("no free ports below the ephemeral range")


def _config(tmp_path: pathlib.Path) -> tuple[pathlib.Path, int]:
    """The quickstart on free ports (as test_end_to_end's `_config`), and a base port for its two
    engine workers."""
    ports = _free_ports(7)  # five services, then the two workers
    services = ", ".join(f"{s}: 127.0.0.1:{p}" for s, p in zip(("planner", "scheduler", "rollout", "trainer",
                                                                "elastic"), ports))
    config = tmp_path / "signals.yaml"
    config.write_text(pathlib.Path("configs/quickstart.yaml").read_text()
                      + f"\naddresses: {{{services}}}\nmetrics: {{base_port: 0}}\n")
    return config, ports[5]


class Up:
    """One `libra up` subprocess and its output, read as it comes."""

    def __init__(self, tmp_path: pathlib.Path, steps: int = 500, extra: tuple[str, ...] = ()):
        self.token = uuid.uuid4().hex
        self.run_dir = tmp_path / "run"
        config, worker_port = _config(tmp_path)
        command = [sys.executable, "-m", "libra.cli", "up", "--config", str(config),
                   "--run-dir", str(self.run_dir), "--set", f"trainer.steps={steps}", "--set", "trainer.warmup.steps=4",
                   "--set", "trainer.groups_per_step=2", "--set", "trainer.group_size=4",
                   "--set", "rollout.worker.engine=hf", "--set", f"rollout.worker.base_port={worker_port}",
                   "--set", f"elastic.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", *extra]
        self.lines: list[str] = []
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, MARK: self.token})
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 400) -> float:
        """Until a line contains `text`; when it came (monotonic)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, f"libra up exited ({self.process.returncode}):\n{self.output[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout}s:\n{self.output[-3000:]}"
            time.sleep(0.2)
        return time.monotonic()

    def marked(self) -> list[int]:
        return procs.marked(MARK, self.token)

    def clean_up(self) -> None:
        """Whatever a failed test left: libra up and every process of its job."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        procs.sweep(MARK, self.token, grace_s=0)


def _listening_ports(pids: list[int]) -> set[int]:
    """TCP ports the processes `pids` listen on (from /proc: their socket inodes in LISTEN state)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle
        try:
            sock.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def _pool_states(run_dir: pathlib.Path) -> dict[str, str]:
    """Member -> state, as `libra status` prints the pool (the resolved config has every address)."""
    status = subprocess.run([sys.executable, "-m", "libra.cli", "status", "--config", str(run_dir / "config.yaml")],
                            capture_output=True, text=True, timeout=60)
    pool = status.stdout.split("pool ", 1)[1].split("\nrollout ", 1)[0]
    rows = [line.split() for line in pool.splitlines()[1:] if line.startswith("  ") and " gen " in line]
    return {row[0]: row[2] for row in rows}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL],
                         ids=lambda s: signal.Signals(s).name)
def test_libra_up_stops_everything_it_started(tmp_path, sig):
    up = Up(tmp_path)
    try:
        training = up.wait_for("trainer: training")  # the workers serve the first weights by then
        if sig == signal.SIGTERM:
            up.wait_for("step   1/")
            time.sleep(max(0.0, training + 2 * HEARTBEAT_TIMEOUT_S - time.monotonic()))
            states = _pool_states(up.run_dir)
            assert states == {"long-1": "rollout", "short-0": "rollout", "trainer-0": "training"}, states

        pids = up.marked()
        ports = _listening_ports(pids)
        assert len(pids) >= 8 and len(ports) >= 8, (pids, ports)  # Redis, 5 services, 2 workers at least
        up.process.send_signal(sig)
        code = up.process.wait(STOP_BOUND_S)
        deadline = time.monotonic() + (30 if sig == signal.SIGKILL else 1)  # the kernel's kills, then their own
        while (up.marked() or [p for p in ports if not _port_free(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)  # (a process killed mid-exit can lose its environ, the mark, before its sockets)
        assert up.marked() == [], f"left running: {up.marked()}"
        assert [p for p in ports if not _port_free(p)] == []
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL
        else:
            assert code == 128 + sig, up.output[-3000:]
            up.reader.join(10)  # the output to its end
            assert f"{signal.Signals(sig).name} received: stopping every service" in up.output
            assert "nothing of this run is running" in up.output.splitlines()[-1]
    finally:
        up.clean_up()
