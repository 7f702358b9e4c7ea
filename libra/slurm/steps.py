"""One srun step of a Libra job, as the batch step holds it: the `srun` client process, its restarts
and exit statuses; and the health probe that says when a service step serves.

The srun client lives on the batch node and stands for the step: it exits when the step's tasks
do, with their status. Signals go to the step through Slurm (`scancel --signal=TERM JOB.STEP`):
SIGTERM to the client itself would make Slurm SIGKILL the step.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field


@dataclass
class Step:
    """One srun step of the job (a role), its restarts and its last exit status."""

    role: str
    argv: list[str]
    env: dict[str, str]
    restarts: int = 0
    status: int | None = None
    proc: subprocess.Popen | None = None
    next_start: float = 0.0  # a restart is due then (0: none planned)
    history: list[int] = field(default_factory=list)  # exit statuses of the earlier runs

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL)
        self.status = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll(self) -> int | None:
        if self.proc is not None and self.status is None:
            self.status = self.proc.poll()
        return self.status

    def wait(self, timeout_s: float) -> bool:
        """Whether the step ended within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.running


def serving(roles: list[str], addresses: dict[str, str]) -> list[str]:
    """The roles whose gRPC health says SERVING (health needs no token)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    found = []
    for role in roles:
        try:
            with grpc.insecure_channel(addresses[role]) as chan:
                reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                found.append(role)
        except grpc.RpcError:
            pass
    return found
