"""`libra up`: the whole job on one machine, each service its own process, kept running.

```
 libra up ─┬─ run dir: resume / refuse a finished run / --fresh (run_dir.py); logs rotated
           ├─ the five ports held until their service starts (supervise.PortHold)
           ├─ zygote: imports the services' modules once, while Redis starts (libra/zygote.py; up.zygote)
           ├─ redis-server (private, persistent: RUN_DIR/redis, unless redis.url is given)
           ├─ libra serve planner | elastic | scheduler | rollout | trainer   (logs: RUN_DIR/logs/)
           │    each forked from the zygote (as `python -m libra.cli serve NAME` would start), or,
           │    without one, a fresh interpreter
           ├─ supervision: a service (or the private Redis) that dies is started again with backoff;
           │  a crash loop stops the run, saying why (libra/supervise.py)
           └─ progress: Trainer.WatchSteps ─▶ terminal
```
Every child leads its own session and is SIGKILLed by the kernel if `libra up` dies, even by
SIGKILL (libra/procs.py; a forked service when its zygote dies, which dies with `libra up`). The trainer finishing, a crash loop, Ctrl-C, SIGTERM or SIGHUP stop
everything: SIGTERM to one service at a time in reverse start order (each drains while its peers
are up), SIGKILL to its process group after STOP_TIMEOUT_S, all services within STOP_BUDGET_S; a
second signal kills at once. Last, whatever still carries this start's marker (MARKER in its
environment, inherited by the services' own children: engine workers, vLLM's processes, hybrids)
is killed, so nothing of the job outlives `libra up`.

Exit codes: 0 the job finished, 1 a service kept crashing (a crash loop), 2 refused to start
(config, model or data missing, ports in use, run directory), 128 + N stopped by signal N (130
Ctrl-C, 143 SIGTERM, 129 SIGHUP).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

from redis.exceptions import RedisError

from libra import procs, run_dir, security
from libra.checks import check_before_start
from libra.config import SERVICES, RunConfig
from libra.errors import FailedPrecondition, LibraError
from libra.progress import ProgressPrinter
from libra.redis_server import PrivateRedis
from libra.supervise import PortHold, RestartPolicy, Supervisor
from libra.telemetry import report
from libra.zygote import ForkedProcess, Zygote, ZygoteError

START_ORDER = ("planner", "elastic", "scheduler", "rollout", "trainer")
STOP_TIMEOUT_S = 40.0  # one service: its drain budget plus shutdown
STOP_BUDGET_S = 60.0  # all services; then Redis (5 s) and the sweep (3 s grace)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MARKER = "LIBRA_UP_TOKEN"  # environment variable every process of one start inherits


def hold_ports(config: RunConfig) -> dict[str, PortHold]:
    """Hold each service's port until the service starts (supervise.py); FailedPrecondition naming
    the service and the field when one is in use."""
    holds: dict[str, PortHold] = {}
    for service in SERVICES:
        port = config.port_of(service)
        holds[service] = PortHold("0.0.0.0", port)
        if not holds[service].held:
            for hold in holds.values():
                hold.release()
            raise FailedPrecondition(f"addresses.{service}: port {port} of the {service} service is in use (another "
                                     f"libra up?); stop it or change addresses.{service} in the config")
    return holds


QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1",
             "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def write_resolved(config: RunConfig) -> pathlib.Path:
    """The config with every override applied, as the file all services of this run read."""
    import yaml

    path = config.run_path / "config.yaml"
    path.touch(mode=0o600)
    path.chmod(0o600)  # only its owner: redis.url may hold a password
    path.write_text("# written by `libra up`: the run config with all overrides applied\n"
                    + yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


class StopSignals:
    """While installed, Ctrl-C, SIGTERM and SIGHUP are recorded, never raised: a start or a
    stop in progress is never cut in half (which would orphan what it had started)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None


SERVICE_MODULES = ["libra.cli", *(f"libra.services.{service}.server" for service in START_ORDER)]
"""What `libra serve SERVICE` imports before it serves: the services' zygote imports it once."""


def start_zygote(config: RunConfig, env: dict[str, str]) -> Zygote | None:
    """The process the services fork from (`up.zygote`), importing their modules while Redis starts;
    None when off, or where children cannot be tied to their parent's life (no setpriv: not Linux)."""
    if not config.up.zygote or not procs.PARENT_DEATH:
        return None
    logs = config.run_path / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return Zygote(SERVICE_MODULES, {**env, "PYTHONUNBUFFERED": "1", **QUIET_ENV}, signal.SIGKILL, logs / "zygote.log")


class Children:
    """The service processes of one `libra up`: forked from the zygote when there is one, else each
    a fresh interpreter (and so when the zygote is gone or refuses: `fallback` says why)."""

    def __init__(self, config: RunConfig, config_path: str, redis_url: str, env: dict[str, str],
                 holds: dict[str, PortHold] | None = None, zygote: Zygote | None = None):
        self.config, self.config_path, self.redis_url = config, config_path, redis_url
        self.logs = config.run_path / "logs"
        self.env = env
        self.holds = holds or {}
        self.zygote = zygote
        self.fallback: str | None = None
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}

    def start(self, service: str) -> None:
        """Start (or start again) `service`, appending to its log; its port is let go just before."""
        hold = self.holds.pop(service, None)
        if hold is not None:
            hold.release()
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {**self.env, "LIBRA_REDIS_URL": self.redis_url, "LIBRA_RUN_ID": self.config.run_id,
               "LIBRA_RUN_DIR": str(self.config.run_path), "LIBRA_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1",
               **QUIET_ENV}
        argv = [sys.executable, "-m", "libra.cli", "serve", service, "--config", self.config_path]
        with open(self.logs / f"{service}.log", "ab") as log:
            if self.zygote is not None and self.fallback is None:
                try:
                    self.procs[service] = self.zygote.spawn(argv, env, log, signal.SIGKILL)
                    return
                except ZygoteError as error:  # (kept until the stop: services it forked die with it)
                    self.fallback = f"{error}; services start as fresh interpreters from now on"
            self.procs[service] = procs.start_group(argv, signal.SIGKILL, env=env, stdout=log,
                                                    stderr=subprocess.STDOUT)

    def trainer_done(self) -> bool:
        proc = self.procs.get("trainer")
        return proc is not None and proc.poll() == 0

    def log_tail(self, service: str, lines: int = 25) -> str:
        path = self.logs / f"{service}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, hurry) -> None:
        """SIGTERM one service at a time in reverse start order, so each drains while the
        services it talks to are still up (trainer checkpoints, rollout finishes its turns);
        SIGKILL its group after its budget, or at once when `hurry()`; then the zygote."""
        deadline = time.monotonic() + STOP_BUDGET_S
        for name in reversed(list(self.procs)):
            budget = max(0.0, min(STOP_TIMEOUT_S, deadline - time.monotonic()))
            procs.stop_group(self.procs[name], budget, hurry)
        if self.zygote is not None:
            self.zygote.close()
        for hold in self.holds.values():
            hold.release()


def supervise(children: Children, redis: PrivateRedis | None, printer: ProgressPrinter,
              policy: RestartPolicy = RestartPolicy()) -> Supervisor:
    """The supervisor of this start: every service, and the private Redis (same port, same files)."""
    supervisor = Supervisor(policy, printer.error, printer.info, children.log_tail,
                            finished=lambda name, code: name == "trainer" and code == 0)
    for service in START_ORDER:
        supervisor.add(service, lambda s=service: children.start(s), lambda s=service: children.procs.get(s),
                       ("0.0.0.0", children.config.port_of(service)))
    if redis is not None:
        supervisor.add("redis", redis.restart, lambda: redis.process, ("127.0.0.1", redis.port))
    return supervisor


async def _watch(config: RunConfig, children: Children, supervisor: Supervisor, printer: ProgressPrinter,
                 signals: StopSignals, first_step: int) -> int:
    """Follow the trainer's progress until it finishes, a crash loop or a stop signal comes,
    restarting what dies meanwhile (on this thread: children die with the thread that started them)."""
    printer.next_step = first_step
    watcher = asyncio.create_task(printer.follow(config))
    try:
        while True:
            if signals.first is not None:
                return 128 + signals.first
            reason = supervisor.check()
            if reason is not None:
                printer.error(reason)
                return 1
            if children.trainer_done():
                await asyncio.sleep(0.5)  # let the last step records arrive
                watcher.cancel()
                try:  # steps committed between two of the printer's polls, read back from Redis
                    await asyncio.wait_for(printer.catch_up(config, config.trainer.steps), 10)
                except (asyncio.TimeoutError, OSError, RedisError, LibraError) as error:
                    printer.error(f"could not read the last steps' records back from Redis: {error}")
                return 0
            await asyncio.sleep(0.5)
    finally:
        watcher.cancel()


def _prepare_run_dir(config: RunConfig, printer: ProgressPrinter, fresh: bool, state: run_dir.RunDirState,
                     note: str | None) -> int:
    """Move aside (run_dir.py: `state` and `note` as decided), rotate the logs; the first step this start trains."""
    run_path = config.run_path
    if fresh:
        moved = run_dir.move_aside(run_path)
        if moved is not None:
            printer.info(f"--fresh: moved the earlier run directory aside to {moved}")
        if config.redis.url:
            cleared = run_dir.clear_redis_run(config.redis.url, config.run_id)
            printer.info(f"--fresh: deleted {cleared} keys of run {config.run_id} from "
                         f"{security.redacted(config.redis.url)}")
    run_path.mkdir(parents=True, exist_ok=True)
    if note:
        printer.info(note)
    rotated = run_dir.rotate_logs(run_path / "logs")
    if rotated is not None:
        printer.info(f"the previous start's logs are in {rotated}")
    return 1 if fresh else state.step + 1


def up(config: RunConfig, fresh: bool = False, resume: bool = False) -> int:
    printer = ProgressPrinter()
    state = run_dir.inspect(config.run_path)  # resume, refuse a finished run, or start over
    note = run_dir.decide(state, config.run_id, config.trainer.steps, fresh, resume)
    check_before_start(config, ports=False)  # model, data, other ports: as check-config (exit 2, the field named)
    holds = hold_ports(config)  # a live run on these ports: refuse before touching its directory
    try:
        first_step = _prepare_run_dir(config, printer, fresh, state, note)
    except BaseException:
        for hold in holds.values():
            hold.release()
        raise
    with StopSignals() as signals:
        return _run(config, printer, signals, first_step, holds)


def _run(config: RunConfig, printer: ProgressPrinter, signals: StopSignals, first_step: int,
         holds: dict[str, PortHold]) -> int:
    run_path = config.run_path
    token = uuid.uuid4().hex
    env = {**os.environ, MARKER: token}
    redis, code = None, 1
    children = Children(config, "", "", env, holds)  # every port released by its stop, whatever happens
    try:
        children.zygote = zygote = start_zygote(config, env)  # its imports overlap Redis's start
        redis_url = config.redis.url
        if not redis_url:
            redis = PrivateRedis(run_path / "redis", log_path=run_path / "logs" / "redis.log", env=env,
                                 persistent=True, appendfsync=config.redis.appendfsync).start()
            redis_url = redis.url
        config = config.model_copy(update={"redis": config.redis.model_copy(update={"url": redis_url})})
        config = security.prepare_run_token(config)  # RUN_DIR/token (0600, new each start), named in config.yaml
        security.install(security.load(config))  # the progress printer's calls carry it
        printer.info(f"run {config.run_id} in {run_path} (redis {security.redacted(redis_url)})")
        children = Children(config, str(write_resolved(config)), redis_url, env, holds, zygote)
        for service in START_ORDER:
            if signals.first is not None:
                break
            children.start(service)
        else:
            if children.fallback:
                printer.info(f"zygote: {children.fallback}")
            printer.info(f"started {', '.join(START_ORDER)}; logs in {children.logs}")
            supervisor = supervise(children, redis, printer)
            try:
                code = asyncio.run(_watch(config, children, supervisor, printer, signals, first_step))
            finally:
                supervisor.release()
    finally:
        if signals.first is not None:
            code = 128 + signals.first
        stopped = _stop_all(children, redis, token, printer, signals)
        try:
            if code == 0:
                printer.finish(run_path)
            report.write_at_end(run_path, printer.info)
        finally:
            printer.info(stopped)  # the last line says that nothing of the run is left
    return code


def _stop_all(children: Children, redis: PrivateRedis | None, token: str, printer: ProgressPrinter,
              signals: StopSignals) -> str:
    """Stop every service and Redis; the line that says so, for the caller to print last."""
    started, before = time.monotonic(), len(signals.received)
    if signals.first is not None:
        printer.info(f"{signal.Signals(signals.first).name} received: stopping every service of the run (at most "
                     f"{STOP_BUDGET_S + 10:.0f}s; a second signal kills at once)")
    hurried: list[bool] = []

    def hurry() -> bool:  # a signal after the stop began
        if len(signals.received) > before and not hurried:
            hurried.append(True)
            printer.info("second signal: killing every process of the run now")
        return bool(hurried)

    children.stop(hurry)
    if redis is not None:
        redis.stop()
    killed = procs.sweep(MARKER, token)
    left = f"; killed {len(killed)} leftover processes ({', '.join(map(str, killed))})" if killed else ""
    return f"stopped in {time.monotonic() - started:.0f}s: nothing of this run is running{left}"
