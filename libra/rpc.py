"""gRPC plumbing shared by every service: the server with health and reflection, client channels
with their retry policy, and the few waits that gRPC cannot do for us.

Servicer methods go through `libra.boundary.rpc` (run check, request id, replay, status codes);
before them, every call passes the server's gate (`libra.security.grpc_gate`: the run's token,
requests that do not parse). A process's channels carry the token and TLS that
`libra.security.install` made its own (`libra serve`, `libra up`, `libra status` install them).

Retries are declared once, in the service config of every channel (`channel()`): a unary call
to a Libra service that fails with UNAVAILABLE is retried by gRPC itself, with backoff, within
the call's deadline; a channel made with `wait_for_ready=True` also waits (within the deadline)
for a peer that is not up yet instead of failing at once. Retrying a mutating call is safe
because every mutating RPC answers a repeated request id with its first reply (docs/rpc.md).
What the service config cannot cover keeps one shared helper, `Backoff` (see its docstring).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import pkgutil
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from libra import log as liblog
from libra.errors import FailedPrecondition
from libra.security import Security, installed
from libra.security.config import is_loopback
from libra.security.credentials import MESSAGE_BYTES
from libra.security.grpc_gate import (Gate, SyncBearerToken, bearer_interceptors, channel_credentials,
                                      server_credentials)

_log = liblog.get("libra.rpc")


def size_options(message_bytes: int) -> list[tuple[str, int]]:
    """The largest message a server or channel receives and sends (security.limits.message_bytes)."""
    return [("grpc.max_receive_message_length", message_bytes), ("grpc.max_send_message_length", message_bytes)]


# gRPC Python enables SO_REUSEPORT by default: a second server would silently share the port.
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]
CHANNEL_OPTIONS = [
    ("grpc.enable_retries", 1),
    ("grpc.service_config_disable_resolution", 1),  # our service config, never one from DNS
    # Reconnect to a restarted peer within ~2 s (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
RETRY_POLICY = {
    "maxAttempts": 5,  # gRPC's upper limit
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
"""gRPC's retry policy for every unary Libra RPC (streams are reopened by their owners)."""


class ServiceHost:
    """An asyncio gRPC server with the health service and server reflection, behind the gate.

    Health starts NOT_SERVING; the service flips it once its peers and Redis are reachable.
    `security` (libra.security.load): the token every call must carry, TLS, the message size;
    None (tests in one process): no token, plaintext, the default size. A server without a token
    is refused on an interface other than loopback, unless TLS authenticates its clients.
    """

    def __init__(self, name: str, service_names: Iterable[str], port: int, host: str = "127.0.0.1",
                 security: Security | None = None):
        self.name = name
        self._service_names = list(service_names)
        self._requested = (host, port)
        self.security = security
        message_bytes = security.message_bytes if security is not None else MESSAGE_BYTES
        self.server = grpc.aio.server(options=[*SERVER_OPTIONS, *size_options(message_bytes)],
                                      interceptors=[Gate(security)])
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.port = 0

    async def start(self) -> int:
        host, port = self._requested
        security = self.security
        if security is not None and security.token is None and not is_loopback(host) and not (
                security.tls is not None and security.tls.require_client_cert):
            raise FailedPrecondition(f"{self.name}: security.auth is none but it would listen on {host}: anyone who "
                                     f"reaches the port could call every RPC; use security.auth: token, mutual TLS, "
                                     f"or a loopback address")
        try:
            if security is not None and security.tls is not None:
                self.port = self.server.add_secure_port(f"{host}:{port}", server_credentials(security.tls))
            else:
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


def wire_services() -> list:
    """The ServiceDescriptors of every service in libra.v1 (the generated code), by full name."""
    import libra.v1

    found = {}
    for module in pkgutil.iter_modules(libra.v1.__path__):
        if module.name.endswith("_pb2"):
            descriptor = importlib.import_module(f"libra.v1.{module.name}").DESCRIPTOR
            found.update({s.full_name: s for s in descriptor.services_by_name.values()})
    return [found[name] for name in sorted(found)]


@functools.cache
def service_config(wait_for_ready: bool) -> str:
    """The service config (JSON) of `channel()`: RETRY_POLICY for every unary method of every Libra
    service, and `waitForReady` if asked. Health checks and streams are left out on purpose: a
    health check must say NOT_SERVING at once, and a broken stream is reopened by its owner."""
    unary = [{"service": service.full_name, "method": method.name}
             for service in wire_services() for method in service.methods
             if not method.client_streaming and not method.server_streaming]
    method_config = {"name": unary, "retryPolicy": RETRY_POLICY}
    if wait_for_ready:
        method_config["waitForReady"] = True
    return json.dumps({"methodConfig": [method_config]})


def channel(address: str, *, wait_for_ready: bool = False, security: Security | None = None) -> grpc.aio.Channel:
    """An asyncio channel to a peer (HOST:PORT) with Libra's retry policy, carrying the token and
    TLS of `security` (default: the process's, `libra.security.installed()`; none: plaintext).

    `wait_for_ready=True` for a peer that may not be up yet (or may be restarting) when a call is
    made: its unary calls wait for the connection, within their deadline, instead of failing."""
    security = security if security is not None else installed()
    options = [*CHANNEL_OPTIONS, ("grpc.service_config", service_config(wait_for_ready)),
               *size_options(security.message_bytes if security is not None else MESSAGE_BYTES)]
    if security is None:
        return grpc.aio.insecure_channel(address, options=options)
    interceptors = bearer_interceptors(security) if security.token else None
    if security.tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if security.tls.server_name:
        options.append(("grpc.ssl_target_name_override", security.tls.server_name))
    return grpc.aio.secure_channel(address, channel_credentials(security.tls), options=options,
                                   interceptors=interceptors)


def sync_channel(address: str, security: Security | None = None) -> grpc.Channel:
    """A blocking channel to a peer with the token and TLS of `security` (default: the process's);
    for the few callers outside an event loop (hybrid replica processes)."""
    security = security if security is not None else installed()
    options = size_options(security.message_bytes if security is not None else MESSAGE_BYTES)
    if security is not None and security.tls is not None:
        if security.tls.server_name:
            options.append(("grpc.ssl_target_name_override", security.tls.server_name))
        chan = grpc.secure_channel(address, channel_credentials(security.tls), options=options)
    else:
        chan = grpc.insecure_channel(address, options=options)
    if security is not None and security.token:
        chan = grpc.intercept_channel(chan, SyncBearerToken(security))
    return chan


async def peer_serving(address: str, timeout_s: float = 2.0) -> bool:
    """True when the peer's health service answers SERVING."""
    async with channel(address) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Backoff:
    """Growing waits, for the retry loops that gRPC's service config cannot express.

    Each of these uses it: waiting for Redis when a service starts (not gRPC at all), retrying the
    gateway's turn records while Redis is away (services/rollout/history.py), waiting for a peer's
    health to say SERVING (the peer answers, but is not ready: nothing to retry), and reopening the
    scheduler's Session stream after it broke (gRPC never retries a stream once a response arrived).
    `wait()` sleeps the next delay, or raises TimeoutError once `give_up_s` have passed since the
    first failure after the last `reset()` (progress).
    """

    def __init__(self, first_s: float = 0.1, max_s: float = 5.0, factor: float = 1.6,
                 give_up_s: float | None = None):
        self.first_s, self.max_s, self.factor, self.give_up_s = first_s, max_s, factor, give_up_s
        self.reset()

    def reset(self) -> None:
        self.delay_s, self.tries, self._failing_since = self.first_s, 0, None

    async def wait(self, what: str) -> None:
        loop = asyncio.get_running_loop()
        if self._failing_since is None:
            self._failing_since = loop.time()
        if self.give_up_s is not None and loop.time() - self._failing_since >= self.give_up_s:
            raise TimeoutError(f"gave up waiting for {what} after {self.give_up_s:.0f}s")
        self.tries += 1
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.max_s, self.delay_s * self.factor)


async def retry_until(attempt: Callable[[], Awaitable[bool]], what: str,
                      timeout_s: float | None = None, max_backoff_s: float = 5.0) -> None:
    """Call `attempt` with backoff until it returns True (or raise TimeoutError after `timeout_s`).

    For waits that are not a gRPC call (see `Backoff`); an exception from `attempt` counts as a
    False (a peer that is not up yet) and is logged now and then."""
    backoff = Backoff(max_s=max_backoff_s, give_up_s=timeout_s)
    while True:
        try:
            if await attempt():
                return
        except Exception as error:  # noqa: BLE001 - a peer that is not up yet; keep trying
            tries = backoff.tries + 1
            if tries in (1, 10) or tries % 50 == 0:
                _log.info("waiting", what=what, error=f"{type(error).__name__}: {error}", tries=tries)
        await backoff.wait(what)


async def wait_for_peers(addresses: dict[str, str], timeout_s: float | None = None) -> None:
    """Block until every named peer reports SERVING (backoff between tries, at most 0.25 s: a health
    check costs a millisecond, and a longer wait after the peer is ready delays the whole start)."""
    for name, address in addresses.items():
        await retry_until(lambda a=address: peer_serving(a), f"peer {name} at {address}", timeout_s,
                          max_backoff_s=0.25)
