"""The trainer service on several ranks (torchrun, srun): rank 0 serves, every other rank follows.

The Megatron backend trains with TP × PP × DP ranks, and every one of its calls that touches the
model is collective: load, checkpoint save/load, train_step, log-probs, the HF export for weights.
The service (gRPC, Redis, the GRPO loop) runs on global rank 0 only; there the backend is wrapped
in `LeaderBackend`, which announces each collective call — its name and arguments, the whole batch
included — to the other ranks over a gloo group of its own, then makes it. The other ranks run
`follow`: receive a call, make the same call on their backend, until `stop`. Every rank thus makes
the same collective calls in the same order (a lock keeps the leader's announce-and-call pairs
whole). `train_step` gets the whole batch on every rank and each trains its data-parallel shard
(whole GRPO groups, contiguous); the ranks of one model-parallel group get the same shard.

Launch: with `trainer.ranks: N`, `libra serve trainer` starts the N ranks itself on its node
(`launch`: torchrun's environment, signals passed on; each rank gets SIGTERM if the launcher dies,
even by SIGKILL, and a restarted launcher first stops what its predecessor left: libra/procs.py),
so `libra up` and Compose need nothing else. Under torchrun (RANK/WORLD_SIZE set) or as a task
of an srun step of several tasks, on one node or many, it is one rank, and the launcher's world
must equal `trainer.ranks`. An srun task takes its rank from Slurm (`srun_environment`: SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID become
torchrun's RANK, WORLD_SIZE, LOCAL_RANK) and meets the others at MASTER_ADDR:MASTER_PORT, which
the step's environment carries (deploy/slurm/libra.sbatch: the trainer's first node, a port of
the job), so the ranks' torch.distributed rendezvous works across nodes:

    srun --nodes=2 --ntasks-per-node=8 libra serve trainer     MASTER_ADDR=<first node>, MASTER_PORT
      node A: tasks 0-7  (rank 0 serves; LOCAL_RANK 0-7 pick the node's GPUs)
      node B: tasks 8-15 (follow rank 0's calls over the gloo group)

Elastic hybrid replicas join single-rank trainers only: a multi-rank trainer refuses them with the
reason. A follower whose leader dies sees its next receive fail and exits non-zero; a rank that
fails makes `launch` stop the others (under srun: --kill-on-bad-exit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Mapping

from libra import log as liblog
from libra import procs as libra_procs
from libra.errors import ConfigError
from libra.services.trainer.backend import TrainBatch

_log = liblog.get("libra.trainer.ranks")
COLLECTIVE = frozenset({"load", "load_checkpoint", "train_step", "compute_logprobs", "save_weights",
                        "hf_named_tensors", "hf_state_dict", "save_checkpoint"})
STOP = "stop"


def launched() -> tuple[int, int]:
    """(global rank, world size) as the launcher set them: torchrun's RANK/WORLD_SIZE, or those of a
    task of an srun step of several tasks (adopted into this process's environment, so that
    torch.distributed and Megatron read them); (0, 1) for a plain process or a one-task step."""
    if "RANK" not in os.environ and int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        os.environ.update(srun_environment(os.environ))
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def srun_environment(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for a task of an srun step (module docstring); MASTER_ADDR and
    MASTER_PORT must be in `env`: Slurm does not choose a rendezvous."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise ConfigError(f"the trainer runs as {env.get('SLURM_STEP_NUM_TASKS')} srun tasks but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: export MASTER_ADDR=<address of the step's "
                          f"first node> MASTER_PORT=<a free port> for the step (deploy/slurm/libra.sbatch does)")
    node = int(env.get("SLURM_NODEID", "0"))
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "LOCAL_WORLD_SIZE": str(tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", "1"), node))}


def tasks_on_node(spec: str, node: int) -> int:
    """The task count of the step's `node`-th node, from Slurm's compressed list ("8(x2),4" → 8, 8, 4)."""
    counts: list[int] = []
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    if not 0 <= node < len(counts):
        raise ConfigError(f"SLURM_NODEID={node} is outside SLURM_STEP_TASKS_PER_NODE={spec!r}")
    return counts[node]


def launch(count: int, grace_s: float = 45.0) -> int:
    """Run this very command as `count` ranks on this node and wait for them.

    SIGTERM/SIGINT go to every rank (the followers wait for the leader's stop, so its drain can
    still checkpoint). The exit status is rank 0's when all end; when one rank fails first, the
    others get SIGTERM, then SIGKILL after `grace_s`, and its status is returned."""
    from libra.redis_server import free_port

    port = free_port()
    procs = []
    for rank in range(count):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(count), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(count), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        # SIGTERM when the launcher dies, even by SIGKILL (libra/procs.py): rank 0 drains, the others
        # follow it; the ranks stay in the launcher's process group, so stopping that group stops them.
        argv = libra_procs.with_parent_death_signal([sys.executable, "-m", "libra.cli", *sys.argv[1:]], signal.SIGTERM)
        procs.append(subprocess.Popen(argv, env=env))
    _log.info("trainer ranks started", ranks=count, pids=[p.pid for p in procs])

    def forward(number: int, frame: Any) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(number)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failed = None
    while any(p.poll() is None for p in procs) and failed is None:
        failed = next((p for p in procs if p.poll() not in (None, 0)), None)
        time.sleep(0.2)
    if failed is not None:
        _log.warning("a trainer rank failed; stopping the others", rank=procs.index(failed), code=failed.returncode)
        forward(signal.SIGTERM, None)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return failed.returncode
    return procs[0].returncode


def check(config: Any, world: int) -> None:
    """The launcher's world must be the config's `trainer.ranks` (which also checks the backend and
    layout); a mismatch fails at start, naming the field and the fix."""
    if world != config.trainer.ranks:
        raise ValueError(f"the trainer was launched on {world} rank(s), but trainer.ranks={config.trainer.ranks}: set "
                         f"trainer.ranks={world} (with trainer.backend: megatron when > 1) or launch "
                         f"{config.trainer.ranks} rank(s)")


def join() -> Any:
    """Join torch.distributed from the launcher's environment (NCCL where CUDA is, as the Megatron
    backend chooses, else gloo) and return the gloo group the leader announces calls over.
    Collective: every rank calls it once, before its backend loads."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.new_group(backend="gloo")


def leave() -> None:
    """Tear down this rank's process groups (Megatron's, then torch.distributed's) before the
    interpreter exits. Without it gloo's worker threads outlive finalization and the process may
    abort ("terminate called without an active exception", SIGABRT) after a clean stop, as a
    follower did in CI, and as bare two-rank gloo processes that skip it here often do. Local on
    every rank (no collective), so ranks may leave in any order; call it only after a clean stop (a
    rank that failed exits as it is)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps  # several ranks run the Megatron backend (`check`)

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def data_parallel_shard(batch: TrainBatch, group_size: int) -> TrainBatch:
    """This rank's share of whole GRPO groups, contiguous, as even as the group count allows."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if dp_size == 1:
        return batch
    sequences = batch.sequences
    if len(sequences) % group_size:
        raise ValueError(f"a batch of {len(sequences)} sequences is not whole groups of {group_size}")
    groups = len(sequences) // group_size
    low, high = (dp_rank * groups) // dp_size, ((dp_rank + 1) * groups) // dp_size
    return TrainBatch(sequences[low * group_size:high * group_size])


def _call(backend: Any, name: str, args: tuple) -> Any:
    if name == "train_step":
        batch, config = args
        return backend.train_step(data_parallel_shard(batch, config.group_size), config)
    return getattr(backend, name)(*args)


def _announce(group: Any, message: tuple[str, tuple] | None) -> tuple[str, tuple]:
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class LeaderBackend:
    """Global rank 0's backend when the trainer runs several ranks (module docstring)."""

    def __init__(self, backend: Any, group: Any, world: int):
        self.__dict__.update(_backend=backend, _group=group, _world=world, _lock=threading.Lock(), _stopped=False)

    def __getattr__(self, name: str) -> Any:
        if name in COLLECTIVE:
            return lambda *args: self._collective(name, args)
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._backend, name, value)

    def _collective(self, name: str, args: tuple) -> Any:
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"the trainer's ranks were stopped; {name} cannot run")
            _announce(self._group, (name, args))
            return _call(self._backend, name, args)

    def hybrid_refusal(self) -> str:
        return (f"the trainer runs on {self._world} ranks; elastic hybrid replicas join a trainer launched "
                "on one rank")

    def stop(self) -> None:
        """Release the followers (they return from `follow`). Idempotent; a follower already gone
        is logged, not raised (the service is closing either way)."""
        with self._lock:
            if not self._stopped:
                self.__dict__["_stopped"] = True
                try:
                    _announce(self._group, (STOP, ()))
                except RuntimeError as error:
                    _log.warning("followers gone before the stop", error=str(error)[:200])


def follow(backend: Any, group: Any) -> int:
    """A follower rank's life: make every call the leader announces, until `stop`. Returns the count.

    SIGTERM and SIGINT are ignored here: the launcher signals every rank at once, and the leader's
    drain (a last checkpoint) still needs this rank; the leader's `stop` ends it, and a leader that
    died ends it with the error of the next receive."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, frame: _log.info("signal: waiting for the leader's stop", signal=number))
    calls = 0
    while True:
        name, args = _announce(group, None)
        if name == STOP:
            _log.info("released by the leader", calls=calls)
            return calls
        _call(backend, name, args)
        calls += 1
