"""What the gateway→scheduler path adds per model turn, through real gRPC, load balance beside C-MLFQ.

Two transports side by side: `session` (what the gateway uses: one Session stream, only the Route
is waited for, reports are queued in order behind it) and `unary` (the baseline: one unary call
per Route and per report, each waited for, as the gateway did before).

```
 this process (one asyncio loop)                   child process              child process
 ┌──────────────────────────────────────┐  gRPC  ┌───────────────────────┐  ┌────────────────┐
 │ N trajectories, one SchedulerRouter  │ ─────▶ │ libra serve scheduler │─▶│ redis-server   │
 │  Route ─ sleep(gen) ─ ReportTurn ─   │ ◀───── │ --set scheduler.policy│  │ (PrivateRedis) │
 │  ReportToolReturn ─ sleep(tool) ─ …  │        └───────────────────────┘  └────────────────┘
 │  … ─ ReportFinish                    │
 └──────────────────────────────────────┘
```

A private redis-server and, once per policy, a real scheduler process (`python -m libra.cli serve
scheduler`) are started; `--workers` workers are registered over three buckets. Then, per policy:
a baseline of one trajectory doing `--baseline-turns` back-to-back turns (the unloaded floor), and
the measured run: `--trajectories` trajectories at once, each `--turns` turns of Route, a simulated
generation (`--gen-ms`, no model), ReportTurn, then ReportToolReturn and a simulated tool call
(`--tool-ms`), or ReportFinish after the last turn. The sleeps keep all trajectories in flight at a
realistic turn rate; `--gen-ms 0 --tool-ms 0` makes it a closed loop that measures saturation.

    .venv/bin/python benchmarks/scheduler_grpc_latency.py [--trajectories 1000 --turns 4 --gen-ms 1000]

Prints, per policy and load: the Route call's time and the time the gateway waits on the scheduler
per turn (Route + that turn's reports), p50/p90/p99 in ms; calls/s; and CPU ms per call in the
scheduler process and in this client, which says where the time goes (the policy itself costs tens
of µs, see scheduler_decisions.py). Then whether the targets of <= 1 ms median and <= 5 ms p99
added per turn were met. Latencies are measured in the client, so they include both sides' Python
gRPC overhead and queueing in either event loop; other processes on the machine show up as noise
(the load average is printed). Each phase is cut at `--timeout-s`; every process started here is
stopped on exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from libra.redis_server import PrivateRedis, free_port
from libra.rpc import channel, peer_serving
from libra.security import Security
from libra.services.rollout.router import SchedulerRouter
from libra.v1 import common_pb2, scheduler_pb2

REPO = pathlib.Path(__file__).resolve().parent.parent

BUCKETS = (("short", 4_000), ("medium", 12_000), ("long", 30_000))
TOOLS = ("search", "python", "browse")
STATUSES = (common_pb2.TOOL_STATUS_SUCCESS,) * 3 + (common_pb2.TOOL_STATUS_FAILURE, common_pb2.TOOL_STATUS_TIMEOUT)
TARGET_MEDIAN_MS, TARGET_P99_MS = 1.0, 5.0
RUN_ID = "bench-grpc"
CONFIG = """\
run_id: {run_id}
run_dir: {run_dir}
metrics: {{base_port: 0}}
planner:
  mode: static
  buckets:
{buckets}
scheduler:
  policy: load_balance
"""


TOKEN = "scheduler-latency-benchmark-token"  # the scheduler's run token (security.auth)

class Scheduler:
    """A `libra serve scheduler` child process in its own session; `stop()` ends it in bounded time."""

    def __init__(self, directory: pathlib.Path, redis_url: str, policy: str):
        self.port = free_port()
        config = directory / "run.yaml"
        buckets = "\n".join(f"    - {{name: {name}, tp: 1, max_tokens: {tokens}, replicas: 1}}"
                            for name, tokens in BUCKETS)
        config.write_text(CONFIG.format(run_id=RUN_ID, run_dir=directory / "run", buckets=buckets))
        self.log_path = directory / f"scheduler-{policy}.log"
        self.run_id = f"{RUN_ID}-{directory.name}"  # a fresh run id per run: no worker registry left from before
        command = [sys.executable, "-m", "libra.cli", "serve", "scheduler", "--config", str(config),
                   "--redis-url", redis_url, "--port", str(self.port), "--set", f"scheduler.policy={policy}",
                   "--run-id", self.run_id]
        with open(self.log_path, "wb") as log:  # the run's token: this process's (see measure)
            self.process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, env={**os.environ, "LIBRA_TOKEN": TOKEN})

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def wait_serving(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"scheduler exited with {self.process.returncode}; see {self.log_path}")
            if await peer_serving(self.address, timeout_s=0.5):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"scheduler not SERVING on {self.address} within {timeout_s}s; see {self.log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class UnaryRouter(SchedulerRouter):
    """The baseline transport: every Route and report is its own unary call, waited for."""

    async def route(self, trajectory_id, prompt_id, turn, prompt_tokens, max_new_tokens, exclude):
        return await self.stub.Route(scheduler_pb2.RouteRequest(
            meta=self._meta(), trajectory_id=trajectory_id, prompt_id=prompt_id, turn=turn,
            prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, exclude_workers=exclude))

    async def turn_done(self, trajectory_id, worker_id, output_tokens, seconds, failed):
        await self.stub.ReportTurn(scheduler_pb2.TurnReport(
            meta=self._meta(), trajectory_id=trajectory_id, worker_id=worker_id, output_tokens=output_tokens,
            seconds=seconds, failed=failed))

    async def tool_returned(self, trajectory_id, tool, status, payload_tokens):
        await self.stub.ReportToolReturn(scheduler_pb2.ToolReturnReport(
            meta=self._meta(), trajectory_id=trajectory_id, tool=tool, status=status, payload_tokens=payload_tokens))

    async def finished(self, trajectory_id, prompt_id, output_tokens, status):
        await self.stub.ReportFinish(scheduler_pb2.FinishReport(
            meta=self._meta(), trajectory_id=trajectory_id, prompt_id=prompt_id, output_tokens=output_tokens,
            status=status))


ROUTERS = {"session": SchedulerRouter, "unary": UnaryRouter}


async def trajectory(router: SchedulerRouter, index: int, turns: int, gen_s: float, tool_s: float,
                     rng: random.Random, route_ms: list[float], turn_ms: list[float]) -> None:
    """One simulated trajectory; appends the Route time and the per-turn scheduler time of each turn."""
    tid, prompt, produced, clock = f"t{index}", f"p{rng.randrange(200)}", 0, time.perf_counter
    await asyncio.sleep(rng.uniform(0, gen_s + tool_s))  # spread the first turns
    for turn in range(turns):
        start = clock()
        decision = await router.route(tid, prompt, turn, 1_000 + produced, 2_000, [])
        routed = clock()
        await asyncio.sleep(rng.uniform(0.5, 1.5) * gen_s)
        output = rng.randrange(50, 3_000)
        produced += output
        reported = clock()
        await router.turn_done(tid, decision.worker_id, output, 0.0, False)
        if turn + 1 < turns:
            await router.tool_returned(tid, rng.choice(TOOLS), rng.choice(STATUSES), rng.choice((20, 800, 6_000)))
        else:
            await router.finished(tid, prompt, produced, common_pb2.TRAJECTORY_STATUS_COMPLETED)
        done = clock()
        route_ms.append((routed - start) * 1000)
        turn_ms.append((routed - start + done - reported) * 1000)
        if turn + 1 < turns:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * tool_s)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (Linux /proc), to see which side of the call spends the time."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phase(router: SchedulerRouter, scheduler: Scheduler, name: str, trajectories: int, turns: int,
                gen_s: float, tool_s: float, seed: int, timeout_s: float) -> dict:
    rng, route_ms, turn_ms = random.Random(seed), [], []
    server_cpu, client_cpu, start = cpu_seconds(scheduler.process.pid), time.process_time(), time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(
        trajectory(router, i, turns, gen_s, tool_s, random.Random(rng.random()), route_ms, turn_ms)
        for i in range(trajectories))), timeout_s)
    seconds = time.perf_counter() - start
    calls = trajectories * turns * 3
    return {"name": name, "route": quantiles(route_ms), "turn": quantiles(turn_ms), "calls_s": calls / seconds,
            "seconds": seconds, "server_cpu_ms": (cpu_seconds(scheduler.process.pid) - server_cpu) * 1000 / calls,
            "client_cpu_ms": (time.process_time() - client_cpu) * 1000 / calls}


async def measure(scheduler: Scheduler, args: argparse.Namespace, transport: str) -> list[dict]:
    """The unloaded baseline (one trajectory, back-to-back turns), then the concurrent run."""
    await scheduler.wait_serving()
    async with channel(scheduler.address, security=Security(TOKEN)) as chan:
        router = ROUTERS[transport](chan, scheduler.run_id)
        for i in range(args.workers):
            await router.register(common_pb2.WorkerInfo(worker_id=f"w{i}", bucket=BUCKETS[i % len(BUCKETS)][0],
                                                        address=f"http://w{i}:8000", tp=1))
        await phase(router, scheduler, "warm-up", 50, 2, 0.0, 0.0, args.seed + 1, args.timeout_s)
        baseline = await phase(router, scheduler, "1 in flight", 1, args.baseline_turns, 0.0, 0.0,
                               args.seed + 2, args.timeout_s)
        loaded = await phase(router, scheduler, f"{args.trajectories} in flight", args.trajectories, args.turns,
                             args.gen_ms / 1000, args.tool_ms / 1000, args.seed, args.timeout_s)
        await router.close()
    return [baseline, loaded]


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return statistics.median(samples), cuts[89], cuts[98]


def report(results: dict[str, list[dict]], args: argparse.Namespace, load_before: float) -> None:
    print(f"{args.trajectories} concurrent trajectories x {args.turns} turns (gen ~{args.gen_ms:.0f} ms, tool "
          f"~{args.tool_ms:.0f} ms) beside 1 trajectory x {args.baseline_turns} back-to-back turns; "
          f"{args.workers} workers in {len(BUCKETS)} buckets; {os.cpu_count()} CPUs, load average before "
          f"{load_before:.2f} (other processes compete for the same cores)")
    print(f"{'policy/transport':>20} {'load':>14}  {'Route ms p50/p90/p99':>22}  {'per turn ms p50/p90/p99':>25}"
          f"  {'calls/s':>7}  {'CPU ms/call srv+cli':>19}  {'wall s':>6}")
    for policy, rows in results.items():
        for row in rows:
            route, turn = row["route"], row["turn"]
            print(f"{policy:>20} {row['name']:>14}  {route[0]:>6.2f} /{route[1]:>6.2f} /{route[2]:>6.2f}  "
                  f"{turn[0]:>7.2f} /{turn[1]:>6.2f} /{turn[2]:>7.2f}  {row['calls_s']:>7,.0f}  "
                  f"{row['server_cpu_ms']:>8.2f} + {row['client_cpu_ms']:>6.2f}  {row['seconds']:>6.1f}")
    for policy, rows in results.items():
        if not policy.endswith("/session"):
            continue
        baseline = results.get(policy.replace("/session", "/unary"))
        if baseline:
            (s50, _, s99), (u50, _, u99) = rows[-1]["turn"], baseline[-1]["turn"]
            print(f"{policy.split('/')[0]:>12}: per turn at {args.trajectories} in flight, session vs unary: "
                  f"p50 {u50 / s50:.1f}x lower, p99 {u99 / s99:.1f}x lower")
    for policy, rows in results.items():
        median, _, p99 = rows[-1]["turn"]
        verdict = "met" if median <= TARGET_MEDIAN_MS and p99 <= TARGET_P99_MS else "NOT met"
        print(f"{policy:>20}: target <= {TARGET_MEDIAN_MS:g} ms median and <= {TARGET_P99_MS:g} ms p99 added per "
              f"turn at {args.trajectories} in flight: {verdict} (p50 {median:.2f} ms, p99 {p99:.2f} ms)")


async def main_async(args: argparse.Namespace, directory: pathlib.Path, redis_url: str) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    for policy in args.policies:
        for transport in args.transports:
            workdir = directory / f"{policy}-{transport}"
            workdir.mkdir()
            scheduler = Scheduler(workdir, redis_url, policy)
            try:
                results[f"{policy}/{transport}"] = await measure(scheduler, args, transport)
            finally:
                scheduler.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=1_000, help="trajectories in flight at once")
    parser.add_argument("--turns", type=int, default=4, help="model turns per trajectory")
    parser.add_argument("--workers", type=int, default=8, help="workers, spread over three buckets")
    parser.add_argument("--gen-ms", type=float, default=1_000, help="mean simulated generation per turn")
    parser.add_argument("--tool-ms", type=float, default=200, help="mean simulated tool call between turns")
    parser.add_argument("--baseline-turns", type=int, default=300, help="turns of the one-trajectory baseline")
    parser.add_argument("--policies", nargs="+", default=["load_balance", "cmlfq"],
                        choices=["load_balance", "cmlfq"])
    parser.add_argument("--transports", nargs="+", default=["session", "unary"], choices=sorted(ROUTERS),
                        help="session: the gateway's stream (only Route waited for); unary: one call each")
    parser.add_argument("--timeout-s", type=float, default=25.0, help="bound on each phase (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the finally blocks stop the children
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="libra-grpc-bench-") as tmp:
        directory = pathlib.Path(tmp)
        redis = PrivateRedis(directory / "redis").start()
        try:
            results = asyncio.run(main_async(args, directory, redis.url))
        finally:
            redis.stop()
    report(results, args, load_before)


if __name__ == "__main__":
    main()
