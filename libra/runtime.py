"""Running one service: bind, wait for peers, serve, drain on SIGTERM, exit in bounded time.

```
 serve()
   ├─ adopt: stop what a dead predecessor of this service left running (libra/procs.py)
   ├─ ServiceHost.start()           gRPC up, health NOT_SERVING
   ├─ service.start()               Redis + peers, with backoff
   ├─ health SERVING
   ├─ service.run()  ───────────┐   main loop (trainer steps, rollout workers…)
   │                            │   a crash here exits 1 (never a silent dead task)
   ├─ Redis watch ──────────────┤   Redis unreachable: NOT_SERVING (calls wait, retrying with
   │                            │   backoff: libra.state); back: service.redis_back(), SERVING
   └─ SIGTERM/SIGINT ──▶ NOT_SERVING ─▶ service.drain(grace) ─▶ server.stop ─▶ service.close()
```

Health is SERVING only while the service wants it (after start, or `set_health(True)`) and its
Redis answers. Exit codes: 0 clean stop or finished job, 1 a background failure, 2 a config error
or a port in use (CLI).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import signal
from typing import Any

from libra import event_loop
from libra import log as liblog
from libra import procs
from libra.errors import FailedPrecondition
from libra.rpc import ServiceHost
from libra.security import Security

_log = liblog.get("libra.runtime")


class Service(abc.ABC):
    """What the runtime needs from a service; servicers stay thin adapters over it."""

    name: str = "service"
    #: drain budget on SIGTERM; everything must be down within drain_s + 5 s
    drain_s: float = 10.0
    #: False: the service answers RPCs right after start() but reports SERVING itself, through
    #: `set_health`, once its peers are up (the trainer shows its warm-up progress meanwhile)
    ready_after_start: bool = True
    set_health: Any = None

    @abc.abstractmethod
    def service_names(self) -> list[str]:
        """Full gRPC service names (for reflection and health)."""

    @abc.abstractmethod
    def register(self, server: Any) -> None:
        """Add the servicers to the gRPC server."""

    async def start(self) -> None:
        """Connect to Redis and wait for peers (retries with backoff); return when ready to serve."""

    async def run(self) -> None:
        """The main loop. Returning ends the process (status 0); the default serves until stopped."""
        await asyncio.Event().wait()

    async def drain(self) -> None:
        """Finish in-flight work (bounded by drain_s)."""

    async def close(self) -> None:
        """Release connections and child processes."""

    async def redis_back(self) -> None:
        """Redis answers again after an outage: put back what this service owns there if Redis lost
        it (a Redis without persistence, a lost disk). Calls made during the outage waited; none failed."""


MAIN_CANCEL_S = 10.0
"""Seconds a stopping service's main task gets to end once cancelled."""
REDIS_CHECK_S = 1.0
"""How often a running service asks its Redis whether it answers (health follows the answer)."""


class RunningService:
    """A service started in this event loop (used by `serve` and by service tests)."""

    def __init__(self, service: Service, port: int, host: str = "127.0.0.1", security: Security | None = None):
        self.service = service
        self.host = ServiceHost(service.name, service.service_names(), port, host, security)
        service.register(self.host.server)
        service.set_health = self.set_health
        self.port = 0
        self._main: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._wanted = False  # the service's own verdict (after start, or set_health)
        self.redis_up = True  # the last Redis check answered

    async def set_health(self, serving: bool) -> None:
        """What the service says; health shows SERVING only while Redis answers too."""
        self._wanted = serving
        await self.host.set_serving(serving and self.redis_up)

    async def start(self, wait_ready: bool = True) -> "RunningService":
        self.port = await self.host.start()
        self._main = asyncio.create_task(self._lifecycle(), name=f"{self.service.name}-main")
        if wait_ready:
            while not self.ready.is_set():
                if self._main.done():
                    self._main.result()  # re-raise the start failure
                await asyncio.sleep(0.02)
        return self

    @property
    def ready(self) -> asyncio.Event:
        if not hasattr(self, "_ready"):
            self._ready = asyncio.Event()
        return self._ready

    async def _lifecycle(self) -> None:
        await self.service.start()
        if self.service.ready_after_start:
            await self.set_health(True)
        self.ready.set()
        self._watch = asyncio.create_task(self._watch_redis(), name=f"{self.service.name}-redis-watch")
        _log.info("serving", service=self.service.name, port=self.port,
                  event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])
        await self.service.run()

    async def _watch_redis(self) -> None:
        """Follow the service's Redis: NOT_SERVING while it does not answer, then `redis_back()`."""
        while True:
            await asyncio.sleep(REDIS_CHECK_S)
            store = getattr(self.service, "store", None)
            if store is None:
                continue
            up = await store.reachable(timeout_s=REDIS_CHECK_S)
            if up == self.redis_up:
                continue
            if not up:
                _log.warning("redis unreachable: NOT_SERVING until it answers (calls wait meanwhile)",
                             service=self.service.name)
                self.redis_up = False
                await self.set_health(self._wanted)
                continue
            _log.info("redis answers again", service=self.service.name)
            store.after_outage()
            try:
                await self.service.redis_back()
            except Exception as error:  # noqa: BLE001 - logged; the next outage tries again
                _log.error("putting back the service's state after a Redis outage failed", service=self.service.name,
                           error=f"{type(error).__name__}: {error}")
            self.redis_up = True
            await self.set_health(self._wanted)

    @property
    def main(self) -> asyncio.Task:
        assert self._main is not None, "start() first"
        return self._main

    async def stop(self) -> None:
        self._wanted = False
        await self.host.set_serving(False)
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.service.drain(), self.service.drain_s)
        if self._main and not self._main.done():
            self._main.cancel()
            done, _ = await asyncio.wait({self._main}, timeout=MAIN_CANCEL_S)
            if not done:  # a task that ignores cancellation must not hold the shutdown forever
                _log.error("service main task did not stop after cancellation; closing anyway",
                           service=self.service.name, waited_s=MAIN_CANCEL_S)
            elif not self._main.cancelled():
                self._main.exception()  # retrieve it: the lifecycle has logged it already
        await self.host.stop(grace_s=min(2.0, self.service.drain_s))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.service.close(), 5.0)


async def _serve(service: Service, port: int, metrics_port: int) -> int:
    from libra.security import for_service

    host, security = service.config.listen_host_of(service.name), for_service(service.config)
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=host.strip("[]"))
    running = await RunningService(service, port, host, security).start(wait_ready=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({waiter, running.main}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if running.main in done and not running.main.cancelled() and running.main.exception():
        _log.error("service failed", service=service.name, error=repr(running.main.exception()),
                   exc_info=running.main.exception())
        code = 1
    elif running.main in done:
        _log.info("finished", service=service.name)
    else:
        _log.info("stopping", service=service.name, drain_s=service.drain_s)
    waiter.cancel()
    await running.stop()
    return code


def owner_key(service: str, run_id: str, run_path: object) -> str:
    """The key under which a service's children are marked (`procs.adopt`): service, run, and the
    run directory (hashed), so two runs on one machine never touch each other's processes."""
    digest = hashlib.blake2b(str(run_path).encode(), digest_size=6).hexdigest()
    return f"{service}:{run_id}:{digest}"


def serve(service: Service, port: int, metrics_port: int = 0) -> int:
    """Run a service until SIGTERM/SIGINT or until its main loop ends; return the exit code.

    First it stops whatever a dead predecessor (the same service of the same run) left running."""
    config = getattr(service, "config", None)
    stopped = procs.adopt(owner_key(service.name, getattr(service, "run_id", ""), getattr(config, "run_path", "")))
    if stopped:
        _log.info("stopped what the previous process of this service left running", service=service.name,
                  pids=stopped)
    try:
        return event_loop.run(_serve(service, port, metrics_port), getattr(config, "event_loop", "auto"))
    except FailedPrecondition as error:  # cannot start at all (port taken): say why, exit 2
        _log.error("cannot start", service=service.name, error=str(error))
        return 2
