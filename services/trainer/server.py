"""The trainer service: the control surface of the core training process (async GRPO).

Start: Redis → model (create + warm start, or resume from the latest checkpoint) → write the
weights as a new policy version → wait for rollout → deliver it → GRPO steps → reward plot → exit 0.
A fresh run whose backend loads the base model's files unchanged (torch, one rank, weights on disk)
publishes those files as version 1 before it imports torch, and submits the first groups as soon
as rollout serves: the first batch is rolled out while the backend loads.
"""

from __future__ import annotations

import asyncio

from libra import log as liblog
from libra import procs
from libra.config import RunConfig
from libra.errors import FailedPrecondition
from libra.rpc import channel, wait_for_peers
from libra.runtime import Service, owner_key, serve as run_service
from libra.service_base import connect_store
from libra.services.trainer import ranks
from libra.services.trainer.loop import GrpoLoop
from libra.services.trainer.model_state import ModelState, make_backend
from libra.services.trainer.plot import reward_curve
from libra.services.trainer.publisher import WeightPublisher
from libra.services.trainer.servicer import TrainerServicer
from libra.services.trainer.status import TrainerStatus
from libra.v1 import common_pb2, elastic_pb2, elastic_pb2_grpc, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from libra.workloads.base import build_workload

_log = liblog.get("libra.trainer")
P = trainer_pb2
MEMBER_ID = "trainer-0"


class TrainerService(Service):
    name = "trainer"
    drain_s = 30.0
    ready_after_start = False  # health turns SERVING once rollout and elastic answer

    def __init__(self, config: RunConfig, world: int = 1):
        self.config = config
        self.world = world  # ranks the trainer was launched on (ranks.py); rank 0 runs this service
        self.run_id = config.run_id
        self.status = TrainerStatus(config.trainer.steps)
        self.store = None
        self.loop: GrpoLoop | None = None
        self.model: ModelState | None = None
        self.publisher: WeightPublisher | None = None
        self._channels: list = []
        self._resume = asyncio.Event()
        self._resume.set()
        self._step_lock = asyncio.Lock()
        self.elastic = None  # ElasticControl: hybrid replicas (rank 0 of the core)
        self._optimizer_task: asyncio.Task | None = None  # held: the loop keeps only weak references to tasks

    def service_names(self) -> list[str]:
        return [P.DESCRIPTOR.services_by_name["Trainer"].full_name]

    def register(self, server) -> None:
        trainer_pb2_grpc.add_TrainerServicer_to_server(TrainerServicer(self), server)

    def _stub(self, stub_class, service: str):
        chan = channel(self.config.address_of(service), wait_for_ready=True)  # a peer may be restarting
        self._channels.append(chan)
        return stub_class(chan)

    async def start(self) -> None:
        """Serve status at once (phase WAITING_FOR_PEERS/WARMUP); the work happens in run()."""

    async def run(self) -> None:
        try:
            await self._prepare()
            await self.status.set(P.TRAINER_PHASE_TRAINING, "")
            while self.loop.position.step < self.config.trainer.steps:
                await self._resume.wait()
                async with self._step_lock:
                    await self.loop.run_one()
            await self._finish()
        except Exception as error:
            await self.status.set(P.TRAINER_PHASE_FAILED, f"{type(error).__name__}: {error}")
            raise

    async def _prepare(self) -> None:
        WeightPublisher.check(self.config)  # before any work: e.g. weights: colocated on a machine without CUDA
        await self.status.set(P.TRAINER_PHASE_WAITING_FOR_PEERS, "redis")
        self.store = await connect_store(self.config.redis.url, self.run_id)
        await self.status.set(P.TRAINER_PHASE_WARMUP, "")
        model = self.model = ModelState(self.config, None, self.store)
        # The base model first (a copy from the model cache, no torch needed): rollout's workers start on
        # it while this process imports torch and builds its backend (~1 CPU-second on a small machine).
        await model.prepare_base(lambda detail: self.status.set(detail=detail))
        rollout = self._stub(rollout_pb2_grpc.RolloutStub, "rollout")
        workload = build_workload(self.config.workload)
        publisher = self.publisher = WeightPublisher(self.config, None, self.store, rollout)
        loop = GrpoLoop(self.config, self.store, rollout, model, self.status, workload.num_prompts, publisher)
        # A fresh run whose backend loads the base model's weights as they are: those files are
        # version 1 already, so it is published now and the first batch is rolled out while this
        # process imports torch and loads them (the weights in memory are the same numbers).
        early = await publisher.first_version_from(model.base_dir) if self._base_is_first_version(model) else None
        feeding = None
        if early is not None:
            loop.position.version = early
            feeding = asyncio.get_running_loop().create_task(self._feed_first_batch(loop))
        try:
            await self._load_and_deliver(model, publisher, loop, early, feeding)
        except BaseException:
            if feeding is not None:
                feeding.cancel()
            raise

    async def _load_and_deliver(self, model: ModelState, publisher: WeightPublisher, loop: GrpoLoop,
                                early: int | None, feeding: asyncio.Task | None) -> None:
        """The rest of the start: the backend loads the base model (and resumes), the weights in
        memory become a version (unless `early` already made the base model's files version 1),
        rollout gets it, health turns SERVING."""
        backend = await asyncio.to_thread(make_backend, self.config)
        if self.world > 1:  # the other ranks follow every collective call (ranks.py)
            backend = ranks.LeaderBackend(backend, await asyncio.to_thread(ranks.join), self.world)
        model.backend = publisher.backend = backend
        position = await model.load()
        if early is not None:  # nothing to resume (`_base_is_first_version`): the position is the early one
            position = loop.position
        self.loop = loop
        self.loop.position = position
        if self.world == 1:  # hybrids join single-rank trainers (LeaderBackend.hybrid_refusal says why)
            self.elastic = self.loop.elastic = await self._elastic(model.backend)
        for record in await self.store.step_records(1):
            await self.status.add_record(P.StepRecord.FromString(record))
        if early is None:
            # The weights in memory become the next policy version, on disk: rollout starts (or reloads) on them.
            version = await publisher.first_version(position.version)  # never one Redis, the checkpoint or disk had
            await self.store.raise_version(version - 1)
            await publisher.record(version)
            position.version = version
        self._prepare_optimizer(model.backend)
        await self.status.set(P.TRAINER_PHASE_WAITING_FOR_PEERS, "rollout workers, elastic coordinator")
        if feeding is not None:
            await feeding
        await wait_for_peers({"rollout": self.config.address_of("rollout"),
                              "elastic": self.config.address_of("elastic")})
        await self._register_member()
        await publisher.deliver(position.version)
        await self.set_health(True)

    def _base_is_first_version(self, model: ModelState) -> bool:
        """Whether the base model's files are exactly what version 1 would be: a run with nothing to
        resume (no checkpoint; `first_version_from` checks Redis and the weights directory), one rank,
        the torch backend (it loads the files into float32 parameters as they are: no conversion, no
        adapters) and weights on disk (no group to send them over before the backend holds them)."""
        trainer = self.config.trainer
        return (self.world == 1 and trainer.backend.type == "torch" and trainer.lora is None
                and self.config.weights.type == "disk" and model.latest_checkpoint() is None)

    async def _feed_first_batch(self, loop: GrpoLoop) -> None:
        """Submit the first groups as soon as rollout serves (on version 1: the base model's files)."""
        await wait_for_peers({"rollout": self.config.address_of("rollout")})
        await loop.submit()
        _log.info("first groups submitted while the backend loads", version=loop.position.version,
                  groups=loop.position.data_position)

    def _prepare_optimizer(self, backend) -> None:
        """Make the backend's optimizer in a thread while rollout starts on the version just written:
        torch.optim's first optimizer imports torch._dynamo (~1.4 CPU-seconds), which the first batch
        need not wait for. The first step waits for it if it is not done (the backend's lock); a
        failure here is made again, and raised, by that step."""
        prepare = getattr(backend, "prepare_optimizer", None)
        if prepare is None:
            return

        def failed(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                _log.warning("making the optimizer ahead of the first step failed; the step makes it",
                             error=str(task.exception()))

        self._optimizer_task = asyncio.get_running_loop().create_task(asyncio.to_thread(prepare))
        self._optimizer_task.add_done_callback(failed)

    async def _elastic(self, backend):
        """The side-channel endpoint of this (single) core rank and the membership kept in Redis."""
        from libra.services.trainer.elastic.control import ElasticControl
        from libra.services.trainer.elastic.core_hooks import ElasticCore

        host = self.config.address_of("trainer").rsplit(":", 1)[0] or "127.0.0.1"  # where hybrids reach us
        settings = self.config.trainer.elastic
        core = ElasticCore(backend, snapshot_root=str(self.config.run_path / "snapshots"), host=host,
                           grad_deadline_s=settings.grad_deadline_s, join_timeout_s=settings.join_timeout_s,
                           snapshot_shards=settings.snapshot_shards, max_catch_up_steps=settings.max_catch_up_steps,
                           catch_up_patience=settings.catch_up_patience, channel=settings.channel)
        backend.gradient_hook = core
        control = ElasticControl(core, self.store)
        await control.restore()
        return control

    def elastic_control(self):
        if self.world > 1:
            raise FailedPrecondition(self.model.backend.hybrid_refusal() if self.model is not None else
                                     f"the trainer runs on {self.world} ranks; hybrids join a one-rank trainer")
        if self.elastic is None:
            raise FailedPrecondition("the trainer has no model yet (still warming up); retry AdmitHybrid shortly")
        return self.elastic

    async def _register_member(self) -> None:
        stub = self._stub(elastic_pb2_grpc.ElasticCoordinatorStub, "elastic")
        member = elastic_pb2.Member(member_id=MEMBER_ID, role=elastic_pb2.ROLE_TRAINING,
                                    address=self.config.address_of("trainer"),
                                    gpus=self.config.planner.training.gpus)
        meta = common_pb2.RequestMeta(request_id=f"register-{MEMBER_ID}-{self.loop.position.version}",
                                      run_id=self.run_id)
        await stub.RegisterMember(elastic_pb2.RegisterMemberRequest(meta=meta, member=member), timeout=10)

    async def _finish(self) -> None:
        records = [self.status.records[s] for s in sorted(self.status.records)]
        if records:
            out = reward_curve(records, self.config.run_path / "reward.png", f"Libra run {self.run_id}")
            _log.info("reward curve written", path=str(out))
        await self.status.set(P.TRAINER_PHASE_DONE, "")
        await asyncio.sleep(1.0)  # let watchers read the last records before the server goes away

    async def pause(self, paused: bool) -> bool:
        changed = self._resume.is_set() == paused
        (self._resume.clear if paused else self._resume.set)()
        if self.status.phase in (P.TRAINER_PHASE_TRAINING, P.TRAINER_PHASE_PAUSED):
            await self.status.set(P.TRAINER_PHASE_PAUSED if paused else P.TRAINER_PHASE_TRAINING)
        return changed

    async def save_checkpoint(self) -> P.CheckpointInfo:
        if self.loop is None:
            raise FailedPrecondition("the trainer has no model yet (still warming up)")
        async with self._step_lock:
            path = await self.loop.checkpoint()
        return P.CheckpointInfo(step=self.loop.position.step, policy_version=self.loop.position.version, path=str(path))

    async def manifest(self, step: int) -> P.StepManifest:
        """The frozen membership of `step` (0: the latest), with every hybrid's state."""
        if self.world > 1:
            return P.StepManifest(step=self.loop.position.step if self.loop else 0)  # no hybrids, ever
        if self.elastic is None:
            raise FailedPrecondition("the trainer has no model yet (still warming up)")
        return await self.elastic.manifest_proto(step)

    async def drain(self) -> None:
        """Let a step in progress commit, then checkpoint what is not yet (so a restart loses nothing)."""
        if self.model is not None:
            self.model.stopping.set()
        async with self._step_lock:
            if self.loop is not None and self.loop.position.used_entries:
                await self.loop.checkpoint()

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self.model is not None:
            if isinstance(self.model.backend, ranks.LeaderBackend):
                await asyncio.to_thread(self.model.backend.stop)
        if self.elastic is not None:
            self.elastic.core.close()
        for chan in self._channels:
            await chan.close()
        if self.store is not None:
            await self.store.close()


def serve(config: RunConfig, port: int | None = None) -> int:
    """Serve the trainer; launched on several ranks (torchrun, srun), ranks other than 0 follow."""
    rank, world = ranks.launched()
    if world == 1 and config.trainer.ranks > 1:  # start the ranks here (ranks.launch), each serves as below
        procs.adopt(owner_key("trainer", config.run_id, config.run_path))  # a dead launcher's ranks first
        return ranks.launch(config.trainer.ranks)
    ranks.check(config, world)
    if rank != 0:
        group = ranks.join()
        _log.info("following rank 0", rank=rank, world=world)
        ranks.follow(make_backend(config), group)
        ranks.leave()
        return 0
    code = run_service(TrainerService(config, world), port if port is not None else config.port_of("trainer"),
                       config.metrics_port_of("trainer"))
    if world > 1 and code == 0:
        ranks.leave()  # after the followers' release (TrainerService.close)
    return code
