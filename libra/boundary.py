"""The RPC boundary: what every servicer method of every service goes through, in one place.

```
 request ─▶ @rpc ─▶ run check ─▶ mutating? ─no──────────────────────────────▶ method ─▶ reply
                    (NOT_FOUND)     │ yes: meta.request_id (INVALID_ARGUMENT if empty)
                                    ▼
                       once(scope "Service.Method", request id)
                         ├─ a reply is stored ─────────────────────────────────────▶ that reply
                         ├─ another call is running it ─▶ wait for it, then its reply
                         └─ first ─▶ method ─▶ reply kept for replays ──────────────▶ reply
 any exception ─▶ status code (one table: libra.errors.status_code); INTERNAL is logged
```

A mutating RPC is one whose request carries a `RequestMeta meta`; it runs at most once per request
id and every repeat answers the first reply, so gRPC may retry it (libra.rpc) and a client may send
it again after a restart. An error stores nothing: a retry after one runs again. Where replies are
kept is the service's choice (`libra.replay`): the run's Redis by default, or `service.replies`.
docs/rpc.md has each RPC's rule. Must not know any service.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from libra import log as liblog
from libra.errors import InvalidArgument, NotFound, Unavailable, status_code
from libra.replay import RedisReplies, Replies

_log = liblog.get("libra.rpc")


@dataclass(frozen=True)
class Rule:
    """How the boundary treats one RPC (read by tests and docs/rpc.md's table)."""

    mutating: bool


def check_run(requested: str, own: str) -> None:
    """Requests name their run; an empty run id means this service's run."""
    if requested and requested != own:
        raise NotFound(f"unknown run {requested!r}: this service serves run {own!r}")


def request_id(meta: Any) -> str:
    """The request id of a mutating RPC (its idempotency key)."""
    if not meta.request_id:
        raise InvalidArgument("meta.request_id is required: every mutating call carries a unique request id "
                              "(repeating one replays the first reply)")
    return meta.request_id


def is_mutating(method: MethodDescriptor) -> bool:
    """The wire's rule: a request with a `RequestMeta meta` field is a mutating call."""
    field = method.input_type.fields_by_name.get("meta")
    return field is not None and field.message_type is not None and field.message_type.name == "RequestMeta"


@dataclass(frozen=True)
class WireRpc:
    """What the boundary needs to know of one RPC, from the generated descriptors."""

    scope: str          # idempotency scope: service and method, e.g. `Trainer.Pause`
    mutating: bool      # `is_mutating` of its request type
    run_field: bool     # its (unary) request names the run in a plain `run_id` field
    reply_type: type    # its reply message class (to decode a stored reply)


@functools.cache
def wire_rpc(servicer_class: type, name: str) -> WireRpc:
    """RPC `name` of the generated servicer base class that `servicer_class` extends."""
    for klass in servicer_class.__mro__:
        if klass.__module__.startswith("libra.v1.") and klass.__module__.endswith("_pb2_grpc"):
            module = importlib.import_module(klass.__module__.removesuffix("_grpc"))
            method = module.DESCRIPTOR.services_by_name[klass.__name__.removesuffix("Servicer")].methods_by_name[name]
            run_field = not method.client_streaming and "run_id" in method.input_type.fields_by_name
            return WireRpc(f"{method.containing_service.name}.{method.name}", is_mutating(method), run_field,
                           GetMessageClass(method.output_type))
    raise TypeError(f"{servicer_class.__name__} does not extend a generated servicer of libra.v1")


def replies_of(service: Any) -> Replies:
    """Where `service` keeps replies: its own `replies`, else its run's Redis."""
    replies = getattr(service, "replies", None)
    if replies is not None:
        return replies
    if getattr(service, "store", None) is None:
        raise Unavailable(f"{service.name} is not connected to Redis yet; retry shortly")
    return RedisReplies(service.store)


async def once(replies: Replies, scope: str, rid: str, execute: Callable[[], Any], reply_type: type) -> Message:
    """Run `execute` (sync or async) at most once per (scope, request id); repeats answer its reply.

    A duplicate that arrives while the first call runs waits for it (bounded by its own deadline:
    gRPC cancels it then). If the first call fails or is cancelled, nothing is kept and the next
    claim runs it again."""
    while True:
        claim = await replies.claim(scope, rid)
        if claim.reply is not None:
            return claim.reply if isinstance(claim.reply, Message) else reply_type.FromString(claim.reply)
        if claim.owned:
            break
        await replies.wait(claim)
    try:
        async with replies.hold(claim):
            reply = execute()
            if inspect.isawaitable(reply):
                reply = await reply
    except BaseException:
        try:
            await asyncio.shield(replies.release(claim))
        except Exception as error:  # noqa: BLE001 - the claim's lease runs out instead
            _log.warning("could not release a claim", scope=scope, request_id=rid, error=str(error))
        raise
    await replies.settle(claim, reply)
    return reply


async def apply(servicer: Any, name: str, request: Any, execute: Callable[[], Any],
                declared: bool | None = None) -> Any:
    """The boundary's checks and replay for RPC `name` of `servicer` (also used per stream message).

    `declared` is the servicer's `rpc(mutating=...)`; a declaration the wire contradicts is a bug."""
    wire = wire_rpc(type(servicer), name)
    if declared is not None and declared != wire.mutating:
        raise TypeError(f"{name} is declared rpc(mutating={declared}) but its request "
                        f"{'carries' if wire.mutating else 'has no'} RequestMeta meta")
    service = servicer.service
    if wire.mutating:
        check_run(request.meta.run_id, service.run_id)
        rid = request_id(request.meta)
        return await once(replies_of(service), wire.scope, rid, execute, wire.reply_type)
    if wire.run_field:
        check_run(request.run_id, service.run_id)
    return await _result(execute())


async def _result(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _abort(context: grpc.aio.ServicerContext, error: BaseException, name: str) -> None:
    code = status_code(error)
    if code == grpc.StatusCode.INTERNAL:
        _log.exception("rpc failed", method=name)
        message = f"internal error in {name}: {type(error).__name__}: {error}"
    else:
        message = str(error) or type(error).__name__
    await context.abort(code, message)


def rpc(*, mutating: bool = False) -> Callable[[Callable], Callable]:
    """Declare a servicer method's rule and put it behind the boundary (unary or streaming).

    `mutating=True` must match the wire (the request has `RequestMeta meta`); the contract test
    (tests/service/test_rpc_contract.py) checks every RPC of every service against it."""

    def decorate(method: Callable) -> Callable:
        name = method.__name__
        if inspect.isasyncgenfunction(method):
            if mutating:
                raise TypeError(f"{name}: a streamed reply cannot be replayed; a mutating RPC is unary")

            @functools.wraps(method)
            async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext):
                try:
                    await apply(self, name, request, lambda: None, mutating)
                    async for item in method(self, request, context):
                        yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as error:  # noqa: BLE001 - mapped to a status, service keeps running
                    await _abort(context, error, name)
            wrapper = stream
        else:
            @functools.wraps(method)
            async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext):
                try:
                    return await apply(self, name, request, lambda: method(self, request, context), mutating)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as error:  # noqa: BLE001 - mapped to a status, service keeps running
                    await _abort(context, error, name)
            wrapper = unary
        wrapper.__rpc_rule__ = Rule(mutating)
        return wrapper
    return decorate
