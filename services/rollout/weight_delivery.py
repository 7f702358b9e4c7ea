"""New policy versions into the gateway's workers: the rollout side of UpdateWeights, all of it.

```
 deliver(v, path, group)    the one entry: path checked (a directory under RUN_DIR/weights), then
   group unset:             from_disk: every target loads path (retried once on a transport error)
   group G set:             delivery() says group | join | disk  (libra/weights/roster.py)
     join:  G's members join generation G (each closes its old one); workers that left the roster leave
     group: members receive v ─ missed it? ─▶ load v from disk ─ missed again / no path? ─▶ UNHEALTHY
            other targets (not members: just started, caught up) load v from disk
     disk:  G cannot deliver (`group_unusable` says why) ─▶ from_disk(v, path)
   no path (v not on disk yet): a worker the group does not reach answers not ok ("behind") and
   keeps serving what it holds; the trainer then sends v again: over a new generation when G was
   unusable, else written to disk, with its path
 colocated descriptor D set (weights: colocated): every target takes v from the trainer's export
   buffer on its GPU ─ refused? ─▶ loads v from disk ─ no path? ─▶ "behind" (weights unchanged) ─
   failed mid-way? ─▶ UNHEALTHY
 targets: the serving workers, and the live ones that missed an earlier version; a worker that
 already holds v is left alone (the trainer's second call reaches only those still behind)
 reply: every target's ack, the serving workers (the next generation's roster), group_unusable
```

A worker that misses a version is marked UNHEALTHY (the gateway takes it out of routing) and
keeps reporting the version it still holds; every later version is tried on it from disk, and
once it holds one it serves again (`recovered`: the gateway registers it again). The version a
worker reports, and that its tokens are tagged with, changes only when every rank of its engine
confirmed holding exactly that version. This module knows the workers' HTTP methods, not Redis.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from dataclasses import dataclass
from typing import Any

from libra import log as liblog
from libra.errors import InvalidArgument, Unavailable
from libra.services.rollout.workers import PoolWorker, WorkerPool, collective_rpc
from libra.v1 import common_pb2, rollout_pb2
from libra.weights.roster import Delivery, GroupRecord, Roster, delivery

_log = liblog.get("libra.rollout")
WEIGHT_RETRIES = 1  # a disk load that fails in transport is retried this many times, then the worker missed it
SERVING, UNHEALTHY = common_pb2.WORKER_STATE_SERVING, common_pb2.WORKER_STATE_UNHEALTHY
ROUTES = ("group", "colocated", "disk", "held", "behind", "missed")


@dataclass
class Delivered:
    """What one UpdateWeights did: every target's ack, the serving workers afterwards, and why the
    request's weights-group generation could deliver nothing ("" when it could, or there was none)."""

    acks: list[rollout_pb2.WorkerAck]
    serving: Roster
    group_unusable: str = ""


class WeightDelivery:
    """`weights`: the run's `weights:` section (group settings when it is a group); `weights_dir`:
    RUN_DIR/weights, the only place a version's path may point to (None: not checked)."""

    def __init__(self, pool: WorkerPool, weights: Any, weights_dir: pathlib.Path | None = None):
        self.pool, self.weights = pool, weights
        self.weights_dir = weights_dir.resolve() if weights_dir is not None else None
        self.generation: int | None = None  # the weights-group generation whose ranks the members are
        self.members: set[str] = set()
        self.recovered: list[PoolWorker] = []  # serving again after a missed version; the gateway registers them
        self.unusable = ""  # why the last update's generation could deliver nothing

    def targets(self) -> list[PoolWorker]:
        """The workers a new version goes to: serving ones, and live ones that missed an earlier version."""
        return [w for w in self.pool.workers.values() if w.state == SERVING
                or (w.missed and w.state == UNHEALTHY and w.process.alive)]

    def serving_roster(self) -> Roster:
        """The live serving workers, as the roster of the next version's generation (the reply's `serving`)."""
        return Roster.of((w.worker_id, w.tp) for w in self.pool.serving() if w.process.alive)

    def take_recovered(self) -> list[PoolWorker]:
        recovered, self.recovered = self.recovered, []
        return recovered

    async def deliver(self, version: int, path: str, group: GroupRecord | None, colocated: str = "") -> Delivered:
        """Bring every target to `version`: over `group` (the trainer sends it meanwhile) when set,
        from the trainer's export buffer that `colocated` describes when set, else from `path`.
        `path` empty: the version is not on disk (group or colocated only)."""
        if path:
            self._check_path(version, path)
        elif group is None and not colocated:
            raise InvalidArgument(f"version {version} has neither a path, a weights-group generation nor a "
                                  "colocated descriptor")
        self.unusable = ""
        if colocated:
            acks = self._report(version, None, await asyncio.gather(
                *(self._take_colocated(w, version, path, colocated) for w in self.targets())))
        elif group is None:
            acks = await self.from_disk(version, path)
        else:
            acks = await self.over_group(version, path, group)
        return Delivered(acks, self.serving_roster(), self.unusable)

    def _check_path(self, version: int, path: str) -> None:
        where = pathlib.Path(path).resolve()
        if self.weights_dir is not None and not where.is_relative_to(self.weights_dir):
            raise InvalidArgument(f"path {path!r} of v{version} is outside the run's weights directory "
                                  f"{self.weights_dir}; weights are published there only")
        if not where.is_dir():
            raise InvalidArgument(f"path {path!r} is not a directory of this machine (weights of v{version})")

    async def from_disk(self, version: int, path: str) -> list[rollout_pb2.WorkerAck]:
        """Load `path` as `version` on every target that does not hold it, concurrently, without draining."""
        routes = await asyncio.gather(*(self._load(w, version, path) for w in self.targets()))
        return self._report(version, None, routes)

    async def over_group(self, version: int, path: str, record: GroupRecord) -> list[rollout_pb2.WorkerAck]:
        """Receive `version` over the group generation `record`; `path` (may be empty) is the disk
        copy for every worker the group does not reach."""
        present = [w.worker_id for w in self.pool.workers.values()
                   if w.process.alive and w.state != common_pb2.WORKER_STATE_STOPPED]
        plan = delivery(record, self.generation, present, version)
        if plan.how == "join":
            try:
                await self._join(record)
            except Exception as error:  # noqa: BLE001 - the version still arrives, from disk
                plan = Delivery("disk", f"joining generation {record.generation} failed: {error}")
        if plan.how == "disk":
            _log.warning("the weights group cannot deliver this version; every worker loads it from disk",
                         version=version, why=plan.why, on_disk=bool(path))
            self.unusable = plan.why
            return await self.from_disk(version, path)
        members = [self.pool.workers[w] for w in record.roster.ids]
        others = [w for w in self.targets() if w.worker_id not in self.members]
        routes = await asyncio.gather(*(self._receive(w, version, path) for w in members),
                                      *(self._load(w, version, path) for w in others))
        return self._report(version, record.generation, routes)

    def _report(self, version: int, generation: int | None, routes: list[tuple[Any, str]]) -> list:
        by_route: dict[str, list[str]] = {route: [] for route in ROUTES}
        for ack, route in routes:
            by_route[route].append(ack.worker_id)
        _log.info("version delivered", version=version, generation=generation, over_group=by_route["group"],
                  colocated=by_route["colocated"], from_disk=by_route["disk"], held=by_route["held"],
                  behind=by_route["behind"], missed=by_route["missed"],
                  seconds={ack.worker_id: round(ack.seconds, 4) for ack, _ in routes})
        return [ack for ack, _ in routes]

    # ---- the group --------------------------------------------------------------------------
    async def _join(self, record: GroupRecord) -> None:
        """Make the roster's workers ranks of `record`'s generation; workers that left it leave."""
        w = self.weights
        host, port = w.address.rsplit(":", 1)
        ranks = record.roster.first_ranks()
        leaving = [self.pool.workers[name] for name in sorted(self.members - set(ranks))
                   if name in self.pool.workers and self.pool.workers[name].process.alive]
        self.generation, self.members = None, set()
        joins = [collective_rpc(self.pool.workers[name].client, "libra_join_weights_group",
                                [host, int(port), first, record.roster.world_size, w.backend,
                                 w.sync_timeout_s, w.bucket_mb, record.generation],
                                timeout=w.sync_timeout_s + 30) for name, first in ranks.items()]
        leaves = [collective_rpc(worker.client, "libra_leave_weights_group", [], timeout=60) for worker in leaving]
        results = await asyncio.gather(*joins, *leaves, return_exceptions=True)
        for worker, result in zip(leaving, results[len(joins):]):
            if isinstance(result, BaseException):  # it holds a closed generation's buffers; nothing breaks
                _log.warning("worker could not leave the old weights group", worker=worker.worker_id,
                             error=str(result))
        for worker_id, result in zip(ranks, results[:len(joins)]):
            if isinstance(result, BaseException):
                raise Unavailable(f"{worker_id}: {type(result).__name__}: {result}")
            errors = [r["error"] for r in result if isinstance(r, dict) and "error" in r]
            if errors:
                raise Unavailable(f"{worker_id}: {errors[0]}")
        self.generation, self.members = record.generation, set(ranks)
        _log.info("workers joined the weights group", generation=record.generation,
                  world_size=record.roster.world_size, workers=sorted(ranks))

    async def _receive(self, worker: PoolWorker, version: int, path: str) -> tuple[Any, str]:
        started = time.monotonic()
        try:
            results = await worker.client.receive_weights(version, self.weights.sync_timeout_s + 600)
            _confirm(results, version)
        except Exception as error:  # noqa: BLE001 - per worker: retried from disk, else unhealthy
            if not worker.process.alive or not path:  # its weights may be half-received: out of routing
                return self._missed(worker, version, error), "missed"
            _log.warning("worker missed the version in the weights group; loading it from disk",
                         worker=worker.worker_id, version=version, error=str(error))
            return await self._load(worker, version, path, started)
        return self._holds(worker, version, started), "group"

    async def _take_colocated(self, worker: PoolWorker, version: int, path: str, descriptor: str) -> tuple[Any, str]:
        """The worker takes `version` from the trainer's buffer on its GPU; from disk if it refuses."""
        started = time.monotonic()
        if worker.version == version and not worker.missed:
            return self._ack(worker, True, 0.0), "held"
        try:
            results = await worker.client.receive_colocated(descriptor, version, self.weights.sync_timeout_s)
        except Exception as error:  # noqa: BLE001 - per worker: it may have stopped mid-way, out of routing
            if not worker.process.alive or not path:
                return self._missed(worker, version, error), "missed"
            return await self._load(worker, version, path, started)
        try:
            _confirm(results, version)
        except Unavailable as error:  # refused before any weight moved (a misfit, a handle that did not open)
            _log.warning("worker refused the colocated version; it loads it from disk", worker=worker.worker_id,
                         version=version, error=str(error), on_disk=bool(path))
            return await self._load(worker, version, path, started)  # no path: "behind", weights unchanged
        return self._holds(worker, version, started), "colocated"

    # ---- disk and bookkeeping -----------------------------------------------------------------
    async def _load(self, worker: PoolWorker, version: int, path: str,
                    started: float | None = None) -> tuple[Any, str]:
        from libra.services.rollout.engines.client import WeightSetError

        started = time.monotonic() if started is None else started
        if worker.version == version and not worker.missed:
            return self._ack(worker, True, 0.0), "held"
        if not path:  # it keeps serving what it holds (and says so) until the trainer's disk copy comes
            return self._ack(worker, False, 0.0, f"version {version} is not on disk yet; the trainer writes it "
                                                 f"and sends it again"), "behind"
        for attempt in range(WEIGHT_RETRIES + 1):
            try:
                await worker.client.load_weights(path, version)  # checks every rank's version
                break
            except Exception as error:  # noqa: BLE001 - reported per worker; retried, then unhealthy
                if attempt < WEIGHT_RETRIES and not isinstance(error, WeightSetError) and worker.process.alive:
                    _log.warning("weight load failed; retrying", worker=worker.worker_id, version=version,
                                 error=str(error))
                    continue
                return self._missed(worker, version, error), "missed"
        return self._holds(worker, version, started), "disk"

    def _holds(self, worker: PoolWorker, version: int, started: float) -> rollout_pb2.WorkerAck:
        worker.version = version
        if worker.missed:
            worker.missed = 0
            if worker.state == UNHEALTHY:
                worker.state, worker.reported = SERVING, False
                self.recovered.append(worker)
                _log.info("worker caught up; it serves again", worker=worker.worker_id, version=version)
        return self._ack(worker, True, time.monotonic() - started)

    def _missed(self, worker: PoolWorker, version: int, error: BaseException) -> rollout_pb2.WorkerAck:
        worker.state, worker.missed = UNHEALTHY, version
        _log.error("worker missed a weight version; unhealthy (out of routing) until a later version reaches it",
                   worker=worker.worker_id, version=version, holds=worker.version, error=str(error))
        return self._ack(worker, False, 0.0, f"{type(error).__name__}: {error}")

    @staticmethod
    def _ack(worker: PoolWorker, ok: bool, seconds: float, error: str = "") -> rollout_pb2.WorkerAck:
        return rollout_pb2.WorkerAck(worker_id=worker.worker_id, version=worker.version, ok=ok,
                                     seconds=seconds, error=error)


def _confirm(results: list, version: int) -> None:
    """Every rank of the engine answered that it now holds exactly `version`; else Unavailable."""
    errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
    if errors:
        raise Unavailable(errors[0])
    if not results or any(not isinstance(r, dict) or r.get("version") != version for r in results):
        raise Unavailable(f"the engine did not confirm version {version}: {results!r}")
