"""The weights group over gloo with real processes, and the trainer → gateway → workers path end to end.

- Bucketed broadcast: tensors of mixed dtypes and sizes (several span buckets) arrive equal to the
  source, twice over the same group (created once), in place into targets or into fresh tensors.
- A receiver that does not join a version: the sender aborts it before any transfer with an error
  naming the rank; the other receiver is told; the group stays usable for the next version.
- A receiver that dies mid-broadcast: the sender raises WeightSyncError and the group is broken.
- Generations on one store: a smaller generation replaces the first; a rendezvous the trainer
  cancels ends at once for it and for the rank that came (not at the timeout).
- The trainer's publisher (WeightPublisher) and the real gateway (RolloutService, WeightDelivery)
  with hf engines: the group follows the workers through a drain, a start, a worker that misses a
  version (loaded from disk, written on demand; else unhealthy, out of routing, caught up at the
  next version) and a dead worker, always without waiting for the sync timeout; the disk copy
  stays off the critical path (written in the background) unless a worker needs it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from libra.errors import FailedPrecondition
from libra.redis_server import free_port
from libra.weights.group import Layout, WeightSyncError, WeightsGroup, open_store, plan_layout

pytestmark = pytest.mark.slow


def _tensors(version: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(version)
    out = {}
    for i, (shape, dtype) in enumerate([((300, 7), torch.float32), ((5,), torch.bfloat16), ((1, 1), torch.float16),
                                        ((64, 33), torch.bfloat16), ((3, 1000), torch.float32), ((2,), torch.int64)]):
        out[f"layer{i}.weight"] = (torch.randn(shape, generator=generator) * 100).to(dtype)
    return out


def _rank_main(rank: int, port: int, out_dir: str, scenario: str) -> None:
    import torch

    # direct_bytes=10000: the biggest tensor goes on its own, the rest through 4 KiB buckets (some span several)
    group = WeightsGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=5, bucket_bytes=4096, direct_bytes=10000)
    outcome: dict = {}
    try:
        for version in (1, 2):
            source = _tensors(version)
            skip = scenario == "miss" and rank == 2 and version == 1
            if rank == 0:
                try:
                    report = group.send(source.items(), version, join_timeout_s=3 if scenario == "miss" else None)
                    outcome[version] = {"buckets": report.buckets, "receivers": sorted(report.receivers)}
                except (WeightSyncError, FailedPrecondition) as error:
                    outcome[version] = {"error": str(error), "broken": group.broken}
            elif skip:
                outcome[version] = "skipped"
            else:
                targets = {k: torch.zeros_like(t) for k, t in source.items()} if rank == 1 else None
                try:
                    received = {}
                    for name, tensor in group.receive(version, targets):
                        received[name] = tensor
                        if scenario == "die" and rank == 2:
                            os._exit(3)  # a crash mid-broadcast
                    outcome[version] = {"equal": all(torch.equal(received[k], t) for k, t in source.items()),
                                        "in_place": targets is not None and all(received[k] is targets[k] for k in source)}
                except WeightSyncError as error:
                    outcome[version] = {"error": str(error)}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def _spawn(tmp_path: Path, scenario: str) -> dict[int, dict]:
    import torch.multiprocessing as mp

    context = mp.start_processes(_rank_main, args=(free_port(), str(tmp_path), scenario), nprocs=3,
                                 join=False, start_method="spawn")
    for process in context.processes:
        process.join(timeout=90)
    outcomes = {}
    for rank in range(3):
        path = tmp_path / f"rank{rank}.json"
        outcomes[rank] = json.loads(path.read_text()) if path.exists() else None
    return outcomes


def test_layout_cuts_tensors_into_aligned_buckets():
    import torch

    layout = plan_layout([("a", torch.zeros(5)), ("b", torch.zeros(40, dtype=torch.bfloat16))], 4, 32)
    assert [(s.offset, s.nbytes) for s in layout.slots] == [(0, 20), (32, 80)]  # b starts 16-byte aligned
    assert layout.num_buckets == 4 and Layout.from_json(layout.to_json()) == layout
    assert [(s.name, a, b) for s, a, b in layout.overlapping(1)] == [("b", 32, 64)]
    mixed = plan_layout([("a", torch.zeros(5)), ("big", torch.zeros(100)), ("b", torch.zeros(40, dtype=torch.bfloat16))],
                        4, 32, direct_bytes=400)
    assert [s.name for s in mixed.direct_slots] == ["big"] and mixed.total_bytes == 20 + 400 + 80
    assert mixed.stream_bytes == 112 and mixed.num_buckets == 4 and Layout.from_json(mixed.to_json()) == mixed
    assert "big" not in {s.name for bucket in range(4) for s, _, _ in mixed.overlapping(bucket)}
    with pytest.raises(ValueError, match="appears twice"):
        plan_layout([("a", torch.zeros(1)), ("a", torch.zeros(1))], 1, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        plan_layout([("a", torch.zeros(1))], 1, 10)


def test_bucketed_broadcast_equals_the_source(tmp_path):
    outcomes = _spawn(tmp_path, "ok")
    for version in ("1", "2"):
        assert outcomes[0][version]["buckets"] == 4 and outcomes[0][version]["receivers"] == [1, 2]
        assert outcomes[1][version] == {"equal": True, "in_place": True}
        assert outcomes[2][version] == {"equal": True, "in_place": False}


def test_a_receiver_that_misses_a_version_is_named_and_the_group_survives(tmp_path):
    outcomes = _spawn(tmp_path, "miss")
    assert "ranks [2] did not join version 1" in outcomes[0]["1"]["error"] and not outcomes[0]["1"]["broken"]
    assert "aborted" in outcomes[1]["1"]["error"]
    assert outcomes[0]["2"]["receivers"] == [1, 2]  # the next version reaches everyone
    assert outcomes[1]["2"]["equal"] and outcomes[2]["2"]["equal"]


def test_a_receiver_that_dies_mid_broadcast_breaks_the_group(tmp_path):
    outcomes = _spawn(tmp_path, "die")
    assert outcomes[2] is None or outcomes[2] == {}  # it died before writing its outcome
    error = outcomes[0]["1"]
    assert "weights group failed" in error["error"] and error["broken"]
    assert "the weights group is broken" in outcomes[0]["2"]["error"]  # until it is rebuilt


def _generations_main(rank: int, port: int, out_dir: str) -> None:
    """Generation 1: ranks 0-2. Generation 2: ranks 0-1 (rank 2 closed 1 and left). Generation 3:
    world 3 again, but rank 2 never comes and the trainer cancels after 1 s (timeout 60 s)."""
    import torch

    outcome: dict = {}
    store = open_store("127.0.0.1", port, True, 60) if rank == 0 else None
    try:
        first = WeightsGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=60, generation=1, store=store)
        if rank == 0:
            first.send(_tensors(1).items(), 1)
        else:
            outcome["g1"] = all(torch.equal(t, _tensors(1)[n]) for n, t in first.receive(1))
        first.close()
        if rank == 2:
            return
        second = WeightsGroup("127.0.0.1", port, rank, 2, "gloo", timeout_s=60, generation=2, store=store)
        if rank == 0:
            outcome["g2_receivers"] = sorted(second.send(_tensors(2).items(), 2).receivers)
        else:
            outcome["g2"] = all(torch.equal(t, _tensors(2)[n]) for n, t in second.receive(2))
        second.close()
        cancel = threading.Event()
        if rank == 0:
            threading.Timer(1.0, cancel.set).start()
        started = time.monotonic()
        try:
            WeightsGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=60, generation=3, store=store, cancel=cancel)
        except WeightSyncError as error:
            outcome["g3"] = {"error": str(error), "seconds": time.monotonic() - started}
        if rank == 0:
            time.sleep(1.0)  # the store lives as long as the trainer: let the worker read the abort
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))


def test_generations_replace_each_other_and_a_cancelled_rendezvous_ends_at_once(tmp_path):
    import torch.multiprocessing as mp

    context = mp.start_processes(_generations_main, args=(free_port(), str(tmp_path)), nprocs=3, join=False,
                                 start_method="spawn")
    for process in context.processes:
        process.join(timeout=90)
    trainer, worker, gone = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3))
    assert worker["g1"] and gone["g1"] and worker["g2"] and trainer["g2_receivers"] == [1]
    assert "2] did not join generation 3 before the receivers were done (cancelled)" in trainer["g3"]["error"]
    assert "the trainer gave up on generation 3" in worker["g3"]["error"]
    assert trainer["g3"]["seconds"] < 10 and worker["g3"]["seconds"] < 10  # cancelled, not the 60 s timeout


# ---- the trainer, the gateway and hf engines --------------------------------------------------------
@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from tests.fixtures_model import two_weight_sets

    return two_weight_sets(tmp_path_factory.mktemp("weights"))


class InProcessRollout:
    """The trainer's rollout stub, answered by a real RolloutService in this process."""

    def __init__(self, service):
        self.service = service
        self.requests: list = []  # every UpdateWeights request, in order

    async def UpdateWeights(self, request, timeout=None):
        from libra.v1 import rollout_pb2
        from libra.weights.roster import GroupRecord

        self.requests.append(request)
        group = GroupRecord.from_proto(request.group) if request.HasField("group") else None
        done = await self.service.update_weights(request.version, request.path, group)
        return rollout_pb2.UpdateWeightsResponse(version=request.version, acks=done.acks,
                                                 serving=done.serving.to_proto(), group_unusable=done.group_unusable)


class Membership:
    """Records which workers the gateway puts into routing and takes out of it."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    async def join(self, worker) -> None:
        self.events.append(("join", worker.worker_id))

    async def leave(self, worker, reason: str) -> None:
        self.events.append(("leave", worker.worker_id))


class Spy:
    """Counts how each version reaches one worker; on demand loses its receive answers or fails its loads."""

    def __init__(self, client):
        from libra.services.rollout.engines.client import EngineError

        self.calls: list[tuple[str, int]] = []
        self.lose_receive = self.fail_load = False
        post, load = client._post, client.load_weights

        async def spied_post(path, body, timeout=None):
            answer = await post(path, body, timeout)
            if body.get("method") == "libra_receive_weights":
                self.calls.append(("group", int(body["args"][0])))
                if self.lose_receive:
                    raise EngineError("injected: the answer of the receive was lost")
            return answer

        async def spied_load(path, version):
            self.calls.append(("disk", int(version)))
            if self.fail_load:
                raise EngineError("injected: the load failed in transport")
            return await load(path, version)

        client._post, client.load_weights = spied_post, spied_load

    def routes(self, version: int) -> list[str]:
        return [route for route, v in self.calls if v == version]


def test_the_group_follows_the_workers_and_a_worker_that_misses_a_version_leaves_routing_until_it_catches_up(
        weights, tmp_path, store, run_id, arun):
    from libra.config import RunConfig
    from libra.errors import Unavailable
    from libra.plans import Bucket, Plan
    from libra.services.rollout.server import RolloutService
    from libra.services.trainer.publisher import WeightPublisher
    from libra.services.trainer.torch_backend import TorchBackend
    from libra.v1 import common_pb2
    from libra.weights.roster import BLOB, Roster
    from tests.service.test_engine_contract import PROMPT, trainer_logprobs

    timeout_s = 20.0  # a version that waited for the sync timeout would show
    config = RunConfig.model_validate({
        "run_id": run_id, "run_dir": str(tmp_path / "run"),
        "rollout": {"worker": {"engine": "hf", "max_model_len": 256, "base_port": 0}},
        "weights": {"type": "group", "bucket_mb": 1, "address": f"127.0.0.1:{free_port()}",
                    "sync_timeout_s": timeout_s}})
    backend = TorchBackend(config.trainer)
    gateway = RolloutService(config)
    gateway.store, gateway.membership = store, Membership()
    rollout = InProcessRollout(gateway)
    publisher = WeightPublisher(config, backend, store, rollout)
    pool, spies = gateway.pool, {}

    async def start(replicas: int) -> None:
        """What StartWorkers does: new workers on the newest version on disk."""
        await publisher.settle()
        latest = await store.latest_on_disk()
        for worker in await gateway._start_plan(Plan(0, None, (Bucket("short", 1, 100, replicas),)),
                                                latest.path, latest.version):
            spies[worker.worker_id] = Spy(worker.client)

    async def publish(version: int, source: str):
        """What the trainer does for a new version after a step."""
        backend.load(str(weights[source]))
        report = await publisher.publish(version)
        assert report.seconds < timeout_s / 2, f"v{version} took {report.seconds:.1f}s: it waited for the sync timeout"
        return report

    async def generation() -> tuple[int, list[str]]:
        record = await store.blob_record(BLOB)
        return record.generation, json.loads(record.payload)["workers"]

    async def serves(worker_id: str, source: str) -> None:
        worker = pool.workers[worker_id]
        assert await worker.client.policy_version() == worker.version  # what it reports is what it holds
        turn = await worker.client.generate(PROMPT, 8, temperature=0.0)
        assert turn.logprobs == pytest.approx(trainer_logprobs(weights[source], PROMPT, turn.token_ids), abs=2e-4)

    async def scenario() -> None:
        backend.load(str(weights["base"]))
        assert await publisher.record(1) == str(tmp_path / "run" / "weights" / "v1")  # on disk: workers start on it
        await start(2)
        await publisher.deliver(1)  # both hold v1 already: nothing moves; the reply names the roster
        assert spies["short-0"].calls == spies["short-1"].calls == []
        assert publisher.roster == Roster.of([("short-0", 1), ("short-1", 1)])
        report = await publish(2, "sharp")  # the first version over the group forms generation 1
        assert await generation() == (1, [["short-0", 1], ["short-1", 1]])
        assert spies["short-0"].routes(2) == spies["short-1"].routes(2) == ["group"]
        assert report.workers_updated == 2 and report.send_seconds > 0 and report.rpc_seconds > 0
        # the disk copy is off the critical path: nothing written before the reply, the path comes after
        assert report.write_seconds == 0 and not rollout.requests[-1].path
        await serves("short-0", "sharp")
        await publisher.settle()
        assert await store.weights_path(2) == str(tmp_path / "run" / "weights" / "v2")

        # (a) the layout changes: a drain, then a start; each time a new generation, no timeout
        await gateway.drain_worker("short-1", 5)
        await publish(3, "base")  # the trainer's roster was stale: generation 1 is refused, 2 formed at once
        assert await generation() == (2, [["short-0", 1]]) and spies["short-0"].routes(3) == ["group"]
        assert [r.group.generation for r in rollout.requests[-2:]] == [1, 2]
        await serves("short-0", "base")
        await start(1)  # short-2, on v3 (written in the background)
        assert pool.version_of("short-2") == 3
        report = await publish(4, "sharp")  # short-2 is no rank of generation 2: v4 is written for it
        assert spies["short-0"].routes(4) == ["group"] and spies["short-2"].routes(4) == ["disk"]
        assert report.write_seconds > 0 and report.workers_updated == 2 and rollout.requests[-1].path
        await serves("short-2", "sharp")
        await publish(5, "base")  # and it is a rank of the next generation
        assert await generation() == (3, [["short-0", 1], ["short-2", 1]])
        assert spies["short-0"].routes(5) == spies["short-2"].routes(5) == ["group"]
        await serves("short-2", "base")

        # (b) short-2 misses a version in the group (its answer is lost): v6 is written, it loads it
        spies["short-2"].lose_receive = True
        await publish(6, "sharp")
        spies["short-2"].lose_receive = False
        assert spies["short-2"].routes(6) == ["group", "disk"] and pool.version_of("short-2") == 6
        assert spies["short-0"].routes(6) == ["group"] and (await generation())[0] == 3
        assert gateway.membership.events[-2:] == [("leave", "short-2"), ("join", "short-2")]  # out, and back
        await serves("short-2", "sharp")
        # ... and a version it cannot load at all: unhealthy, out of routing, still saying v6
        spies["short-2"].fail_load = True
        backend.load(str(weights["base"]))
        path = await publisher.record(7)  # over disk, as the trainer sends a version the group failed
        done = await gateway.update_weights(7, path)
        spies["short-2"].fail_load = False
        acks = {a.worker_id: a for a in done.acks}
        assert acks["short-0"].ok and not acks["short-2"].ok and "injected" in acks["short-2"].error
        assert acks["short-2"].version == 6 and pool.version_of("short-2") == 6
        assert pool.workers["short-2"].state == common_pb2.WORKER_STATE_UNHEALTHY
        assert gateway.membership.events[-1] == ("leave", "short-2") and done.serving == Roster.of([("short-0", 1)])
        await serves("short-2", "sharp")  # v6's weights, and it says v6
        with pytest.raises(Unavailable):
            await pool.generate("short-2", PROMPT, 4, 0, {"temperature": 0.0, "top_p": 1.0}, [])
        # the next version reaches it over the group (it is still a rank of generation 3): it serves again
        await publish(8, "sharp")
        assert (await generation())[0] == 3 and spies["short-2"].routes(8) == ["group"]
        assert pool.workers["short-2"].state == common_pb2.WORKER_STATE_SERVING
        assert gateway.membership.events[-1] == ("join", "short-2") and pool.version_of("short-2") == 8
        await serves("short-2", "sharp")

        # a member dies: nobody waits for it; the version goes on a generation without it at once
        victim = pool.workers["short-0"].process
        os.killpg(victim.process.pid, signal.SIGKILL)
        victim.process.wait(timeout=10)
        await publish(9, "base")
        assert await generation() == (4, [["short-2", 1]]) and spies["short-2"].routes(9) == ["group"]
        assert pool.workers["short-0"].state == common_pb2.WORKER_STATE_UNHEALTHY and pool.version_of("short-0") == 8
        await serves("short-2", "base")

    try:
        arun(scenario())
    finally:
        arun(publisher.close())
        arun(pool.stop_all())
