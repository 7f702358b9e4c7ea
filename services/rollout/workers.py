"""The rollout workers of this gateway: engine processes per bucket, their health and versions.

```
 plan buckets ─▶ WorkerPool.start ─▶ VllmWorkerProcess × replicas ─▶ ready ─▶ register (scheduler, elastic)
 UpdateWeights(v) ─▶ every serving worker loads v between decode steps ─▶ ack (Redis) ─▶ version_of(worker) = v
 monitor: a dead or unhealthy worker is deregistered; its turns are retried elsewhere by the runner
```
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from dataclasses import dataclass, field
from typing import Any

from libra import log as liblog
from libra.errors import NotFound, Unavailable
from libra.plans import Plan
from libra.redis_server import free_port
from libra.services.rollout.config import WorkerConfig
from libra.v1 import common_pb2, rollout_pb2

_log = liblog.get("libra.rollout")


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

    def to_proto(self) -> common_pb2.WorkerInfo:
        return common_pb2.WorkerInfo(worker_id=self.worker_id, bucket=self.bucket, address=self.process.base_url,
                                     tp=self.tp, state=self.state, policy_version=self.version,
                                     outstanding_requests=self.inflight, engine="vllm")


class WorkerPool:
    def __init__(self, config: WorkerConfig, log_dir: pathlib.Path):
        self.config = config
        self.log_dir = log_dir
        self.workers: dict[str, PoolWorker] = {}
        self._next_index = 0

    async def start(self, plan: Plan, model_dir: str, version: int) -> list[PoolWorker]:
        """Launch the plan's workers on `model_dir` (policy `version`) and wait until all serve."""
        from libra.services.rollout.engine_client import EngineClient
        from libra.services.rollout.vllm_worker import VllmWorkerProcess

        started: list[PoolWorker] = []
        for bucket in plan.buckets:
            for _ in range(bucket.replicas):
                index = self._next_index
                self._next_index += 1
                port = self.config.base_port + index if self.config.base_port else free_port()
                process = VllmWorkerProcess(self.config, model_dir, index=index, log_dir=self.log_dir,
                                            port=port, tp=bucket.tp, policy_version=version)
                process.start()
                worker = PoolWorker(f"{bucket.name}-{index}", bucket.name, bucket.tp, process,
                                    EngineClient(process.base_url), version=version)
                self.workers[worker.worker_id] = worker
                started.append(worker)
        _log.info("starting workers", workers=[w.worker_id for w in started], model=model_dir)
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
        return self.get(worker_id).version

    def serving(self) -> list[PoolWorker]:
        return [w for w in self.workers.values() if w.state == common_pb2.WORKER_STATE_SERVING]

    async def generate(self, worker_id: str, prompt_ids: list[int], max_tokens: int, seed: int, sampling: dict,
                       stop_ids: list[int]) -> Any:
        worker = self.workers.get(worker_id)
        if worker is None or worker.state != common_pb2.WORKER_STATE_SERVING:
            # routed to a worker this gateway does not serve (any more): the runner retries elsewhere
            raise Unavailable(f"worker {worker_id!r} is not serving on this gateway")
        worker.inflight += 1
        try:
            return await worker.client.generate(prompt_ids, max_tokens=max_tokens, temperature=sampling["temperature"],
                                                top_p=sampling["top_p"], stop_token_ids=stop_ids, seed=seed)
        finally:
            worker.inflight -= 1
            if worker.inflight == 0:
                worker.drained.set()

    async def update_weights(self, version: int, path: str) -> list[rollout_pb2.WorkerAck]:
        """Load `path` as `version` on every serving worker, concurrently, without draining."""
        async def one(worker: PoolWorker) -> rollout_pb2.WorkerAck:
            started = time.monotonic()
            try:
                await worker.client.load_weights(path, version)
            except Exception as error:  # noqa: BLE001 - reported per worker; the worker is marked unhealthy
                worker.state = common_pb2.WORKER_STATE_UNHEALTHY
                _log.error("weight update failed", worker=worker.worker_id, version=version, error=str(error))
                return rollout_pb2.WorkerAck(worker_id=worker.worker_id, version=worker.version, ok=False,
                                            error=f"{type(error).__name__}: {error}")
            worker.version = version
            return rollout_pb2.WorkerAck(worker_id=worker.worker_id, version=version, ok=True,
                                        seconds=time.monotonic() - started)
        return list(await asyncio.gather(*(one(w) for w in self.serving())))

    async def check_health(self) -> list[PoolWorker]:
        """Mark dead or unresponsive workers unhealthy; return the ones that just failed."""
        failed = []
        for worker in self.serving():
            if not worker.process.alive or not await worker.client.health():
                worker.state = common_pb2.WORKER_STATE_UNHEALTHY
                failed.append(worker)
                _log.error("worker unhealthy", worker=worker.worker_id, alive=worker.process.alive)
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
        worker.state = common_pb2.WORKER_STATE_STOPPED

    async def stop_all(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(w.process.stop) for w in self.workers.values()),
                             return_exceptions=True)
        for worker in self.workers.values():
            await worker.client.close()
            worker.state = common_pb2.WORKER_STATE_STOPPED
