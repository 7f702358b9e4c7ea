"""The trainer's model on disk: creation and warm start, resume, weight publication, checkpoints.

Layout under run_dir:
    model/base/          the created (tiny) model after the supervised warm start
    weights/v{N}/        published weight set of policy version N (HF format, what workers load)
    checkpoints/step{N}.pt   model + optimizer + RNG + trainer position (atomic writes)

A checkpoint also lists the completed-stream entries that its steps used; they are acked only
after the checkpoint is on disk, so a trainer that dies between two checkpoints re-trains on
exactly the entries its lost steps had used (and a restart acks the ones a checkpoint covers).
"""

from __future__ import annotations

import asyncio
import pathlib
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from libra import log as liblog
from libra.config import RunConfig
from libra.errors import FailedPrecondition
from libra.services.trainer.backend import TrainBackend
from libra.workloads.base import build_workload

_log = liblog.get("libra.trainer")
CHECKPOINT_RE = re.compile(r"^step(\d+)\.pt$")


def make_backend(config: RunConfig) -> TrainBackend:
    """The training backend that `trainer.backend` names (torch: plain PyTorch; megatron: Megatron-Core)."""
    if config.trainer.backend == "megatron":
        from libra.services.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(config.trainer, seed=config.seed)
    from libra.services.trainer.torch_backend import TorchBackend

    return TorchBackend(config.trainer, seed=config.seed)


@dataclass
class Position:
    """Where the trainer is: committed steps, its policy version, the next prompt position."""

    step: int = 0
    version: int = 0
    data_position: int = 0
    discarded_groups: int = 0  # rejected (stale) or failed groups, replaced by new submissions
    used_entries: list[str] = field(default_factory=list)  # stream entries used since the last checkpoint


class ModelState:
    def __init__(self, config: RunConfig, backend: TrainBackend, store: Any):
        self.config, self.backend, self.store = config, backend, store
        self.root = config.run_path
        self.base_dir = self.root / "model" / "base"
        self.checkpoints = self.root / "checkpoints"
        self.stopping = threading.Event()  # set on SIGTERM: the warm start stops at its next step
        self.weights_group = None  # rank 0 of the current weights-group generation, once formed (weight_sync: group)
        self._group_record = None  # that generation (GroupRecord), announced in Redis; None: form a new one
        self._group_store = None  # the TCPStore every generation meets in, hosted here for the process's life

    def latest_checkpoint(self) -> pathlib.Path | None:
        found = [(int(m.group(1)), p) for p in self.checkpoints.glob("step*.pt") if (m := CHECKPOINT_RE.match(p.name))]
        return max(found)[1] if found else None

    async def prepare(self, on_warmup: Callable[[str], Any]) -> Position:
        """Create and warm-start the model if needed, or resume from the latest checkpoint."""
        if not (self.base_dir / "config.json").exists():
            await self._create(on_warmup)
        await asyncio.to_thread(self.backend.load, str(self.base_dir))
        position = Position()
        checkpoint = self.latest_checkpoint()
        if checkpoint is not None:
            extra = await asyncio.to_thread(self.backend.load_checkpoint, str(checkpoint))
            position = Position(step=extra["step"], version=extra["version"], data_position=extra["data_position"],
                                discarded_groups=extra.get("discarded_groups", 0))
            acked = await self.store.ack_completed(list(extra.get("used_entries", [])))
            _log.info("resumed", checkpoint=str(checkpoint), step=position.step, acked_entries=acked)
        return position

    async def _create(self, on_warmup: Callable[[str], Any]) -> None:
        from libra.services.trainer.warmup import warm_start
        from libra.tiny_model import create_tiny_model

        if self.config.model.source == "path":
            await asyncio.to_thread(shutil.copytree, self.config.model.path, self.base_dir, dirs_exist_ok=True)
            return
        workload = build_workload(self.config.workload)
        staging = self.base_dir.with_name("base.partial")
        shutil.rmtree(staging, ignore_errors=True)
        await on_warmup("creating the tiny model and its tokenizer")
        await asyncio.to_thread(create_tiny_model, self.config.model, workload, staging, self.config.seed)
        warm = self.config.trainer.warmup
        loop = asyncio.get_running_loop()

        def progress(step: int, loss: float) -> None:
            if self.stopping.is_set():
                raise InterruptedError("warm start interrupted by shutdown; it restarts from scratch next time")
            if step % 20 == 0 or step == warm.steps:
                asyncio.run_coroutine_threadsafe(on_warmup(f"{step}/{warm.steps} loss {loss:.3f}"), loop)

        metrics = await asyncio.to_thread(warm_start, staging, workload, warm, self.config.seed,
                                          self.config.trainer.torch_threads, progress)
        staging.rename(self.base_dir)
        _log.info("warm start done", **{k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()})

    async def publish(self, version: int) -> tuple[str, float]:
        """Write the current weights as policy `version` and record it in Redis (CAS on the version)."""
        started = time.monotonic()
        out = self.root / "weights" / f"v{version}"
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        await asyncio.to_thread(self.backend.save_weights, str(partial))
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        await self.store.publish_version(version, str(out))
        self._prune_weights(keep_from=version - self.config.trainer.max_staleness - 2)
        return str(out), time.monotonic() - started

    # ---- the weights group (rollout.worker.weight_sync: group) ------------------------------
    async def plan_weights_round(self, version: int, roster: Any) -> Any:
        """The generation `version` goes on (a GroupRecord), announcing a new one in Redis when the
        roster changed or there is no usable one (libra/weights/roster.py).

        Call it before asking rollout for the version: rollout reads the announcement."""
        from libra.weights.group import open_store
        from libra.weights.roster import BLOB, GroupRecord, reform_reason

        current = self._group_record.roster if self._group_record is not None else None
        reason = reform_reason(current, roster)
        if reason is None:
            return self._group_record
        self.close_weights_group()
        worker = self.config.rollout.worker
        if self._group_store is None:
            host, port = worker.weights_group_address.rsplit(":", 1)
            self._group_store = await asyncio.to_thread(open_store, host, port, True, worker.weights_sync_timeout_s)
        previous = await self.store.blob_record(BLOB)
        generation = await self.store.save_blob(BLOB, GroupRecord.payload(version, roster),
                                                expected_generation=previous.generation if previous else 0)
        self._group_record = GroupRecord(generation, version, roster)
        _log.info("weights group: new generation", generation=generation, version=version,
                  world_size=roster.world_size, workers=roster.ids, reason=reason)
        return self._group_record

    async def send_weights(self, version: int, cancel: threading.Event | None = None) -> Any:
        """Broadcast the current weights as `version` on the planned generation (forming it first
        when it is new, while rollout's workers join); returns its SyncReport.

        Run it concurrently with rollout's UpdateWeights over the group and set `cancel` when that
        returns. On any failure the generation is dropped: the next version forms a new one.
        """
        from libra.weights.group import WeightsGroup

        record = self._group_record
        if record is None:
            raise FailedPrecondition("no weights-group generation: call plan_weights_round first")
        named = getattr(self.backend, "hf_named_tensors", None)  # backends whose own names are not HF's
        tensors = list(named()) if named is not None else list(self.backend.model.named_parameters())
        worker = self.config.rollout.worker
        try:
            if self.weights_group is None:
                host, port = worker.weights_group_address.rsplit(":", 1)
                self.weights_group = await asyncio.to_thread(
                    WeightsGroup, host, int(port), 0, record.roster.world_size, worker.weights_group_backend,
                    device=str(getattr(self.backend, "device", "cpu")), timeout_s=worker.weights_sync_timeout_s,
                    bucket_bytes=worker.weights_bucket_mb * 2**20, generation=record.generation,
                    store=self._group_store, cancel=cancel)
            report = await asyncio.to_thread(self.weights_group.send, [(n, t.detach()) for n, t in tensors],
                                             version, None, cancel)
        except Exception:
            self.close_weights_group()
            raise
        _log.info("weights sent over the group", version=version, generation=record.generation,
                  world_size=record.roster.world_size, gbps=round(report.gbps, 2), seconds=round(report.seconds, 4),
                  receivers=len(report.receivers))
        return report

    def close_weights_group(self, release_store: bool = False) -> None:
        """Drop the current generation (the next version forms a new one); with `release_store`,
        also stop hosting the store (shutdown)."""
        group, self.weights_group, self._group_record = self.weights_group, None, None
        if group is not None:
            group.close()
        if release_store:
            self._group_store = None

    def _prune_weights(self, keep_from: int) -> None:
        for path in (self.root / "weights").glob("v*"):
            if path.name[1:].isdigit() and int(path.name[1:]) < keep_from:
                shutil.rmtree(path, ignore_errors=True)

    async def checkpoint(self, position: Position) -> pathlib.Path:
        """Save, then ack the stream entries the saved steps used, then forget older checkpoints."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        path = self.checkpoints / f"step{position.step}.pt"
        extra = {"step": position.step, "version": position.version, "data_position": position.data_position,
                 "discarded_groups": position.discarded_groups, "used_entries": list(position.used_entries)}
        await asyncio.to_thread(self.backend.save_checkpoint, str(path), extra)
        await self.store.ack_completed(list(position.used_entries))
        position.used_entries.clear()
        await self.store.set_trainer_progress({"step": position.step, "version": position.version,
                                               "data_position": position.data_position, "checkpoint_path": str(path)})
        for old in self.checkpoints.glob("step*.pt"):
            match = CHECKPOINT_RE.match(old.name)
            if match and int(match.group(1)) < position.step:
                old.unlink(missing_ok=True)
        return path
