"""Running one service: bind, wait for peers, serve, drain on SIGTERM, exit in bounded time.

```
 serve()
   ├─ ServiceHost.start()           gRPC up, health NOT_SERVING
   ├─ service.start()               Redis + peers, with backoff
   ├─ health SERVING
   ├─ service.run()  ───────────┐   main loop (trainer steps, rollout workers…)
   │                            │   a crash here exits 1 (never a silent dead task)
   └─ SIGTERM/SIGINT ──▶ NOT_SERVING ─▶ service.drain(grace) ─▶ server.stop ─▶ service.close()
```

Exit codes: 0 clean stop or finished job, 1 a background failure, 2 a config error (CLI).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import signal
from typing import Any

from libra import log as liblog
from libra.errors import FailedPrecondition
from libra.rpc import ServiceHost

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


MAIN_CANCEL_S = 10.0
"""Seconds a stopping service's main task gets to end once cancelled."""


class RunningService:
    """A service started in this event loop (used by `serve` and by service tests)."""

    def __init__(self, service: Service, port: int, host: str = "0.0.0.0"):
        self.service = service
        self.host = ServiceHost(service.name, service.service_names(), port, host)
        service.register(self.host.server)
        service.set_health = self.host.set_serving
        self.port = 0
        self._main: asyncio.Task | None = None

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
            await self.host.set_serving(True)
        self.ready.set()
        _log.info("serving", service=self.service.name, port=self.port)
        await self.service.run()

    @property
    def main(self) -> asyncio.Task:
        assert self._main is not None, "start() first"
        return self._main

    async def stop(self) -> None:
        await self.host.set_serving(False)
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
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port)
    running = await RunningService(service, port).start(wait_ready=False)
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


def serve(service: Service, port: int, metrics_port: int = 0) -> int:
    """Run a service until SIGTERM/SIGINT or until its main loop ends; return the exit code."""
    try:
        return asyncio.run(_serve(service, port, metrics_port))
    except FailedPrecondition as error:  # cannot start at all (port taken): say why, exit 2
        _log.error("cannot start", service=service.name, error=str(error))
        return 2
