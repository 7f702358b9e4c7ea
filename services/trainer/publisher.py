"""The trainer's weight publisher: the whole path of one policy version, from the weights in
memory to every rollout worker holding it (the rollout side is services/rollout/weight_delivery.py;
what travels between them is libra/weights/).

```
 publish(v) = record(v) + deliver(v)                      (the loop awaits it once per step)
   weights: disk
     write RUN_DIR/weights/vN ─▶ Redis: version v, its path ─▶ UpdateWeights(v, path)
   weights: group (rollout's serving roster known from its last reply)
     Redis: version v, no path ─▶ generation for that roster (new one: Redis blob weights.group, CAS)
     send v over the group  ‖  UpdateWeights(v, group G, path if on disk)
                             ◀─ acks, and the serving roster the next version's generation follows
     G unusable (rollout's workers changed since its last reply): once more, on a generation for them
     a worker not ok and v not on disk: write v now ─▶ UpdateWeights(v, path) (only those behind load)
     v a multiple of disk_every: write v in the background ── settle() ◀─ before the weights change
   weights: colocated (the hf engines on the trainer's GPU; rollout's roster known)
     Redis: version v, no path ─▶ HF tensors ─D2D─▶ export buffer v % n (libra/weights/ipc.py)
     ─▶ UpdateWeights(v, colocated=its CUDA IPC descriptor) ─▶ each engine maps (share) or copies it
     an engine refused and v not on disk: write v now ─▶ UpdateWeights(v, path); disk_every as for group
 at start: record(v) with its disk copy before rollout is up (rollout starts its workers on it),
           deliver(v) once rollout answers; a fresh run whose weights will be the base model's files:
           first_version_from(base) links those files as weights/v1 and records v1 before any backend
```
Versions never go backwards: at start the first version is one above the highest that Redis, the
checkpoint or `weights/` knows (`first_version`), and a publish that finds Redis behind (it came
back without the counter) raises the counter first. A rollout that is restarting is waited for
(peers.py); a version it missed it loads from disk when it comes back (the newest on disk).

The path a version is written to is used as it is, never read back from Redis; Redis keeps the
durable record (the version counter, each version's path once on disk, the group's generation).
The background write reads the weights while the next batch is collected; `settle()` waits for it
and must come before anything else uses the backend (GrpoLoop calls it after collecting and before
a checkpoint), so the weights never change under it.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from libra import log as liblog
from libra.config import RunConfig
from libra.errors import Conflict
from libra.services.trainer.peers import patient
from libra.v1 import common_pb2, rollout_pb2
from libra.weights.roster import BLOB, GroupRecord, Roster, reform_reason

_log = liblog.get("libra.trainer")
RPC_TIMEOUT_S = 600
VERSION_DIR = re.compile(r"^v(\d+)(\.partial)?$")


@dataclass
class PublishReport:
    """Where one version's publish time went (the step record carries it)."""

    version: int
    write_seconds: float = 0.0  # the disk write on the critical path (0: none, or in the background)
    send_seconds: float = 0.0   # the broadcast over the weights group (concurrent with the first RPC)
    rpc_seconds: float = 0.0    # rollout's UpdateWeights calls
    seconds: float = 0.0        # the whole publish, wall time
    workers_updated: int = 0    # rollout workers holding the version afterwards


class WeightPublisher:
    """Publishes the backend's weights as policy versions to the rollout gateway `rollout` (a stub)."""

    def __init__(self, config: RunConfig, backend: Any, store: Any, rollout: Any):
        self.config, self.backend, self.store, self.rollout = config, backend, store, rollout
        self.settings = config.weights
        self.root = config.run_path / "weights"
        self.roster: Roster | None = None  # rollout's serving workers, from its last UpdateWeights reply
        self.weights_group = None  # rank 0 of the current generation, once formed
        self._generation: GroupRecord | None = None  # that generation; None: the next version forms one
        self._group_store = None  # the TCPStore every generation meets in, hosted for the process's life
        self._paths: dict[int, str] = {}  # versions this process wrote to disk, and where
        self._background: asyncio.Task | None = None
        self._export = None  # weights: colocated — the export buffers (libra/weights/ipc.py), for the process's life
        self.check(config)

    @staticmethod
    def check(config: RunConfig) -> None:
        """Refuse at start what this machine cannot publish with (weights: colocated without CUDA)."""
        if config.weights.type == "colocated":
            from libra.weights.ipc import check_cuda

            check_cuda()

    # ---- one version ----------------------------------------------------------------------
    async def publish(self, version: int) -> PublishReport:
        """Make the weights in memory policy `version` and bring rollout's workers to it (no drain)."""
        started = time.monotonic()
        await self.settle()
        direct = self.settings.type in ("group", "colocated") and bool(self.roster)  # no disk on the way
        report = PublishReport(version)
        await self.record(version, write=not direct, report=report)
        await self.deliver(version, report)
        if direct and version not in self._paths and self.settings.disk_every \
                and version % self.settings.disk_every == 0:
            self._background = asyncio.create_task(self._write_in_background(version))
        report.seconds = time.monotonic() - started
        _log.info("version published", version=version, over_group=direct and self.settings.type == "group",
                  colocated=direct and self.settings.type == "colocated", seconds=round(report.seconds, 4),
                  write_s=round(report.write_seconds, 4), send_s=round(report.send_seconds, 4),
                  rpc_s=round(report.rpc_seconds, 4), workers=report.workers_updated)
        return report

    async def first_version(self, checkpoint_version: int) -> int:
        """The version the weights in memory become at start: one above every version Redis, the
        checkpoint (`checkpoint_version`) or the weights directory knows, so none is reused."""
        on_disk = [int(m.group(1)) for p in self.root.glob("v*") if (m := VERSION_DIR.match(p.name))]
        return max([await self.store.current_version(), checkpoint_version, *on_disk]) + 1

    async def first_version_from(self, model_dir: pathlib.Path) -> int | None:
        """At the start of a fresh run (no version in Redis or `weights/`), publish the files of
        `model_dir` as version 1, hard-linked as RUN_DIR/weights/v1 (copied where links fail), and
        return 1; None (nothing published) when any version exists. The caller vouches that the
        weights it will hold are those files' numbers."""
        if await self.first_version(0) != 1:
            return None
        started = time.monotonic()
        out = await self._put(1, lambda partial: shutil.copytree(model_dir, partial, copy_function=_link_or_copy))
        await self.store.raise_version(0)
        await self.record_path_as(1, str(out))
        _log.info("version 1 is the base model's files", path=str(out), seconds=round(time.monotonic() - started, 4))
        return 1

    async def record_path_as(self, version: int, path: str) -> None:
        """Publish `version` in Redis with `path` (compare-and-set on the version)."""
        try:
            await self.store.publish_version(version, path)
        except Conflict:
            if await self.store.current_version() >= version:
                raise  # a later version exists: another trainer publishes (never ours to overwrite)
            current = await self.store.raise_version(version - 1)  # Redis is behind what we know
            _log.warning("the policy version counter was behind this trainer's; raised it", version=version,
                         counter=current)
            await self.store.publish_version(version, path)

    async def record(self, version: int, write: bool = True, report: PublishReport | None = None) -> str:
        """Publish `version` in Redis (compare-and-set on the version), its disk copy written first
        when `write`; returns the path ("" when not written)."""
        path = ""
        if write:
            path, seconds = await self._write(version)
            if report is not None:
                report.write_seconds += seconds
        await self.record_path_as(version, path)
        return path

    async def deliver(self, version: int, report: PublishReport | None = None) -> PublishReport:
        """Bring rollout's workers to `version`: over the weights group when there is one for its
        serving workers, and from disk for every worker the group does not reach."""
        report = report if report is not None else PublishReport(version)
        path = self._paths.get(version, "")
        reply = None
        if self.settings.type == "group" and self.roster:
            reply = await self._over_group(version, path, self.roster, report)
            if reply is not None and reply.group_unusable and reply.serving:
                _log.info("the weights group's roster was stale; sending the version again on a generation "
                          "for rollout's serving workers", version=version, why=reply.group_unusable)
                self._drop_generation()
                reply = await self._over_group(version, path, Roster.from_proto(reply.serving), report)
        elif self.settings.type == "colocated" and self.roster:
            reply = await self._colocated(version, path, report)
        if reply is None or (not path and any(not ack.ok for ack in reply.acks)):
            if not path:  # the disk copy is the fallback: written now, on demand
                path, seconds = await self._on_disk(version)
                report.write_seconds += seconds
            suffix = "-disk" if self.settings.type != "disk" else ""
            reply = await self._update(rollout_pb2.UpdateWeightsRequest(
                meta=self._meta(f"weights-v{version}{suffix}"), version=version, path=path), report, wait=True)
        self.roster = Roster.from_proto(reply.serving)
        report.workers_updated = sum(ack.ok for ack in reply.acks)
        failed = [ack.worker_id for ack in reply.acks if not ack.ok]
        if failed:
            _log.warning("workers missed a weight version", version=version, workers=failed)
        return report

    async def settle(self) -> None:
        """Wait for the background disk write, if any (its failure is raised here)."""
        task, self._background = self._background, None
        if task is not None:
            await task

    async def close(self) -> None:
        """Finish a background write, leave the weights group, stop hosting its store (shutdown)."""
        try:
            await self.settle()
        except Exception as error:  # noqa: BLE001 - shutting down: the version stays without a disk copy
            _log.warning("background weight write failed at shutdown", error=str(error))
        self._drop_generation()
        self._group_store = None

    # ---- rollout ----------------------------------------------------------------------------
    def _meta(self, request_id: str) -> common_pb2.RequestMeta:
        return common_pb2.RequestMeta(request_id=request_id, run_id=self.config.run_id)

    async def _update(self, request: rollout_pb2.UpdateWeightsRequest, report: PublishReport,
                      wait: bool = False) -> Any:
        """rollout's UpdateWeights; `wait`: through a rollout restart (peers.py), same request id."""
        started = time.monotonic()
        try:
            if wait:
                return await patient(lambda: self.rollout.UpdateWeights(request, timeout=RPC_TIMEOUT_S),
                                     f"UpdateWeights v{request.version}")
            return await self.rollout.UpdateWeights(request, timeout=RPC_TIMEOUT_S)
        finally:
            report.rpc_seconds += time.monotonic() - started

    async def _over_group(self, version: int, path: str, roster: Roster, report: PublishReport) -> Any:
        """Send `version` on `roster`'s generation while rollout receives it; rollout's reply, or
        None when it failed (the caller then sends the version over disk)."""
        try:
            record = await self._generation_for(version, roster)
        except Exception as error:  # noqa: BLE001 - the version still goes out, over disk
            _log.error("no weights-group generation for this version; it goes over disk", version=version,
                       error=str(error))
            return None
        cancel = threading.Event()
        send = asyncio.create_task(self._send(version, record, cancel, report))
        request = rollout_pb2.UpdateWeightsRequest(meta=self._meta(f"weights-v{version}-g{record.generation}"),
                                                   version=version, path=path, group=record.to_proto())
        try:
            reply = await self._update(request, report)
        except Exception as error:  # noqa: BLE001 - inspected below
            reply = error
        finally:
            cancel.set()  # rollout is done with this version: a rank that has not joined never will
        sent = (await asyncio.gather(send, return_exceptions=True))[0]
        if isinstance(sent, BaseException):
            _log.warning("the weights group missed this version; the next version forms a new generation",
                         version=version, generation=record.generation, error=str(sent))
        if isinstance(reply, BaseException):
            _log.error("rollout failed the update over the weights group; sending the version over disk",
                       version=version, error=str(reply))
            return None
        return reply

    # ---- weights: colocated -------------------------------------------------------------------
    async def _colocated(self, version: int, path: str, report: PublishReport) -> Any:
        """Write `version` into the export buffer and have rollout's engines take it from there;
        rollout's reply, or None when that failed (the caller then sends the version over disk)."""
        from libra.weights.ipc import ColocatedExport

        started = time.monotonic()
        try:
            named = await asyncio.to_thread(self._named_tensors)
            if self._export is None or not self._export.fits(named):
                self._export = await asyncio.to_thread(ColocatedExport, named, self.settings.mode,
                                                       getattr(self.backend, "device", "cpu"))
            descriptor = await asyncio.to_thread(self._export.write, named, version)
        except Exception as error:  # noqa: BLE001 - the version still goes out, over disk
            _log.error("colocated export failed; the version goes over disk", version=version, error=str(error))
            return None
        finally:
            report.send_seconds += time.monotonic() - started
        request = rollout_pb2.UpdateWeightsRequest(meta=self._meta(f"weights-v{version}-colocated"), version=version,
                                                   path=path, colocated=descriptor)
        try:
            return await self._update(request, report)
        except Exception as error:  # noqa: BLE001 - the version still goes out, over disk
            _log.error("rollout failed the colocated update; sending the version over disk", version=version,
                       error=str(error))
            return None

    def _named_tensors(self) -> list:
        """(HF name, tensor) of the weights in memory, on the trainer's device."""
        named = getattr(self.backend, "hf_named_tensors", None)  # backends whose own names are not HF's
        return list(named()) if named is not None else list(self.backend.model.named_parameters())

    # ---- the weights group ------------------------------------------------------------------
    async def _generation_for(self, version: int, roster: Roster) -> GroupRecord:
        """The generation `version` goes on, recording a new one in Redis when the roster changed or
        there is no usable one (libra/weights/roster.py)."""
        from libra.weights.group import open_store

        reason = reform_reason(self._generation.roster if self._generation is not None else None, roster)
        if reason is None:
            return self._generation
        self._drop_generation()
        if self._group_store is None:
            host, port = self.settings.address.rsplit(":", 1)
            self._group_store = await asyncio.to_thread(open_store, host, port, True, self.settings.sync_timeout_s)
        previous = await self.store.blob_record(BLOB)
        generation = await self.store.save_blob(BLOB, GroupRecord.payload(version, roster),
                                                expected_generation=previous.generation if previous else 0)
        self._generation = GroupRecord(generation, version, roster)
        _log.info("weights group: new generation", generation=generation, version=version,
                  world_size=roster.world_size, workers=roster.ids, reason=reason)
        return self._generation

    async def _send(self, version: int, record: GroupRecord, cancel: threading.Event, report: PublishReport) -> None:
        """Broadcast the weights as `version` on `record`'s generation (forming it first when new, while
        rollout's workers join). On any failure the generation is dropped: the next version forms one."""
        from libra.weights.group import WeightsGroup

        started = time.monotonic()
        tensors = self._named_tensors()
        s = self.settings
        try:
            if self.weights_group is None:
                host, port = s.address.rsplit(":", 1)
                self.weights_group = await asyncio.to_thread(
                    WeightsGroup, host, int(port), 0, record.roster.world_size, s.backend,
                    device=str(getattr(self.backend, "device", "cpu")), timeout_s=s.sync_timeout_s,
                    bucket_bytes=s.bucket_mb * 2**20, generation=record.generation, store=self._group_store,
                    cancel=cancel)
            sync = await asyncio.to_thread(self.weights_group.send, [(n, t.detach()) for n, t in tensors],
                                           version, None, cancel)
        except Exception:
            self._drop_generation()
            raise
        finally:
            report.send_seconds += time.monotonic() - started
        _log.info("weights sent over the group", version=version, generation=record.generation,
                  world_size=record.roster.world_size, gbps=round(sync.gbps, 2), seconds=round(sync.seconds, 4),
                  receivers=len(sync.receivers))

    def _drop_generation(self) -> None:
        group, self.weights_group, self._generation = self.weights_group, None, None
        if group is not None:
            group.close()

    # ---- the disk ---------------------------------------------------------------------------
    async def _write(self, version: int) -> tuple[str, float]:
        """Write the weights as RUN_DIR/weights/vN (atomically: a worker never reads half a set)."""
        started = time.monotonic()
        out = await self._put(version, lambda partial: self.backend.save_weights(str(partial)))
        self._prune(keep_from=version - self.config.trainer.max_staleness - 2)
        return str(out), time.monotonic() - started

    async def _put(self, version: int, fill: Callable[[pathlib.Path], object]) -> pathlib.Path:
        """RUN_DIR/weights/vN made by `fill(staging directory)` in a thread, then renamed into place."""
        out = self.root / f"v{version}"
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        await asyncio.to_thread(fill, partial)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        self._paths[version] = str(out)
        return out

    async def _on_disk(self, version: int) -> tuple[str, float]:
        """The disk copy of a version published without one: written now, its path recorded."""
        path, seconds = await self._write(version)
        await self.store.record_path(version, path)
        _log.info("weights written on demand (a worker needs them from disk)", version=version,
                  seconds=round(seconds, 4))
        return path, seconds

    async def _write_in_background(self, version: int) -> None:
        path, seconds = await self._write(version)
        await self.store.record_path(version, path)
        _log.info("weights written in the background", version=version, seconds=round(seconds, 4))

    def _prune(self, keep_from: int) -> None:
        """Delete weight sets older than `keep_from` (the newest one, just written, always stays)."""
        for path in self.root.glob("v*"):
            if path.name[1:].isdigit() and int(path.name[1:]) < keep_from:
                shutil.rmtree(path, ignore_errors=True)
        self._paths = {v: p for v, p in self._paths.items() if v >= keep_from}


def _link_or_copy(source: str, dest: str) -> str:
    """A hard link of `source` at `dest` (no bytes written), or a copy where the file system refuses."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)
    return dest
