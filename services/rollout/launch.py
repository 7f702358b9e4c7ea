"""Where a rollout worker's process runs: on the gateway's host, or as a Slurm step on a rollout node.

```
 WorkerPool.start ─▶ launcher.create(engine launcher class, config, index, port, tp, …)
   local: VllmWorkerProcess | HfWorkerProcess              (a child of the gateway, as before)
   srun:  Placement.take(worker, tp) ─▶ node ─▶ SrunWorker ─▶ srun --jobid J --nodelist NODE … ENGINE COMMAND
            the engine listens on the node's address; the gateway reaches it there over HTTP
 stop / dead worker ─▶ launcher.release(worker): its slots on the node are free again
```
An srun worker is the engine launcher's own command and environment, started through `srun`
(rollout.worker.launch: srun, written by deploy/slurm/libra.sbatch). The `srun` client is the
gateway's child (it dies with the gateway: SIGTERM, and srun then kills the step) and stands for
the worker: the worker is alive while its step runs, stopping it ends the step (Slurm kills every
process of the step, so nothing of the engine is left on the node). GPUs: a GPU worker's step
asks for TP × gpus_per_rank GPUs and runs exclusive, so Slurm gives each worker its own GPUs
(CUDA_VISIBLE_DEVICES); CPU workers share the node's CPUs (--overlap). Must not know: buckets,
weights, routing.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from libra import procs
from libra.services.rollout.config import LocalLaunch, SrunLaunch, WorkerConfig
from libra.services.rollout.placement import NodeSlots, Placement

KEEP_SLURM = frozenset({"SLURM_CONF"})
"""Slurm variables a worker step inherits from the gateway; the rest describe the gateway's own step
(its task count, CPUs, GPUs) and would leak into the worker's step."""


class LocalLauncher:
    """Workers on the gateway's host: the engine launchers as they are."""

    def create(self, engine: type, config: WorkerConfig, key: str, **launch: Any) -> Any:
        return engine(config, **launch)

    def release(self, key: str) -> None:
        pass


def srun_command(launch: SrunLaunch, job_id: str, node: str, key: str, tp: int) -> list[str]:
    """The srun prefix of one worker's step (module docstring)."""
    argv = ["srun", f"--jobid={job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            f"--job-name=libra-worker-{key}", "--kill-on-bad-exit=1"]
    if launch.gpus_per_rank:
        argv += ["--exact", f"--gres=gpu:{tp * launch.gpus_per_rank}", f"--cpus-per-task={tp * launch.cpus_per_rank}",
                 "--mem=0"]
    else:
        argv += ["--overlap"]
    return argv + list(launch.srun_args)


class SrunWorker:
    """An engine launcher (VllmWorkerProcess, HfWorkerProcess) whose process is an srun step on
    `node`: start() runs its command through `srun`; `process` is the srun client, so the engine
    launcher's alive, wait_ready and stop work unchanged. Everything else is the engine launcher's."""

    def __init__(self, engine: Any, prefix: list[str], node: NodeSlots):
        self.__dict__.update(_engine=engine, prefix=prefix, node=node)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    def command(self) -> list[str]:
        return [*self.prefix, *self._engine.command()]

    def environment(self) -> dict[str, str]:
        env = self._engine.environment()
        return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k in KEEP_SLURM}

    def start(self) -> "SrunWorker":
        """Start the step (the port is checked by the engine itself, on its node: a taken one fails
        its start, and wait_ready reports it with the log's tail)."""
        engine = self._engine
        if engine.alive:
            raise ValueError(f"worker {engine.index} is already running (srun pid {engine.process.pid})")
        if not (engine.model_dir / "config.json").is_file():
            raise ValueError(f"{engine.model_dir} is not a model directory (no config.json)")
        engine.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(engine.log_path, "ab") as log:
            engine.process = procs.start_group(self.command(), signal.SIGTERM, env=self.environment(),
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        return self


class SrunLauncher:
    """Workers as Slurm steps on the rollout nodes (module docstring)."""

    def __init__(self, launch: SrunLaunch, job_id: str | None = None):
        job_id = job_id if job_id is not None else (launch.job_id or os.environ.get("SLURM_JOB_ID", ""))
        if not job_id:
            raise ValueError("rollout.worker.launch: srun needs a Slurm job: run the gateway inside one "
                             "(deploy/slurm/libra.sbatch) or set rollout.worker.launch.job_id")
        self.launch, self.job_id = launch, job_id
        self.placement = Placement([NodeSlots(n.name, n.address or n.name, n.slots) for n in launch.nodes])

    def create(self, engine: type, config: WorkerConfig, key: str, **launch: Any) -> SrunWorker:
        node = self.placement.take(key, launch.get("tp", 1))
        try:
            process = engine(config.model_copy(update={"host": node.address}), **launch)
        except BaseException:
            self.placement.release(key)
            raise
        return SrunWorker(process, srun_command(self.launch, self.job_id, node.name, key, launch.get("tp", 1)), node)

    def release(self, key: str) -> None:
        self.placement.release(key)


def build_launcher(launch: LocalLaunch | SrunLaunch) -> LocalLauncher | SrunLauncher:
    """The launcher of rollout.worker.launch."""
    return SrunLauncher(launch) if launch.type == "srun" else LocalLauncher()
