"""Membership of the hybrid pool as the trainer sees it, and the manifest frozen for each step.

Owns: the per-hybrid join/leave state machine and `StepManifest`. Pure: no sockets, no clock, no
Redis, no torch. Every core rank holds an identical copy and feeds it the same events in the same
order (events are gathered over the core's existing process group at each step boundary), so all
ranks freeze the same manifest without a coordinator in the data path.

    AdmitHybrid ─▶ JOINING ──connected, model built──▶ (boundary: snapshot taken) SNAPSHOT ──loaded──▶
        (each boundary: the steps since streamed to it; it replays them and reports caught_up)
        ──caught up to the step before a boundary──▶ ACTIVE from that step ──ReleaseHybrid──▶ RELEASED
    any failure (connect timeout, snapshot write/fetch, missed deadline, lost connection) ─▶ FAILED

Changes only take effect at `freeze(step)`: the manifest of a step never changes once frozen.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field


class HybridState(str, enum.Enum):
    JOINING = "JOINING"
    SNAPSHOT = "SNAPSHOT"
    ACTIVE = "ACTIVE"
    RELEASED = "RELEASED"
    FAILED = "FAILED"


GONE = (HybridState.RELEASED, HybridState.FAILED)


@dataclass
class HybridRecord:
    replica_id: str
    generation: int
    dp_rank: int
    state: HybridState = HybridState.JOINING
    reason: str = ""
    connected: bool = False
    prepared: bool = False
    snapshot_step: int = -1  # committed steps in the snapshot (-1: none yet)
    loaded: bool = False
    caught_up_step: int = -1  # the last step the hybrid has replayed (its state = the core's after it)
    catch_up_boundaries: int = 0  # boundaries spent streaming kept gradients to it
    release_requested: bool = False
    rolled_back: bool = False  # a FAILED replica's files and retained gradients are dropped once
    active_from_step: int = 0
    admitted_step: int = 0
    updated_step: int = 0


@dataclass(frozen=True)
class StepManifest:
    """Who trains step `step`: the D core ranks and the active hybrids, each on a core DP rank."""

    step: int
    epoch: int
    core_ranks: int
    hybrids: tuple[tuple[str, int], ...] = ()  # (replica_id, dp_rank), sorted by replica id

    @property
    def replicas(self) -> int:
        return self.core_ranks + len(self.hybrids)

    def hybrids_of(self, dp_rank: int) -> list[str]:
        return [replica for replica, rank in self.hybrids if rank == dp_rank]

    @property
    def active_ids(self) -> list[str]:
        return [f"core-{r}" for r in range(self.core_ranks)] + [replica for replica, _ in self.hybrids]


@dataclass(frozen=True)
class Action:
    """What the owning core rank must do at a boundary: snapshot, catch_up, activate, bye or drop.

    `snapshot_step`: for snapshot, the committed steps it holds; for catch_up, the last step the
    hybrid has confirmed (the owning rank streams the steps after what it already sent).
    """

    kind: str
    replica_id: str
    dp_rank: int
    snapshot_step: int = -1


@dataclass
class Membership:
    """The replicated state machine. `apply` events between boundaries, `freeze` at a boundary."""

    core_ranks: int
    epoch: int = 0
    catch_up_patience: int = 8  # boundaries of streamed catch-up before activating with one wait
    records: dict[str, HybridRecord] = field(default_factory=dict)
    _active_set: tuple[tuple[str, int], ...] = ()

    # -- events (every core rank applies the same list, in the same order) ---------------------
    def apply(self, event: dict, step: int) -> None:
        kind, replica = event["kind"], event["replica_id"]
        record = self.records.get(replica)
        if kind == "admit":
            if record is not None and record.state not in GONE:
                return  # already admitted: a replay
            self.records[replica] = HybridRecord(replica, int(event.get("generation", 0)), self._least_loaded(),
                                                 admitted_step=step, updated_step=step)
            return
        if record is None or record.state in GONE:
            return  # events of a replica that left (late socket news) change nothing
        record.updated_step = step
        if kind == "release":
            record.release_requested = True
        elif kind == "connected":
            record.connected = True
        elif kind == "prepared":  # the hybrid built its model and optimizer: ready for a snapshot
            record.prepared = True
        elif kind == "loaded":
            if record.state == HybridState.SNAPSHOT and event.get("step") == record.snapshot_step:
                record.loaded, record.caught_up_step = True, record.snapshot_step
        elif kind == "caught_up":  # late reports (after activation) change nothing
            if record.state == HybridState.SNAPSHOT and record.loaded:
                record.caught_up_step = max(record.caught_up_step, int(event["step"]))
        elif kind == "failed":
            record.state, record.reason = HybridState.FAILED, str(event.get("reason", "failed"))
        else:
            raise ValueError(f"unknown or out-of-order membership event {event}")

    def _least_loaded(self) -> int:
        load = [0] * self.core_ranks
        for record in self.records.values():
            if record.state not in GONE:
                load[record.dp_rank] += 1
        return min(range(self.core_ranks), key=lambda r: (load[r], r))

    # -- the boundary --------------------------------------------------------------------------
    def freeze(self, step: int) -> tuple[StepManifest, list[Action]]:
        """The manifest of `step` (steps 1, 2, …) and the actions due before it runs."""
        actions: list[Action] = []
        for record in sorted(self.records.values(), key=lambda r: r.replica_id):
            actions.extend(self._advance(record, step))
        active = tuple((r.replica_id, r.dp_rank) for r in sorted(self.records.values(), key=lambda r: r.replica_id)
                       if r.state == HybridState.ACTIVE)
        if active != self._active_set:
            self.epoch += 1
            self._active_set = active
        return StepManifest(step, self.epoch, self.core_ranks, active), actions

    def _advance(self, record: HybridRecord, step: int) -> list[Action]:
        def act(kind: str) -> list[Action]:
            return [Action(kind, record.replica_id, record.dp_rank, record.snapshot_step)]

        if record.state == HybridState.FAILED and not record.rolled_back:
            record.rolled_back = True  # the rollback runs once, at the first boundary after failing
            return act("drop")
        if record.state in GONE:
            return []
        if record.release_requested:
            record.state, record.updated_step = HybridState.RELEASED, step
            return act("bye")
        if record.state == HybridState.JOINING and record.connected and record.prepared:
            record.state, record.snapshot_step, record.updated_step = HybridState.SNAPSHOT, step - 1, step
            return act("snapshot")
        if record.state == HybridState.SNAPSHOT and record.loaded:
            # At most one step behind: that one goes with `active`, no wait. Still behind after
            # `catch_up_patience` boundaries (a channel slower than the core's gradient rate): activate
            # anyway; the core then waits once, in that step, for the hybrid to replay the rest.
            if record.caught_up_step >= step - 2 or record.catch_up_boundaries >= self.catch_up_patience:
                record.state, record.active_from_step, record.updated_step = HybridState.ACTIVE, step, step
                return [Action("activate", record.replica_id, record.dp_rank, record.caught_up_step)]
            record.catch_up_boundaries += 1
            return [Action("catch_up", record.replica_id, record.dp_rank, record.caught_up_step)]
        return []

    def hybrid(self, replica_id: str) -> HybridRecord | None:
        return self.records.get(replica_id)

    # -- persistence (Redis blob) ---------------------------------------------------------------
    def to_json(self) -> bytes:
        records = [{**asdict(r), "state": r.state.value} for r in self.records.values()]
        return json.dumps({"core_ranks": self.core_ranks, "epoch": self.epoch, "records": records,
                           "catch_up_patience": self.catch_up_patience,
                           "active": [list(a) for a in self._active_set]}).encode()

    @classmethod
    def from_json(cls, payload: bytes, restarted: bool = True) -> Membership:
        """Restore; with `restarted`, hybrids that were in flight lost their connection: FAILED."""
        data = json.loads(payload)
        membership = cls(int(data["core_ranks"]), int(data["epoch"]), int(data.get("catch_up_patience", 8)))
        for raw in data["records"]:
            record = HybridRecord(**{**raw, "state": HybridState(raw["state"])})
            if restarted and record.state not in GONE:
                record.state, record.reason = HybridState.FAILED, "the trainer restarted; re-admit the replica"
                record.rolled_back = True  # nothing to roll back: that state is gone with the trainer
            membership.records[record.replica_id] = record
        membership._active_set = tuple(tuple(a) for a in data.get("active", []))  # type: ignore[misc]
        return membership
