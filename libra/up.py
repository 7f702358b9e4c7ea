"""`libra up`: the whole job on one machine, each service its own process.

```
 libra up ─┬─ redis-server (private, unless redis.url is given)
           ├─ libra serve planner | elastic | scheduler | rollout | trainer   (logs: RUN_DIR/logs/)
           └─ progress: Trainer.WatchSteps ─▶ terminal;  a child that dies ─▶ stop all, exit 1
```
Ctrl-C or the trainer finishing stops everything: SIGTERM in reverse start order, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import socket
import subprocess
import sys

from libra.config import SERVICES, RunConfig
from libra.errors import FailedPrecondition
from libra.progress import ProgressPrinter
from libra.redis_server import PrivateRedis

START_ORDER = ("planner", "elastic", "scheduler", "rollout", "trainer")
STOP_TIMEOUT_S = 40.0  # per service: its drain budget plus shutdown


def _check_ports(config: RunConfig) -> None:
    for service in SERVICES:
        port = config.port_of(service)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                raise FailedPrecondition(
                    f"port {port} of the {service} service is in use (another libra up?); stop it or change "
                    f"addresses.{service} in the config") from None


QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1",
             "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def write_resolved(config: RunConfig) -> pathlib.Path:
    """The config with every override applied, as the file all services of this run read."""
    import yaml

    path = config.run_path / "config.yaml"
    path.write_text("# written by `libra up`: the run config with all overrides applied\n"
                    + yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


class Children:
    """The service processes of one `libra up`."""

    def __init__(self, config: RunConfig, config_path: str, redis_url: str):
        self.config, self.config_path, self.redis_url = config, config_path, redis_url
        self.logs = config.run_path / "logs"
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, service: str) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "LIBRA_REDIS_URL": self.redis_url, "LIBRA_RUN_ID": self.config.run_id,
               "LIBRA_RUN_DIR": str(self.config.run_path), "LIBRA_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", **QUIET_ENV}
        log = open(self.logs / f"{service}.log", "ab")
        self.procs[service] = subprocess.Popen(
            [sys.executable, "-m", "libra.cli", "serve", service, "--config", self.config_path],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def failed(self) -> tuple[str, int] | None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None and (code != 0 or name != "trainer"):
                return name, code
        return None

    def trainer_done(self) -> bool:
        proc = self.procs.get("trainer")
        return proc is not None and proc.poll() == 0

    def log_tail(self, service: str, lines: int = 25) -> str:
        path = self.logs / f"{service}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM one service at a time in reverse start order, so each drains while the
        services it talks to are still up (trainer checkpoints, rollout finishes its turns)."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            try:  # whatever the service left in its process group (e.g. engine processes)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def _watch(config: RunConfig, children: Children, printer: ProgressPrinter) -> int:
    """Follow the trainer's progress until it finishes or a service fails."""
    watcher = asyncio.create_task(printer.follow(config))
    try:
        while True:
            failure = children.failed()
            if failure is not None:
                name, code = failure
                printer.error(f"{name} exited with code {code}; last lines of {children.logs / (name + '.log')}:\n"
                              f"{children.log_tail(name)}")
                return 1
            if children.trainer_done():
                await asyncio.sleep(0.5)  # let the last step records arrive
                return 0
            await asyncio.sleep(0.5)
    finally:
        watcher.cancel()


def up(config: RunConfig) -> int:
    run_path = config.run_path
    run_path.mkdir(parents=True, exist_ok=True)
    _check_ports(config)
    redis = None
    redis_url = config.redis.url
    printer = ProgressPrinter()
    if not redis_url:
        redis = PrivateRedis(run_path / "redis").start()
        redis_url = redis.url
    config = config.model_copy(update={"redis": config.redis.model_copy(update={"url": redis_url})})
    printer.info(f"run {config.run_id} in {run_path} (redis {redis_url})")
    children = Children(config, str(write_resolved(config)), redis_url)
    code = 1
    try:
        for service in START_ORDER:
            children.start(service)
        printer.info(f"started {', '.join(START_ORDER)}; logs in {children.logs}")
        code = asyncio.run(_watch(config, children, printer))
    except KeyboardInterrupt:
        printer.info("interrupted: stopping services")
        code = 130
    finally:
        children.stop()
        if redis is not None:
            redis.stop()
    if code == 0:
        printer.finish(run_path)
    return code
