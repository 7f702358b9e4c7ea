"""Fuzz every RPC of every service: thousands of random and mutated requests, none may crash a
service, hang a call, or end INTERNAL (docs/operations.md, "Security", has the latest figures).

The planner, the scheduler and the elastic coordinator run for real (their cores validate what the
wire may ask); the trainer and the rollout gateway run their real servicers with the probes of
the RPC contract test (rpc_probes.py) behind them, as their real services need a model and engine
processes. All five sit behind the real gate with a token, on loopback ports, over a real Redis.
Every call has a deadline. Per call: the right token (90%), none or a wrong one (which must get
UNAUTHENTICATED); random bytes, a random message of the request type, a valid request with edge
values in one or two fields, or a valid request mutated byte by byte (fuzz_messages.py). Streams
(Scheduler.Session, Trainer.WatchSteps) may end by their deadline; a unary call may not.
Afterwards every service still answers its health check and no service's main task has died.

    LIBRA_FUZZ_COUNT=20000 LIBRA_FUZZ_SECONDS=600 LIBRA_FUZZ_SEED=1 .venv/bin/python -m pytest -q -s \
        tests/service/test_fuzz.py      # more by hand: count, time budget (s), seed
"""

from __future__ import annotations

import asyncio
import collections
import os
import time

import grpc
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc

from libra.redis_server import free_port
from libra.rpc import wire_services
from libra.runtime import RunningService
from libra.security import Security, install
from libra.security.credentials import HEALTH_SERVICE, REFLECTION_SERVICES
from libra.services.elastic.server import ElasticService
from libra.services.planner.server import PlannerService
from libra.services.scheduler.server import SchedulerService
from libra.v1 import common_pb2, planner_pb2, scheduler_pb2
from tests.service.fuzz_messages import Generator
from tests.service.helpers import run_config
from tests.service.rpc_probes import Harness
from tests.service.test_rpc_contract import SAMPLES

COUNT = int(os.environ.get("LIBRA_FUZZ_COUNT", "2000"))
WALL_S = float(os.environ.get("LIBRA_FUZZ_SECONDS", "60"))
SEED = int(os.environ.get("LIBRA_FUZZ_SEED", "0"))
IN_FLIGHT = 8
UNARY_DEADLINE_S, STREAM_DEADLINE_S = 15.0, 2.0
TOKEN = "fuzz-token-" + "5a" * 16
SECURITY = Security(TOKEN, open_services=frozenset({HEALTH_SERVICE, *REFLECTION_SERVICES}))
RPCS = [(service, method) for service in wire_services() for method in service.methods]
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS}
BAD = {code.name for code in FORBIDDEN}


def _seed(service, method, run_id: str) -> bytes:
    """A valid request of `method`: the contract test's sample, a small Preflight, else its run."""
    cls = GetMessageClass(method.input_type)
    name = f"{service.name}.{method.name}"
    if name in SAMPLES:
        return cls(meta=common_pb2.RequestMeta(request_id="seed", run_id=run_id), **SAMPLES[name]).SerializeToString()
    if name == "Planner.Preflight":
        trace = [planner_pb2.LengthSample(prompt_tokens=100 + i, output_tokens=50 + 10 * i) for i in range(8)]
        return cls(cluster_yaml=open("configs/hardware/h200-141g.yaml").read(), gpus=4, trace=trace,
                   model_yaml=open("configs/models/qwen3-4b.yaml").read()).SerializeToString()
    if name == "Scheduler.Session":
        return b""
    return cls(run_id=run_id).SerializeToString() if "run_id" in method.input_type.fields_by_name else b""


class Fleet:
    """The five services on loopback ports, behind the gate."""

    def __init__(self, redis_url: str, run_id: str, store, tmp_path):
        self.redis_url, self.run_id, self.store, self.tmp_path = redis_url, run_id, store, tmp_path
        self.services = {s.name: s for s in wire_services()}

    async def __aenter__(self) -> "Fleet":
        install(SECURITY)  # the coordinator's own channels (to the trainer and rollout probes) carry it
        self.probes = {}
        for name in ("Trainer", "Rollout"):
            self.probes[name] = await Harness(self.services[name], self.run_id, self.store, self.tmp_path,
                                              SECURITY).__aenter__()
        elastic_port = free_port()  # the planner sends the plans set by hand (SetPlan) to this coordinator
        config = run_config(self.redis_url, self.run_id, self.tmp_path,
                            elastic={"hybrid_command": [], "poll_interval_s": 0.5},
                            addresses={"trainer": f"127.0.0.1:{self.probes['Trainer'].port}",
                                       "rollout": f"127.0.0.1:{self.probes['Rollout'].port}",
                                       "elastic": f"127.0.0.1:{elastic_port}"},
                            security={"limits": {"preflight_timeout_s": 3}})
        self.running = {}
        for name, service, port in (("Planner", PlannerService(config), 0), ("Scheduler", SchedulerService(config), 0),
                                    ("ElasticCoordinator", ElasticService(config), elastic_port)):
            self.running[name] = await RunningService(service, port, "127.0.0.1", SECURITY).start()
        self.ports = {**{n: h.port for n, h in self.probes.items()}, **{n: r.port for n, r in self.running.items()}}
        self.channels = {n: grpc.aio.insecure_channel(f"127.0.0.1:{p}") for n, p in self.ports.items()}
        return self

    async def __aexit__(self, *exc) -> None:
        for chan in self.channels.values():
            await chan.close()
        for running in self.running.values():
            await running.stop()
        for harness in self.probes.values():
            await harness.__aexit__()
        install(None)


CLIENT_WRITE_AFTER_END = "Internal error from Core"
"""What grpc.aio reports (as INTERNAL) when a client streams a message after the server ended the
call (here: refused it); the server's own status is lost. Seen with a bare grpc.aio server too."""


SEARCH_LIMIT = "the preflight search ran past security.limits.preflight_timeout_s"


async def _one(chan: grpc.aio.Channel, method, payloads: list[bytes], metadata) -> str:
    """The status name a call ends with; a stream's in-band errors (Scheduler.Session's StreamError)
    count as the status they name."""
    path, same = f"/{method.containing_service.full_name}/{method.name}", (lambda data: data)
    streaming = method.client_streaming or method.server_streaming
    timeout = STREAM_DEADLINE_S if streaming else UNARY_DEADLINE_S
    try:
        if method.client_streaming:
            call = chan.stream_stream(path, request_serializer=same, response_deserializer=same)(
                iter(payloads), metadata=metadata, timeout=timeout)
            async for answer in call:
                errors = [a.error.code for a in scheduler_pb2.SchedulerBatch.FromString(answer).answers
                          if a.WhichOneof("body") == "error"]
                if any(code in {c.name for c in FORBIDDEN} for code in errors):
                    return f"IN_STREAM_{errors[0]}"
        elif method.server_streaming:
            call = chan.unary_stream(path, request_serializer=same, response_deserializer=same)(
                payloads[0], metadata=metadata, timeout=timeout)
            async for _ in call:
                pass
        else:
            await chan.unary_unary(path, request_serializer=same, response_deserializer=same)(
                payloads[0], metadata=metadata, timeout=timeout)
    except grpc.aio.AioRpcError as error:
        if method.client_streaming and error.code() == grpc.StatusCode.INTERNAL and \
                error.details() == CLIENT_WRITE_AFTER_END:
            return "CLIENT_WRITE_AFTER_END"
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (error.details() or "").startswith(SEARCH_LIMIT):
            return "SEARCH_TIME_LIMIT"  # the planner stopped its own search: a bound, not a hang
        return error.code().name
    return "OK"


async def fuzz(fleet: Fleet, count: int, wall_s: float, seed: int) -> dict:
    generate = Generator(seed, fleet.run_id)
    seeds = {(s.name, m.name): _seed(s, m, fleet.run_id) for s, m in RPCS}
    codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    kinds = collections.Counter()
    gate = asyncio.Semaphore(IN_FLIGHT)
    started = time.monotonic()

    def payload(service, method) -> tuple[str, bytes]:
        kind = generate.random.choices(("noise", "random", "tweaked", "mutated"), weights=(20, 30, 30, 20))[0]
        cls, seed_bytes = GetMessageClass(method.input_type), seeds[(service.name, method.name)]
        if kind == "noise":
            return kind, generate.noise()
        if kind == "random":
            return kind, generate.message(method.input_type, cls).SerializeToString()
        if kind == "tweaked":
            return kind, generate.tweak(cls, seed_bytes).SerializeToString()
        return kind, generate.mutate(seed_bytes)

    async def call(index: int) -> None:
        service, method = RPCS[index % len(RPCS)]
        auth = generate.random.choices(("right", "none", "wrong"), weights=(90, 5, 5))[0]
        metadata = {"right": (("authorization", f"Bearer {TOKEN}"),), "none": (),
                    "wrong": (("authorization", f"Bearer {TOKEN[::-1]}"),)}[auth]
        messages = generate.random.randint(1, 3) if method.client_streaming else 1
        shots = [payload(service, method) for _ in range(messages)]
        kinds.update(kind for kind, _ in shots)
        async with gate:
            code = await _one(fleet.channels[service.name], method, [data for _, data in shots], metadata)
        name = f"{service.name}.{method.name}"
        codes[name][code] += 1
        streaming = method.client_streaming or method.server_streaming
        if code in BAD or code.startswith("IN_STREAM_") or (code == "DEADLINE_EXCEEDED" and not streaming):
            failures.append(f"{name} ({'/'.join(k for k, _ in shots)}, token {auth}): {code}")
        elif auth != "right" and code not in ("UNAUTHENTICATED", "CLIENT_WRITE_AFTER_END"):
            failures.append(f"{name} with {auth} token answered {code}")

    sent, pending, done = 0, set(), set()
    while sent < count and time.monotonic() - started < wall_s:
        pending.add(asyncio.ensure_future(call(sent)))
        sent += 1
        if len(pending) >= IN_FLIGHT * 2:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            done |= finished
    if pending:
        done |= (await asyncio.wait(pending))[0]
    for task in done:
        task.result()  # a fault of the test itself (the generator) is raised, not lost
    return {"sent": sent, "seconds": time.monotonic() - started, "codes": codes, "failures": failures,
            "kinds": kinds}


async def _alive(fleet: Fleet) -> list[str]:
    """Services that no longer answer their health check, or whose main task ended."""
    dead = []
    for name, chan in fleet.channels.items():
        try:
            await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            dead.append(f"{name}: health {error.code().name}")
    dead += [f"{name}: main task ended" for name, r in fleet.running.items() if r.main.done()]
    return dead


def test_random_and_mutated_requests_never_crash_hang_or_fail_internally(redis_url, run_id, store, tmp_path, arun):
    async def scenario():
        async with Fleet(redis_url, run_id, store, tmp_path) as fleet:
            report = await fuzz(fleet, COUNT, WALL_S, SEED)
            report["dead"] = await _alive(fleet)
            return report

    report = arun(scenario())
    totals = collections.Counter()
    for counter in report["codes"].values():
        totals.update(counter)
    covered = len(report["codes"])
    print(f"\nfuzz: {report['sent']} messages ({dict(report['kinds'])}) to {covered} RPCs of 5 services in "
          f"{report['seconds']:.1f}s; status codes {dict(totals.most_common())}; crashes {len(report['dead'])}, "
          f"failures {len(report['failures'])}")
    assert not report["dead"], report["dead"]
    assert not report["failures"], report["failures"][:20]
    assert report["sent"] >= min(COUNT, 500), "too few messages within the time budget"
    assert covered == len(RPCS), sorted({f"{s.name}.{m.name}" for s, m in RPCS} - set(report["codes"]))
