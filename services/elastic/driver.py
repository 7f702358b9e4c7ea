"""The effects of the hybrid-pool state machine: trainer and rollout RPCs and hybrid processes.

The coordinator's replica tasks decide *what* to do (core.py) and call a `ReplicaDriver` to do it;
`GrpcReplicaDriver` is the real one:

```
 coordinator ──AdmitHybrid / ReleaseHybrid / GetStepManifest(0)──▶ trainer   (returns at once;
      │                                                                       effect at a step boundary)
      ├──DrainWorker / StartWorkers──▶ rollout gateway   (drain: deregister from the scheduler,
      │                                                   let in-flight turns finish, stop)
      └──HybridProcesses: `python -m libra.services.trainer.elastic.hybrid …` (own session, log file;
                          SIGTERM when the coordinator dies: a restarted coordinator finds the
                          process gone and rolls the replica back)
```

Every trainer call carries a request id derived from (replica, generation, verb), so a call
repeated after a coordinator restart is a replay the trainer answers without acting twice.
"""

from __future__ import annotations

import abc
import asyncio
import os
import pathlib
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import grpc

from libra import log as liblog
from libra import procs
from libra.errors import Unavailable
from libra.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

_log = liblog.get("libra.elastic")
RPC_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HybridView:
    """What the trainer says about one hybrid: its data-plane state (lower case) and why it failed."""

    state: str
    reason: str = ""
    generation: int = 0   # the admission it describes (0: not said)


@dataclass(frozen=True)
class TrainerView:
    """The latest frozen step manifest, as the coordinator needs it."""

    step: int
    active: frozenset[str]
    hybrids: dict[str, HybridView] = field(default_factory=dict)


def trainer_view(manifest: trainer_pb2.StepManifest) -> TrainerView:
    hybrids = {h.replica_id: HybridView(trainer_pb2.HybridState.Name(h.state)[len("HYBRID_STATE_"):].lower(),
                                        h.reason, h.generation)
               for h in manifest.hybrids}
    return TrainerView(manifest.step, frozenset(manifest.active_replicas), hybrids)


class ReplicaDriver(abc.ABC):
    """Everything the coordinator does to the outside world. Each method is safe to repeat."""

    @abc.abstractmethod
    async def admit(self, replica_id: str, generation: int) -> None:
        """Register the replica with the trainer as joining (its gradient counts as zero)."""

    @abc.abstractmethod
    async def release(self, replica_id: str, generation: int) -> None:
        """Ask the trainer to drop the replica at the next step boundary (absent: nothing to do)."""

    @abc.abstractmethod
    async def view(self) -> TrainerView:
        """The trainer's latest step manifest."""

    @abc.abstractmethod
    async def launch(self, replica_id: str, generation: int) -> int:
        """Start the hybrid process; its pid (0 when processes are started elsewhere)."""

    @abc.abstractmethod
    def alive(self, replica_id: str, pid: int) -> bool | None:
        """Whether the hybrid process runs (None: this driver does not watch processes)."""

    @abc.abstractmethod
    async def stop(self, replica_id: str, pid: int) -> None:
        """Stop the hybrid process if it still runs."""

    @abc.abstractmethod
    async def drain_worker(self, worker_id: str, timeout_s: float) -> None:
        """Stop routing to a rollout worker, let its in-flight turns finish, stop it."""

    @abc.abstractmethod
    async def start_workers(self, buckets: list[common_pb2.BucketSpec], request_id: str) -> list[str]:
        """Start rollout workers; their ids once they serve."""


class HybridProcesses:
    """Hybrid processes of this host, each in its own session, that die with the coordinator
    process (libra/procs.py: parent-death signal), so none outlives it holding a GPU or a port.
    A coordinator stopped and started again in the same process keeps them."""

    def __init__(self, argv: tuple[str, ...], values: dict[str, str], log_dir: pathlib.Path):
        self.argv, self.values, self.log_dir = argv, values, log_dir
        self.children: dict[int, subprocess.Popen] = {}

    def launch(self, replica_id: str, generation: int) -> int:
        if not self.argv:
            return 0
        values = {"python": sys.executable, **self.values, "replica_id": replica_id, "generation": str(generation)}
        argv = [arg.format(**values) for arg in self.argv]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{replica_id}.log", "ab") as log_file:
            child = procs.start_group(argv, signal.SIGTERM, stdout=log_file, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
        self.children[child.pid] = child
        _log.info("hybrid process started", replica=replica_id, pid=child.pid, argv=argv)
        return child.pid

    def alive(self, pid: int) -> bool | None:
        if not self.argv:
            return None
        if pid <= 0:
            return False
        child = self.children.get(pid)
        if child is not None:
            return child.poll() is None
        try:  # started by an earlier coordinator: a plain process check (zombies count as dead)
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            return False

    def exit_code(self, pid: int) -> int | None:
        child = self.children.get(pid)
        return child.poll() if child is not None else None

    async def stop(self, pid: int, grace_s: float = 10.0) -> None:
        if pid <= 0 or not self.alive(pid):
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            for _ in range(int(wait_s / 0.05)):
                if not self.alive(pid):
                    self.children.pop(pid, None)
                    return
                await asyncio.sleep(0.05)


def _unavailable(what: str, error: grpc.aio.AioRpcError) -> Unavailable:
    return Unavailable(f"{what}: {error.code().name} {error.details() or ''}".rstrip())


class GrpcReplicaDriver(ReplicaDriver):
    """The real driver: the trainer's and rollout gateway's gRPC services and local hybrid processes."""

    def __init__(self, trainer_channel, rollout_channel, run_id: str, processes: HybridProcesses):
        self.trainer = trainer_pb2_grpc.TrainerStub(trainer_channel)
        self.rollout = rollout_pb2_grpc.RolloutStub(rollout_channel)
        self.run_id, self.processes = run_id, processes

    def _meta(self, request_id: str) -> common_pb2.RequestMeta:
        return common_pb2.RequestMeta(request_id=request_id, run_id=self.run_id)

    async def admit(self, replica_id: str, generation: int) -> None:
        request = trainer_pb2.HybridRequest(meta=self._meta(f"admit-{replica_id}-{generation}"),
                                            replica_id=replica_id, generation=generation)
        try:
            await self.trainer.AdmitHybrid(request, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise _unavailable(f"trainer refused to admit {replica_id}", error) from error

    async def release(self, replica_id: str, generation: int) -> None:
        request = trainer_pb2.HybridRequest(meta=self._meta(f"release-{replica_id}-{generation}"),
                                            replica_id=replica_id, generation=generation)
        try:
            await self.trainer.ReleaseHybrid(request, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:  # never admitted: nothing to release
                raise _unavailable(f"trainer did not release {replica_id}", error) from error

    async def view(self) -> TrainerView:
        try:
            manifest = await self.trainer.GetStepManifest(
                trainer_pb2.StepManifestRequest(run_id=self.run_id, step=0), timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise _unavailable("trainer step manifest", error) from error
        return trainer_view(manifest)

    async def launch(self, replica_id: str, generation: int) -> int:
        # on the event loop's thread, not a worker thread: the parent-death signal follows the thread
        # that started the child (libra/procs.py), and the loop's lives as long as the coordinator
        return self.processes.launch(replica_id, generation)

    def alive(self, replica_id: str, pid: int) -> bool | None:
        return self.processes.alive(pid)

    async def stop(self, replica_id: str, pid: int) -> None:
        await self.processes.stop(pid)

    async def drain_worker(self, worker_id: str, timeout_s: float) -> None:
        request = rollout_pb2.DrainWorkerRequest(meta=self._meta(f"drain-{worker_id}"), worker_id=worker_id,
                                                 timeout_seconds=timeout_s)
        try:
            await self.rollout.DrainWorker(request, timeout=timeout_s + RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:  # already gone (a replay after a restart)
                raise _unavailable(f"rollout did not drain {worker_id}", error) from error

    async def start_workers(self, buckets: list[common_pb2.BucketSpec], request_id: str) -> list[str]:
        request = rollout_pb2.StartWorkersRequest(meta=self._meta(request_id), buckets=buckets)
        try:
            reply = await self.rollout.StartWorkers(request, timeout=600)
        except grpc.aio.AioRpcError as error:
            raise _unavailable("rollout did not start workers", error) from error
        return [w.worker_id for w in reply.workers]
