"""The rollout workers of this gateway: engine processes per bucket, their health and versions.

```
 plan buckets ─▶ WorkerPool.start ─▶ VllmWorkerProcess | HfWorkerProcess × replicas ─▶ ready ─▶ register
 UpdateWeights(v) ─▶ weight_delivery.py (disk, or the weights group) ─▶ ack in the reply ─▶ version_of(worker) = v
 monitor: a dead or unhealthy worker is deregistered; its turns are retried elsewhere by the runner
```
The engine comes from rollout.worker.engine: vllm (TP from the plan's bucket) or hf (TP 1 only);
where each worker runs, from rollout.worker.launch: local, or a Slurm step on a rollout node (launch.py).
A worker never serves older weights than `version_of` says: a worker that cannot load a version
is marked unhealthy (and deregistered), never left serving the previous one as if it were new.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from libra import log as liblog
from libra import procs
from libra.errors import NotFound, Unavailable
from libra.plans import Plan
from libra.redis_server import free_port
from libra.services.rollout.config import WorkerConfig
from libra.services.rollout.launch import LocalLauncher, build_launcher
from libra.v1 import common_pb2
from libra.zygote import Zygote, ZygoteError

_log = liblog.get("libra.rollout")
HF_ENGINE_MODULES = ["torch", "safetensors.torch", "aiohttp.web", "libra.llama_forward",
                     "libra.services.rollout.engines.hf_server"]
"""What an hf worker imports before it serves: its zygote imports it once."""


def _hf_worker_class() -> type:
    """`HfWorkerProcess`, built lazily on `VllmWorkerProcess` (same start, readiness and stop)."""
    from libra.services.rollout.engines.vllm_worker import VllmWorkerProcess

    class HfWorkerProcess(VllmWorkerProcess):
        """One transformers-based engine server (engines/hf_server.py serving engines/hf_engine.py); TP 1 only."""

        engine = "hf"

        def __init__(self, config: WorkerConfig, model_dir: Any, index: int, log_dir: Any,
                     port: int | None = None, tp: int = 1, policy_version: int = 0, event_loop: str = "auto"):
            if tp != 1:
                raise ValueError(f"rollout.worker.engine hf runs TP 1 only, the plan asks TP {tp}; "
                                 f"use engine: vllm for TP > 1 buckets")
            super().__init__(config, model_dir, index, log_dir, port, tp, policy_version, event_loop)

        def start_forked(self, zygote: Any) -> "HfWorkerProcess":
            """`start`, forked from `zygote` (libra/zygote.py) instead of a fresh interpreter: the same
            checks, command, environment, log and session, SIGTERM when the zygote dies. Blocks until
            the zygote forks it (its first child waits for its imports), so callers run it off their
            event loop; ZygoteError when it cannot (then `start` on the caller's thread)."""
            self.check_startable()
            with open(self.log_path, "ab") as log:
                self.process = zygote.spawn(self.command(), self.environment(), log, signal.SIGTERM)
            return self

        def command(self) -> list[str]:
            c = self.config
            return [sys.executable, "-m", "libra.services.rollout.engines.hf_server", "--model", str(self.model_dir),
                    "--host", c.host, "--port", str(self.port), "--device", c.engine.device, "--dtype", c.dtype,
                    "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
                    "--logprobs-mode", c.logprobs_mode, "--policy-version", str(self.policy_version),
                    "--threads", str(c.cpu_threads), "--prefill-ratio", str(c.engine.prefill_ratio),
                    "--prefill-wait-steps", str(c.engine.prefill_wait_steps), "--forward", c.engine.forward,
                    "--prefix-cache-mib", str(c.engine.prefix_cache_mib), "--event-loop", self.event_loop,
                    *c.extra_args]

    return HfWorkerProcess


def worker_process_class(engine: str) -> type:
    """The launcher of rollout.worker.engine `engine`."""
    if engine == "vllm":
        from libra.services.rollout.engines.vllm_worker import VllmWorkerProcess

        return VllmWorkerProcess
    if engine == "hf":
        return _hf_worker_class()
    raise ValueError(f"rollout.worker.engine must be vllm or hf, got {engine!r}")


@dataclass
class PoolWorker:
    worker_id: str
    bucket: str
    tp: int
    process: Any
    client: Any
    version: int = 0
    state: int = common_pb2.WORKER_STATE_STARTING
    inflight: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    reported: bool = False  # its failure was returned by take_failed (the gateway deregistered it)
    missed: int = 0  # a version it could not load (0: none): unhealthy until a later one reaches it
    area: float = 0.0  # integral of inflight over time (request-seconds), up to `area_at`
    held: float = 0.0  # seconds with a request in flight, up to `area_at`
    area_at: float = field(default_factory=time.monotonic)

    def batch_area(self) -> float:
        """Request-seconds in flight on this worker so far: a request's mean batch is the difference
        over its span, divided by its seconds."""
        now = time.monotonic()
        self.area += self.inflight * (now - self.area_at)
        if self.inflight:
            self.held += now - self.area_at
        self.area_at = now
        return self.area

    def busy_seconds(self) -> float:
        """Seconds this worker has had a request in flight so far (its busy fraction is the
        difference over an interval, divided by its seconds: exact, not sampled)."""
        self.batch_area()
        return self.held

    def to_proto(self) -> common_pb2.WorkerInfo:
        return common_pb2.WorkerInfo(worker_id=self.worker_id, bucket=self.bucket, address=self.process.base_url,
                                     tp=self.tp, state=self.state, policy_version=self.version,
                                     outstanding_requests=self.inflight, engine=self.process.engine)


class WorkerPool:
    def __init__(self, config: WorkerConfig, log_dir: pathlib.Path, event_loop: str = "auto"):
        self.config = config
        self.event_loop = event_loop  # the run's `event_loop`, which hf workers run too
        self.log_dir = log_dir
        self.workers: dict[str, PoolWorker] = {}
        self._next_index = 0
        self.launcher = build_launcher(config.launch)  # where workers run: here, or Slurm steps (launch.py)
        self.zygote: Zygote | None = None  # what hf workers on CPU fork from (rollout.worker.engine.zygote)

    def prepare(self) -> None:
        """Start the engine zygote now, if workers will fork from one, so that its imports overlap
        whatever comes before the first workers (the trainer's warm start): on the event loop's
        thread, whose life the zygote then shares."""
        if self._forks():
            process_class = worker_process_class(self.config.engine.type)
            template = process_class(self.config, ".", 0, self.log_dir, port=0, event_loop=self.event_loop)
            self._zygote_for(template)

    def _forks(self) -> bool:
        """Whether workers fork from a zygote: hf on CPU, launched here, `zygote: true`, setpriv."""
        engine = self.config.engine
        return (engine.type == "hf" and engine.zygote and engine.device == "cpu" and procs.PARENT_DEATH
                and isinstance(self.launcher, LocalLauncher))

    def _zygote_for(self, process: Any) -> Zygote | None:
        """The engine zygote (started with `process`'s environment on the calling thread, whose life
        it then shares: the event loop's), or None where workers start as fresh interpreters: not
        `_forks`, or a zygote that refused."""
        if not self._forks() or (self.zygote is not None and self.zygote.refusal is not None):
            return None
        if self.zygote is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.zygote = Zygote(HF_ENGINE_MODULES, process.environment(), signal.SIGTERM,
                                 self.log_dir / "zygote.log")
        return self.zygote

    async def _start_process(self, process: Any) -> None:
        zygote = self._zygote_for(process)
        if zygote is not None:
            try:
                await asyncio.to_thread(process.start_forked, zygote)
                return
            except ZygoteError as error:
                _log.warning("engine zygote cannot fork; this worker starts as a fresh interpreter",
                             worker=process.index, why=str(error))
        process.start()  # on the event loop's thread: the worker dies with it

    async def start(self, plan: Plan, model_dir: str, version: int) -> list[PoolWorker]:
        """Launch the plan's workers on `model_dir` (policy `version`) and wait until all serve."""
        from libra.services.rollout.engines.client import EngineClient

        launcher = worker_process_class(self.config.engine.type)
        started: list[PoolWorker] = []
        for bucket in plan.buckets:
            for _ in range(bucket.replicas):
                index = self._next_index
                self._next_index += 1
                port = self.config.base_port + index if self.config.base_port else free_port()
                worker_id = f"{bucket.name}-{index}"
                process = self.launcher.create(launcher, self.config, worker_id, model_dir=model_dir, index=index,
                                               log_dir=self.log_dir, port=port, tp=bucket.tp, policy_version=version,
                                               event_loop=self.event_loop)
                await self._start_process(process)
                worker = PoolWorker(worker_id, bucket.name, bucket.tp, process,
                                    EngineClient(process.base_url), version=version)
                self.workers[worker.worker_id] = worker
                started.append(worker)
        _log.info("starting workers", workers=[w.worker_id for w in started], at=[w.process.base_url for w in started],
                  model=model_dir)
        await asyncio.gather(*(w.process.wait_ready(self.config.startup_timeout_s) for w in started))
        for worker in started:
            worker.state = common_pb2.WORKER_STATE_SERVING
        return started

    def get(self, worker_id: str) -> PoolWorker:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise NotFound(f"unknown worker {worker_id!r}")
        return worker

    def version_of(self, worker_id: str) -> int:
        """The version worker `worker_id` serves; Unavailable for a worker this gateway does not run
        (the scheduler named one of an earlier gateway): the runner retries the turn elsewhere."""
        worker = self.workers.get(worker_id)
        if worker is None:
            raise Unavailable(f"worker {worker_id!r} is not one of this gateway's workers")
        return worker.version

    def serving(self) -> list[PoolWorker]:
        return [w for w in self.workers.values() if w.state == common_pb2.WORKER_STATE_SERVING]

    async def generate(self, worker_id: str, prompt_ids: list[int], max_tokens: int, seed: int, sampling: dict,
                       stop_ids: list[int]) -> Any:
        worker = self.workers.get(worker_id)
        if worker is None or worker.state != common_pb2.WORKER_STATE_SERVING:
            # routed to a worker this gateway does not serve (any more): the runner retries elsewhere
            raise Unavailable(f"worker {worker_id!r} is not serving on this gateway")
        area, started = worker.batch_area(), time.monotonic()
        worker.inflight += 1
        try:
            generation = await worker.client.generate(prompt_ids, max_tokens=max_tokens,
                                                      temperature=sampling["temperature"], top_p=sampling["top_p"],
                                                      stop_token_ids=stop_ids, seed=seed)
            span = time.monotonic() - started
            batch = (worker.batch_area() - area) / span if span > 0 else float(worker.inflight)
            return dataclasses.replace(generation, batch=batch)
        finally:
            worker.batch_area()
            worker.inflight -= 1
            if worker.inflight == 0:
                worker.drained.set()

    async def check_health(self) -> list[PoolWorker]:
        """Mark dead or unresponsive workers unhealthy; return `take_failed()`."""
        for worker in self.serving():
            if not worker.process.alive or not await worker.client.health():
                worker.state = common_pb2.WORKER_STATE_UNHEALTHY
                _log.error("worker unhealthy", worker=worker.worker_id, alive=worker.process.alive)
                if not worker.process.alive:  # its node's slots are free again (srun launch)
                    self.launcher.release(worker.worker_id)
        return self.take_failed()

    def take_failed(self) -> list[PoolWorker]:
        """The workers that became unhealthy since the last call (found by check_health, or by a
        weight update they missed), each once: the gateway takes them out of routing."""
        failed = [w for w in self.workers.values() if w.state == common_pb2.WORKER_STATE_UNHEALTHY and not w.reported]
        for worker in failed:
            worker.reported = True
        return failed

    async def drain(self, worker_id: str, timeout_s: float) -> None:
        """Stop routing to the worker (caller deregisters it), wait for its turns, stop it."""
        worker = self.get(worker_id)
        worker.state = common_pb2.WORKER_STATE_DRAINING
        if worker.inflight:
            worker.drained.clear()
            try:
                await asyncio.wait_for(worker.drained.wait(), timeout_s)
            except asyncio.TimeoutError:
                _log.warning("drain timed out; in-flight turns will be retried elsewhere", worker=worker_id)
        await asyncio.to_thread(worker.process.stop)
        await worker.client.close()  # its connections go with it (a later call would open a new session)
        self.launcher.release(worker_id)
        worker.state = common_pb2.WORKER_STATE_STOPPED

    async def stop_all(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(w.process.stop) for w in self.workers.values()),
                             return_exceptions=True)
        if self.zygote is not None:
            self.zygote.close()
        for worker in self.workers.values():
            await worker.client.close()
            self.launcher.release(worker.worker_id)
            worker.state = common_pb2.WORKER_STATE_STOPPED


async def collective_rpc(client: Any, method: str, args: list, timeout: float) -> list:
    """Call `method` on every rank of a worker through its /collective_rpc endpoint (both engines)."""
    answer = await client._post("/collective_rpc", {"method": method, "args": args, "timeout": timeout},
                                timeout=timeout + 30)
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise Unavailable(f"{client.base_url} answered {method} with {answer!r}")
    return results
