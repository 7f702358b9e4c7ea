"""The trainer service's handle on the hybrid pool: RPC semantics, Redis persistence, proto views.

Owns: what AdmitHybrid / ReleaseHybrid / GetStepManifest mean for the service (effective at the
next step boundary, answered at once; a repeated request id is the RPC boundary's replay), and keeping the membership in
Redis (blob `trainer.membership`) so a restarted trainer knows it. Must not know: sockets, torch.

The data plane itself is `ElasticCore` (core_hooks); this class only wraps rank 0's instance.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from libra import log as liblog
from libra.errors import FailedPrecondition, InvalidArgument, NotFound
from libra.services.trainer.elastic.core_hooks import ElasticCore
from libra.services.trainer.backend import TrainBatch
from libra.services.trainer.elastic.manifest import GONE, HybridState, Membership, StepManifest
from libra.services.trainer.elastic.work import split, widened_groups
from libra.v1 import trainer_pb2 as P

_log = liblog.get("libra.trainer.elastic")

BLOB = "trainer.membership"
_STATES = {s: getattr(P, f"HYBRID_STATE_{s.value}") for s in HybridState}


class ElasticControl:
    def __init__(self, core: ElasticCore, store: Any):
        self.core, self.store = core, store
        self.hybrid_groups = 0  # groups consumed by hybrids so far (the submit budget adds them)
        self._pending: list[dict] = []  # admissions/releases not yet applied at a boundary
        self._records: list = []  # a copy of the records after the last boundary, for readers
        self._lock = asyncio.Lock()

    # -- restart -------------------------------------------------------------------------------
    async def restore(self) -> None:
        payload = await self.store.load_blob(BLOB)
        if payload is None:
            return
        data = json.loads(payload)
        self.core.membership = Membership.from_json(json.dumps(data["membership"]).encode(), restarted=True)
        self.hybrid_groups = int(data.get("hybrid_groups", 0))
        for event in data.get("pending", []):
            try:
                self._queue(event)
            except FailedPrecondition as error:  # the layout changed across the restart: drop the admission
                self._pending.remove(event)
                _log.warning("pending admission dropped at restore", error=str(error))
        self._records = copy.deepcopy(list(self.core.membership.records.values()))

    async def persist(self) -> None:
        body = {"membership": json.loads(self.core.membership.to_json()), "hybrid_groups": self.hybrid_groups,
                "pending": self._pending}
        await self.store.save_blob(BLOB, json.dumps(body).encode())

    def _queue(self, event: dict) -> None:
        self._pending.append(event)
        (self.core.admit if event["kind"] == "admit" else self.core.release)(event["replica_id"],
                                                                             int(event.get("generation", 0)))

    # -- RPCs ------------------------------------------------------------------------------------
    async def admit(self, replica_id: str, generation: int) -> bool:
        _check_id(replica_id)
        refusal = self.core.refusal()
        if refusal:  # before anything is recorded: the request can be retried once the layout allows it
            raise FailedPrecondition(f"cannot admit hybrid {replica_id}: {refusal}")
        async with self._lock:
            known = self._state_of(replica_id)
            if known is not None and known[0] not in GONE and known[1] == generation:
                return False  # already admitted with this generation
            self._queue({"kind": "admit", "replica_id": replica_id, "generation": generation})
            await self.persist()
            return True

    async def release(self, replica_id: str, generation: int) -> bool:
        _check_id(replica_id)
        async with self._lock:
            known = self._state_of(replica_id)
            if known is None:
                raise NotFound(f"unknown hybrid replica {replica_id!r}: AdmitHybrid it first")
            if known[0] in GONE:
                return False
            self._queue({"kind": "release", "replica_id": replica_id, "generation": generation})
            await self.persist()
            return True

    def _state_of(self, replica_id: str) -> tuple[HybridState, int] | None:
        pending = [e for e in self._pending if e["replica_id"] == replica_id]
        if pending:  # the last request not yet applied decides
            last = pending[-1]
            return (HybridState.JOINING if last["kind"] == "admit" else HybridState.RELEASED), int(last["generation"])
        record = next((r for r in self._records if r.replica_id == replica_id), None)
        return (record.state, record.generation) if record is not None else None

    # -- the boundary (the loop calls these around each step) -----------------------------------
    async def begin_step(self, step: int) -> StepManifest:
        async with self._lock:
            self._pending = []  # ElasticCore applies everything queued so far at this boundary
            manifest = await asyncio.to_thread(self.core.begin_step, step)
            self._records = copy.deepcopy(list(self.core.membership.records.values()))
            await self.persist()
        return manifest

    def widen(self, manifest: StepManifest, groups_per_step: int) -> int:
        """Groups this step takes: the core's plus one share per active hybrid (counted for submit)."""
        total = widened_groups(groups_per_step, manifest)
        self.hybrid_groups += total - groups_per_step
        return total

    def hand_out(self, batch: TrainBatch, group_size: int, manifest: StepManifest) -> TrainBatch:
        """Split the widened batch (advantages already set), give hybrids theirs; the core's slice."""
        if not manifest.hybrids:
            self.core.assign({})
            return batch
        slices = split(batch, group_size, manifest)
        self.core.assign(slices)
        return slices["core-0"]

    def end_step(self) -> None:
        self.core.end_step()

    # -- views -------------------------------------------------------------------------------------
    async def manifest_proto(self, step: int) -> P.StepManifest:
        async with self._lock:  # begin_step mutates the history in a worker thread
            return self._manifest_proto(step)

    def _manifest_proto(self, step: int) -> P.StepManifest:
        history = self.core.history
        if step == 0:
            step = next(reversed(history)) if history else 0
        if step and step not in history:
            raise NotFound(f"step {step} has no manifest here (the last {len(history)} steps are kept)")
        manifest, acks = history[step] if step else (StepManifest(0, self.core.membership.epoch,
                                                                  self.core.core_ranks), set())
        endpoints = self.core.lane_endpoints
        hybrids = [P.HybridReplica(replica_id=r.replica_id, state=_STATES[r.state], dp_rank=r.dp_rank,
                                   endpoint=endpoints[r.dp_rank], generation=r.generation, reason=r.reason,
                                   snapshot_step=r.snapshot_step, active_from_step=r.active_from_step)
                   for r in sorted(self._records, key=lambda r: r.replica_id)]
        if self.core.core_ranks == 1:  # admitted, not yet at a boundary: the lane is already known
            known = {h.replica_id for h in hybrids}
            hybrids += [P.HybridReplica(replica_id=e["replica_id"], state=P.HYBRID_STATE_JOINING, dp_rank=0,
                                        endpoint=endpoints[0], generation=int(e["generation"]), snapshot_step=-1)
                        for e in self._pending if e["kind"] == "admit" and e["replica_id"] not in known]
        return P.StepManifest(step=manifest.step, membership_epoch=manifest.epoch,
                              active_replicas=manifest.active_ids, acknowledged_by=sorted(acks),
                              hybrids=hybrids, lane_endpoints=endpoints, core_replicas=manifest.core_ranks)


def _check_id(replica_id: str) -> None:
    if not replica_id or len(replica_id) > 256 or any(c.isspace() for c in replica_id):
        raise InvalidArgument("replica_id is required: 1-256 characters without whitespace")
