"""gRPC plumbing shared by every service: the server with health and reflection, error mapping,
client channels, and waiting for peers.

Servicer methods are wrapped by `guard`, the one place where exceptions become status codes
(table in `libra.errors.status_code`): bad input -> INVALID_ARGUMENT, unknown ids -> NOT_FOUND, and
anything unexpected -> INTERNAL with the service still running.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any, Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from libra import log as liblog
from libra.errors import FailedPrecondition, status_code

_log = liblog.get("libra.rpc")

MESSAGE_BYTES = 256 * 1024 * 1024
# gRPC Python enables SO_REUSEPORT by default: a second server would silently share the port.
SERVER_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MESSAGE_BYTES),
    ("grpc.max_send_message_length", MESSAGE_BYTES),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_BYTES),
    ("grpc.max_send_message_length", MESSAGE_BYTES),
    ("grpc.enable_retries", 1),
]


def guard(method: Callable[..., Any]) -> Callable[..., Any]:
    """Map exceptions raised by a servicer method to gRPC status codes (unary and streaming)."""

    async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
        code = status_code(error)
        if code == grpc.StatusCode.INTERNAL:
            _log.exception("rpc failed", method=method.__name__)
            message = f"internal error in {method.__name__}: {type(error).__name__}: {error}"
        else:
            message = str(error) or type(error).__name__
        await context.abort(code, message)

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as error:  # noqa: BLE001 - mapped to a status, service keeps running
                await _abort(context, error)
        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:  # noqa: BLE001 - mapped to a status, service keeps running
            await _abort(context, error)
    return unary_wrapper


class ServiceHost:
    """An asyncio gRPC server with the health service and server reflection.

    Health starts NOT_SERVING; the service flips it once its peers and Redis are reachable.
    """

    def __init__(self, name: str, service_names: Iterable[str], port: int, host: str = "0.0.0.0"):
        self.name = name
        self._service_names = list(service_names)
        self._requested = (host, port)
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.port = 0

    async def start(self) -> int:
        host, port = self._requested
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise FailedPrecondition(f"{self.name}: cannot listen on {host}:{port}: the port is in use; stop what "
                                     f"holds it or give this service another port (--port or addresses.{self.name})")
        await self.server.start()
        await self.set_serving(False)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self._service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def channel(address: str) -> grpc.aio.Channel:
    """An insecure asyncio channel to a peer (HOST:PORT)."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def peer_serving(address: str, timeout_s: float = 2.0) -> bool:
    """True when the peer's health service answers SERVING."""
    async with channel(address) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def retry_until(attempt: Callable[[], Awaitable[bool]], what: str,
                      timeout_s: float | None = None, max_backoff_s: float = 5.0) -> None:
    """Call `attempt` with exponential backoff until it returns True (or raise TimeoutError)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    backoff, tries = 0.1, 0
    while True:
        tries += 1
        try:
            if await attempt():
                return
        except Exception as error:  # noqa: BLE001 - a peer that is not up yet; keep trying
            if tries in (1, 10) or tries % 50 == 0:
                _log.info("waiting", what=what, error=f"{type(error).__name__}: {error}", tries=tries)
        if deadline is not None and loop.time() >= deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout_s:.0f}s")
        await asyncio.sleep(backoff)
        backoff = min(max_backoff_s, backoff * 1.6)


async def wait_for_peers(addresses: dict[str, str], timeout_s: float | None = None) -> None:
    """Block until every named peer reports SERVING (backoff between tries)."""
    for name, address in addresses.items():
        await retry_until(lambda a=address: peer_serving(a), f"peer {name} at {address}", timeout_s)
