"""The gate in front of every method of a Libra gRPC server, and the client side of the token.

```
 call ─▶ Gate.intercept_service ─┬─ open service (health, reflection)? ───────────────┐
                                 ├─ token missing / wrong ─▶ UNAUTHENTICATED (reason) │ (request never parsed)
                                 └─ ok ─────────────────────────────────────────────── ▶ decode request
                                      cannot be decoded ─▶ INVALID_ARGUMENT ◀─────────┘   (each message of a stream)
                                      decoded ─▶ the servicer (libra.boundary.rpc)
```
The token is compared in constant time (`bearer_refusal`). gRPC's own answer to a request that
does not parse is UNKNOWN with the parser's exception; the gate makes it INVALID_ARGUMENT, which
is what it is. Client side: `bearer_interceptors` add the token to every call of a channel (unary and
streaming), `channel_credentials` / `server_credentials` build TLS from the run's material.
"""

from __future__ import annotations

import collections
import inspect
from typing import Any, Callable

import grpc

from libra.security.credentials import Security, TlsMaterial, bearer_refusal

KINDS = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
         (True, True): "stream_stream"}


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _safe(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 - any parse failure is the caller's bad request
            return _Undecodable(error)
    return parse


def _bad(method: str, item: _Undecodable) -> str:
    return f"the request to {method} is not a valid message of its type: {item.error}"


def _checking(behavior: Callable, request_streaming: bool, method: str) -> Callable | None:
    """`behavior` with each request checked (an undecodable one aborts INVALID_ARGUMENT); None when
    `behavior` is not an asyncio handler (then it is left as it is)."""
    if inspect.isasyncgenfunction(behavior):
        generator = True
    elif inspect.iscoroutinefunction(behavior):
        generator = False
    else:
        return None

    async def checked_stream(requests, context):
        async for item in requests:
            if isinstance(item, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _bad(method, item))
            yield item

    async def check(request, context):
        if request_streaming:
            return checked_stream(request, context)
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _bad(method, request))
        return request

    if generator:
        async def stream(request, context):
            async for item in behavior(await check(request, context), context):
                yield item
        return stream

    async def unary(request, context):
        return await behavior(await check(request, context), context)
    return unary


class Gate(grpc.aio.ServerInterceptor):
    """Token check (unless `security` is None or has no token) and safe decoding, for every method."""

    def __init__(self, security: Security | None):
        self.token = security.token if security is not None else None
        self.open_services = security.open_services if security is not None else frozenset()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if self.token is not None and method.split("/")[1] not in self.open_services:
            header = next((value for key, value in details.invocation_metadata or () if key == "authorization"), None)
            refusal = bearer_refusal(header if isinstance(header, str) else None, self.token)
            if refusal:
                return _refused(handler, refusal)
        return _decoding(handler, method)


def _decoding(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    if handler.request_deserializer is None:
        return handler
    kind = KINDS[(handler.request_streaming, handler.response_streaming)]
    checked = _checking(getattr(handler, kind), handler.request_streaming, method)
    if checked is None:
        return handler
    return handler._replace(request_deserializer=_safe(handler.request_deserializer), **{kind: checked})


def _refused(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    kind = KINDS[(handler.request_streaming, handler.response_streaming)]
    return handler._replace(request_deserializer=None, **{kind: refuse})  # the request is never parsed


class _Bearer:
    def __init__(self, security: Security):
        self.pairs = security.metadata()

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *self.pairs))


class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def bearer_interceptors(security: Security) -> list:
    """Interceptors that add `authorization: Bearer TOKEN` to every call of an asyncio channel (one
    per call kind: grpc.aio files an interceptor under the first kind it implements only)."""
    return [kind(security) for kind in (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamUnary,
                                         _BearerStreamStream)]


class _SyncDetails(collections.namedtuple("_SyncDetails", ("method", "timeout", "metadata", "credentials",
                                                          "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class SyncBearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                      grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """`BearerToken` for a blocking channel (`grpc.intercept_channel`)."""

    def __init__(self, security: Security):
        self.pairs = security.metadata()

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _SyncDetails(details.method, details.timeout, [*(details.metadata or ()), *self.pairs],
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def channel_credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    """TLS toward a peer; our certificate goes along (the peer may require one)."""
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def server_credentials(tls: TlsMaterial) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca,
                                       require_client_auth=tls.require_client_cert)
