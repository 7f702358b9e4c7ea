"""The core rank's side of the hybrid pool: the gradient hook, joins, catch-up, failures.

Owns, on one core data-parallel rank: its lane endpoint, its replica of the membership state
machine, the step boundary (events in, manifest out, join/leave actions), and the `GradientHook`
the training backend calls. Must not know: Redis, gRPC, how batches are assembled.

One step on core rank r (the step's arithmetic — totals, ÷ W, the rescale for a hybrid that
missed the deadline — is `gradient_hook.train_step`, the same for every backend):

    begin_step(k)   gather every rank's events over the existing group (all_gather_object: no new
                    group), apply them in rank order, freeze manifest k, run this rank's actions
                    (snapshot / catch-up / bye / drop)
    assign(slices)  this step's slices of the hybrids (the widened batch, split by work.split)
    train_step      share ─▶ start: step frames to r's hybrids ─▶ (local backward) ─▶ inject: + each
                    hybrid's gradient, or its loss tokens as missing (deadline, lockstep check)
                    ─▶ (data-parallel sum, ÷ W) ─▶ deliver: the final gradient to r's hybrids
                    (they clip + step like the core), kept for hybrids still catching up

Join (snapshot + catch-up): at the boundary before step k the owning rank copies model and
optimizer (state after k−1 steps) and writes shards in a thread while steps k, k+1, … run; it keeps
each later step's final gradient (on its device). Once the hybrid has loaded the snapshot, the kept
gradients are streamed to it in order (a sender thread; each new step's as soon as it ends) and it
replays them (same gradient, same clip, same AdamW step ⇒ bitwise the same state), reporting
`caught_up`. At the first boundary b where it is at most one step behind, the last gradient (if
any) and `active` are sent and it trains from step b: activation costs the core no wait beyond one
gradient transfer.
"""

from __future__ import annotations

import collections
import os
import shutil
import threading
import time
from typing import Any, Callable

from libra import log as liblog
from libra.errors import FailedPrecondition
from libra.services.trainer import world
from libra.services.trainer.backend import TrainBatch
from libra.services.trainer.elastic import backends
from libra.services.trainer.elastic import snapshot as snap
from libra.services.trainer.elastic.checks import bad_gradient, param_digest
from libra.services.trainer.elastic.device_channel import model_device
from libra.services.trainer.elastic.manifest import Action, HybridState, Membership, StepManifest
from libra.services.trainer.elastic.side_channel import CLOSED, LaneEndpoint
from libra.services.trainer.elastic.work import slice_to_wire
from libra.services.trainer.gradient_hook import GradientHook, HybridGradients, HybridShare

_log = liblog.get("libra.trainer.elastic")
MANIFEST_HISTORY = 64


class ElasticCore(GradientHook):
    """One core rank's elastic state. Driver calls: begin_step → assign → backend.train_step → end_step."""

    def __init__(self, backend: Any, *, dp_rank: int = 0, core_ranks: int = 1, snapshot_root: str,
                 host: str = "127.0.0.1", port: int = 0, grad_deadline_s: float = 60.0,
                 join_timeout_s: float = 120.0, snapshot_shards: int = 4, max_catch_up_steps: int = 64,
                 catch_up_patience: int = 8, channel: str | None = None,
                 verify_lockstep: bool = False,
                 membership: Membership | None = None, clock: Callable[[], float] = time.monotonic,
                 after_shard: Callable[[int], None] | None = None):
        self.backend = backend
        self.dp_rank, self.core_ranks = dp_rank, core_ranks
        self.snapshot_root = snapshot_root
        self.grad_deadline_s, self.join_timeout_s = grad_deadline_s, join_timeout_s
        self.snapshot_shards, self.max_catch_up_steps = snapshot_shards, max_catch_up_steps
        self.clock, self.after_shard = clock, after_shard
        # Each hybrid sends a hash of its parameters with its gradient; a mismatch fails it
        # (costs one pass over the parameters per step on both sides; meant for tests and debugging).
        self.verify_lockstep = verify_lockstep
        self._digest = ""
        self.membership = membership or Membership(core_ranks, catch_up_patience=catch_up_patience)
        # channel: how bulk tensors travel (auto | tcp | group; default trainer.elastic.channel).
        channel = channel or getattr(getattr(backend.config, "elastic", None), "channel", "auto")
        self.endpoint = LaneEndpoint(host, port, send_timeout_s=grad_deadline_s, channel=channel,
                                     device=lambda: model_device(backend.model))
        self.lane_endpoints = _all_gather(self.endpoint.address)  # one collective, once, at start
        self.manifest: StepManifest | None = None
        self.history: collections.OrderedDict[int, tuple[StepManifest, set[str]]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._events: list[dict] = []  # control events (admit/release) and local news, for the next boundary
        self._first_seen: dict[str, float] = {}
        self._slices: dict[str, TrainBatch] = {}
        self._retained: dict[int, tuple[Any, dict[str, Any]]] = {}  # step -> (final gradient, config)
        self.step_timings: dict[str, float] = {}
        self._snapshots: dict[str, str] = {}
        self._sent_upto: dict[str, int] = {}  # last kept gradient queued to each catching-up hybrid
        self._prepare_sent: set[str] = set()
        self._contributors: list[str] = []
        self._acks: set[str] = set()
        self._step_started = 0.0
        self._failing: set[str] = set()
        self.failures: list[tuple[int, str, str]] = []  # (step, replica, reason), for tests and logs

    # -- control (thread-safe; the servicer calls these) ----------------------------------------
    def refusal(self) -> str | None:
        """Why this core cannot take hybrids (a backend layout such as Megatron TP/PP > 1), or None."""
        return getattr(self.backend, "hybrid_refusal", lambda: None)()

    def admit(self, replica_id: str, generation: int = 0) -> None:
        refusal = self.refusal()
        if refusal:
            raise FailedPrecondition(f"cannot admit hybrid {replica_id}: {refusal}")
        self._failing.discard(replica_id)  # a re-admitted replica may fail again
        self._first_seen.pop(replica_id, None)
        self._add_event({"kind": "admit", "replica_id": replica_id, "generation": generation})

    def release(self, replica_id: str, generation: int = 0) -> None:
        self._add_event({"kind": "release", "replica_id": replica_id, "generation": generation})

    def _add_event(self, event: dict) -> None:
        with self._lock:
            self._events.append(event)

    def _fail(self, replica_id: str, reason: str) -> None:
        if replica_id in self._failing:
            return  # the first reason wins (a missed deadline is followed by a closed socket)
        self._failing.add(replica_id)
        step = self.manifest.step if self.manifest else 0
        self.failures.append((step, replica_id, reason))
        _log.warning("hybrid failed", replica=replica_id, step=step, reason=reason)
        self._add_event({"kind": "failed", "replica_id": replica_id, "reason": reason})

    # -- the boundary ------------------------------------------------------------------------
    def begin_step(self, step: int) -> StepManifest:
        """Freeze the manifest of `step` (collective over the core ranks when D > 1)."""
        self.step_timings = {}  # seconds this step spent in start / inject / deliver (benchmarks read them)
        local = self._local_events()
        gathered = _all_gather(local)
        for rank_events in gathered:
            for event in rank_events:
                if event["kind"] == "ack":
                    self._record_ack(event["step"], event["replica_id"])
                else:
                    self.membership.apply(event, step)
        self._send_prepare()
        manifest, actions = self.membership.freeze(step)
        self.manifest = manifest
        self.history[step] = (manifest, {f"core-{r}" for r in range(self.core_ranks)})
        while len(self.history) > MANIFEST_HISTORY:
            self.history.popitem(last=False)
        for action in actions:
            if action.dp_rank == self.dp_rank:
                self._perform(action, step)
        self._slices, self._contributors = {}, []
        return manifest

    def _local_events(self) -> list[dict]:
        for replica, frame in self.endpoint.control_frames():
            record = self.membership.hybrid(replica)
            if frame.kind in ("prepared", "loaded", "caught_up"):
                self._add_event({"kind": frame.kind, "replica_id": replica, "step": frame.header.get("step")})
            elif frame.kind == "join_failed":
                self._fail(replica, f"join failed on the hybrid: {frame.header.get('reason', '')}")
            elif frame.kind == CLOSED and record is not None and record.state not in (HybridState.RELEASED,
                                                                                       HybridState.FAILED):
                self._fail(replica, "the hybrid's connection closed")
        now = self.clock()
        for record in self.membership.records.values():
            if record.dp_rank != self.dp_rank or record.state != HybridState.JOINING:
                continue
            if self.endpoint.link(record.replica_id) is not None and not record.connected:
                self._add_event({"kind": "connected", "replica_id": record.replica_id})
            first = self._first_seen.setdefault(record.replica_id, now)
            if now - first > self.join_timeout_s:  # never connected, or never built its model
                self._fail(record.replica_id, f"the hybrid did not connect and build its model within "
                                              f"{self.join_timeout_s} s (join_timeout_s)")
        with self._lock:
            events, self._events = self._events, []
        for replica in self._acks:
            events.append({"kind": "ack", "replica_id": replica, "step": self.manifest.step if self.manifest else 0})
        self._acks = set()
        return events

    def _record_ack(self, step: int, replica_id: str) -> None:
        if step in self.history:
            self.history[step][1].add(replica_id)

    def _perform(self, action: Action, step: int) -> None:
        replica = action.replica_id
        if action.kind == "snapshot":
            self._start_snapshot(replica, action.snapshot_step)
        elif action.kind in ("catch_up", "activate"):
            self._stream(replica, action.snapshot_step, step - 1)
            if action.kind == "activate":
                self._activate(replica, step)
        elif action.kind == "bye":
            self.endpoint.send(replica, "bye", {"step": step})
            self._forget(replica)
        elif action.kind == "drop":
            reason = self.membership.records[replica].reason
            self.endpoint.send(replica, "error", {"reason": reason})
            self._forget(replica)
        self._trim_retained()

    def _send_prepare(self) -> None:
        """Tell each newly connected joining hybrid of this rank what to build (`backends.prepare_meta`:
        backend kind, model dir, config, and the flat-gradient layout it must match).

        It builds model and optimizer (seconds: imports, weights) and answers `prepared`; the
        snapshot is taken only after that, so the catch-up starts from a state that is fresh.
        """
        for record in self.membership.records.values():
            replica = record.replica_id
            if (record.dp_rank == self.dp_rank and record.state == HybridState.JOINING
                    and replica not in self._prepare_sent and self.endpoint.link(replica) is not None):
                if self.endpoint.send(replica, "prepare", backends.prepare_meta(self.backend)):
                    self._prepare_sent.add(replica)

    def _start_snapshot(self, replica: str, snapshot_step: int) -> None:
        captured = snap.capture(self.backend, snapshot_step)
        directory = os.path.join(self.snapshot_root, f"{replica}-step{snapshot_step}")
        shutil.rmtree(directory, ignore_errors=True)
        self._snapshots[replica] = directory
        meta = backends.prepare_meta(self.backend)

        started = time.perf_counter()

        def done(path: str) -> None:
            _log.info("snapshot written", replica=replica, step=snapshot_step,
                      seconds=round(time.perf_counter() - started, 3))
            if not self.endpoint.send(replica, "snapshot", {"path": path, "step": snapshot_step}):
                self._fail(replica, "the hybrid's connection closed before the snapshot was ready")

        snap.write_async(captured, directory, self.snapshot_shards, meta, done,
                         lambda reason: self._fail(replica, reason), self.after_shard)
        _log.info("snapshot started", replica=replica, step=snapshot_step, path=directory)

    def _stream(self, replica: str, confirmed: int, through: int) -> None:
        """Queue the kept gradients of the steps the hybrid has not been sent yet, through `through`.

        Asynchronous (the link's outbox thread sends them in order): the core keeps stepping while
        the hybrid replays, and reports `caught_up`; `deliver` streams each new step as it ends.
        """
        first = max(confirmed, self._sent_upto.get(replica, confirmed)) + 1
        missing = [s for s in range(first, through + 1) if s not in self._retained]
        if missing:
            self._fail(replica, f"catch-up gradients of steps {missing} are not kept (the join took too long)")
            return
        for past in range(first, through + 1):
            flat, config = self._retained[past]
            if not self.endpoint.send_async(replica, "catch_up", {"step": past, "config": config}, flat):
                self._fail(replica, "the hybrid's connection closed during catch-up")
                return
        self._sent_upto[replica] = max(through, self._sent_upto.get(replica, -1))

    def _activate(self, replica: str, step: int) -> None:
        # `send` waits for the streamed gradients to leave first: the hybrid replays them, then trains.
        if not self.endpoint.send(replica, "active", {"from_step": step}):
            self._fail(replica, "the hybrid's connection closed during catch-up")
            return
        self._sent_upto.pop(replica, None)
        directory = self._snapshots.pop(replica, None)
        if directory:  # the snapshot served this one join
            shutil.rmtree(directory, ignore_errors=True)
        _log.info("hybrid active", replica=replica, from_step=step)

    def _forget(self, replica: str) -> None:
        self._sent_upto.pop(replica, None)
        self._prepare_sent.discard(replica)
        self.endpoint.disconnect(replica)
        directory = self._snapshots.pop(replica, None)
        if directory:
            shutil.rmtree(directory, ignore_errors=True)

    def _catching_up(self) -> list[int]:
        """The last step each of this rank's joining hybrids holds (kept gradients start after it)."""
        return [max(r.snapshot_step, r.caught_up_step) for r in self.membership.records.values()
                if r.dp_rank == self.dp_rank and r.state == HybridState.SNAPSHOT]

    def _trim_retained(self) -> None:
        pending = self._catching_up()
        keep_from = min(pending) + 1 if pending else None
        for past in list(self._retained):
            if keep_from is None or past < keep_from:
                del self._retained[past]

    # -- the step ----------------------------------------------------------------------------
    def assign(self, slices: dict[str, TrainBatch]) -> None:
        """This step's slices; only those of this rank's active hybrids are kept."""
        if self.manifest is None:
            raise RuntimeError("ElasticCore.assign before begin_step")
        mine = self.manifest.hybrids_of(self.dp_rank)
        missing = [r for r in mine if r not in slices]
        if missing:
            raise ValueError(f"no slice for active hybrids {missing} of step {self.manifest.step}")
        self._slices = {r: slices[r] for r in mine}

    def share(self) -> HybridShare:
        return HybridShare(loss_tokens=float(sum(b.loss_tokens for b in self._slices.values())),
                           sequences=sum(len(b) for b in self._slices.values()), replicas=len(self._slices))

    def start(self, token_count: float, replicas: int, config: Any) -> None:
        self._step_started = self.clock()
        began = time.perf_counter()
        step = self.manifest.step if self.manifest else 0
        epoch = self.manifest.epoch if self.manifest else 0
        self._digest = param_digest(self.backend.model) if self.verify_lockstep and self._slices else ""
        for replica, batch in self._slices.items():
            header = {"step": step, "epoch": epoch, "token_count": token_count, "replicas": replicas,
                      "verify_lockstep": bool(self._digest),
                      "config": config.model_dump(mode="json"),
                      "slice": slice_to_wire(batch.sequences)}
            if not self.endpoint.send(replica, "step", header):
                self._fail(replica, "the hybrid's connection closed before its step")
        self.step_timings["start_s"] = time.perf_counter() - began

    def inject(self, flat_grad: Any) -> HybridGradients:
        began = time.perf_counter()
        missing_tokens, metrics = 0.0, collections.defaultdict(float)
        deadline = self._step_started + self.grad_deadline_s
        step = self.manifest.step if self.manifest else 0
        self._contributors = []
        for replica, batch in self._slices.items():
            frame = self.endpoint.wait_grad(replica, deadline - self.clock())
            reason = bad_gradient(frame, step, flat_grad.numel(), self.grad_deadline_s, self._digest)
            if reason:
                self._fail(replica, reason)
                self.endpoint.disconnect(replica)
                missing_tokens += batch.loss_tokens
                continue
            flat_grad += frame.tensor().to(flat_grad.device, flat_grad.dtype)
            for name, value in frame.header.get("metrics", {}).items():
                metrics[name] += float(value)
            self._contributors.append(replica)
        self.step_timings["inject_s"] = time.perf_counter() - began
        return HybridGradients(missing_tokens, dict(metrics))

    def deliver(self, reduced_grad: Any, config: Any) -> None:
        began = time.perf_counter()
        step = self.manifest.step if self.manifest else 0
        for replica in self._contributors:
            if self.endpoint.send(replica, "reduced", {"step": step}, reduced_grad):
                self._acks.add(replica)
            else:
                self._fail(replica, "the hybrid's connection closed before the reduced gradient")
        self.step_timings["deliver_s"] = time.perf_counter() - began
        if self._catching_up():
            if len(self._retained) >= self.max_catch_up_steps:
                for record in list(self.membership.records.values()):
                    if record.dp_rank == self.dp_rank and record.state == HybridState.SNAPSHOT:
                        self._fail(record.replica_id, f"snapshot not loaded within {self.max_catch_up_steps} steps")
            else:  # kept on the gradient's device: a copy to the host per step would slow the core
                self._retained[step] = (reduced_grad.detach().clone(), config.model_dump(mode="json"))
                for record in self.membership.records.values():
                    if record.dp_rank == self.dp_rank and record.state == HybridState.SNAPSHOT and record.loaded:
                        self._stream(record.replica_id, record.caught_up_step, step)

    def end_step(self) -> None:
        """Record who acknowledged the step (kept in history; GetStepManifest shows it)."""
        if self.manifest is not None:
            for replica in self._acks:
                self._record_ack(self.manifest.step, replica)

    def close(self) -> None:
        self.endpoint.close()
        for directory in self._snapshots.values():
            shutil.rmtree(directory, ignore_errors=True)


def _all_gather(value: Any) -> list[Any]:
    """Every core rank's `value`, in rank order, over the default group (no group is created)."""
    import torch.distributed as dist

    if not world.distributed() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
