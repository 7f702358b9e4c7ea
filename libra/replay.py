"""Where the RPC boundary keeps the first reply to each request id: two stores, one protocol.

    RedisReplies   the run's Redis (`libra.state.replies`): replies live a day (`REPLY_TTL_S`) and
                   survive restarts; the call running a request holds a claim, a lease of
                   `CLAIM_LEASE_S` renewed while it runs, so a duplicate waits for it and a call
                   whose process died is run again by the next retry once the lease ran out.
    MemoryReplies  this process, the newest `capacity` requests (the scheduler: its routing state
                   is in memory too, and a restarted scheduler must apply the reports that are
                   sent again to rebuild its loads, so its replay window must not outlive it).

The protocol (`libra.boundary.once` drives it):

```
 claim(scope, id) ─┬─ Claim.reply set ─────▶ a replay: answer the stored reply
                   ├─ Claim.owned ─────────▶ hold(claim) while running ─┬─ settle(claim, reply)
                   │                                                    └─ release(claim) on an error
                   └─ neither (running) ───▶ wait(claim), then claim again
```
Must not know gRPC or any service: replies are protobuf messages, scopes are names.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from google.protobuf.message import Message

from libra import log as liblog
from libra.state.replies import DAY_S

_log = liblog.get("libra.replay")
REPLY_TTL_S = DAY_S
"""How long Redis keeps a reply for replays (a retry comes within seconds; a restarted client
that repeats its deterministic request ids within hours)."""
CLAIM_LEASE_S = 30.0
"""The claim of a running call expires this long after its last renewal (renewed every third)."""
WAIT_FIRST_S, WAIT_MAX_S = 0.02, 0.5
"""A duplicate of a running call looks again after these growing waits (until its deadline)."""


@dataclass
class Claim:
    """The outcome of claiming a request id: a stored reply, the right to run it, or neither."""

    scope: str
    request_id: str
    reply: Message | bytes | None = None
    owned: bool = False
    handle: Any = None  # the store's own: a Redis token, a memory entry
    waits: int = 0


class Replies(Protocol):
    async def claim(self, scope: str, request_id: str) -> Claim: ...

    async def wait(self, claim: Claim) -> None: ...

    def hold(self, claim: Claim) -> contextlib.AbstractAsyncContextManager: ...

    async def settle(self, claim: Claim, reply: Message) -> None: ...

    async def release(self, claim: Claim) -> None: ...


class RedisReplies:
    """Replies in the run's Redis, serialized; claims are leases renewed while the call runs."""

    def __init__(self, store: Any, ttl_s: int = REPLY_TTL_S, lease_s: float = CLAIM_LEASE_S):
        self.store, self.ttl_s, self.lease_s = store, ttl_s, lease_s

    async def claim(self, scope: str, request_id: str) -> Claim:
        token = uuid.uuid4().hex
        state, reply = await self.store.claim_request(scope, request_id, token, self.lease_s)
        return Claim(scope, request_id, reply=reply, owned=state == "claimed", handle=token)

    async def wait(self, claim: Claim) -> None:
        claim.waits += 1
        await asyncio.sleep(min(WAIT_MAX_S, WAIT_FIRST_S * 1.5 ** claim.waits))

    @contextlib.asynccontextmanager
    async def hold(self, claim: Claim) -> AsyncIterator[None]:
        async def renew() -> None:
            while True:
                await asyncio.sleep(self.lease_s / 3)
                if not await self.store.renew_claim(claim.scope, claim.request_id, claim.handle, self.lease_s):
                    _log.warning("a call outlived its claim; a duplicate may run it too", scope=claim.scope,
                                 request_id=claim.request_id)
                    return
        renewer = asyncio.get_running_loop().create_task(renew())
        try:
            yield
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)

    async def settle(self, claim: Claim, reply: Message) -> None:
        await self.store.settle_request(claim.scope, claim.request_id, claim.handle, reply.SerializeToString(),
                                        self.ttl_s)

    async def release(self, claim: Claim) -> None:
        await self.store.release_claim(claim.scope, claim.request_id, claim.handle)


class _Running:
    """A memory entry while its call runs; a duplicate waits on `done` (made only when needed)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done: asyncio.Event | None = None

    def finish(self) -> None:
        if self.done is not None:
            self.done.set()


class MemoryReplies:
    """Replies in this process: the newest `capacity` requests (oldest forgotten first)."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1; got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], Message | _Running] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, scope: str, request_id: str, reply: Message) -> None:
        """Remember `reply` as the first reply to a request (a restarted owner puts back replies it
        had saved elsewhere, so their repeats are replays)."""
        self._entries[(scope, request_id)] = reply
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    async def claim(self, scope: str, request_id: str) -> Claim:
        key = (scope, request_id)
        found = self._entries.get(key)
        if isinstance(found, Message):
            return Claim(scope, request_id, reply=found)
        if found is not None:
            return Claim(scope, request_id, handle=found)
        running = self._entries[key] = _Running()
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return Claim(scope, request_id, owned=True, handle=running)

    async def wait(self, claim: Claim) -> None:
        running: _Running = claim.handle
        if running.done is None:
            running.done = asyncio.Event()
        await running.done.wait()

    def hold(self, claim: Claim) -> contextlib.AbstractAsyncContextManager:
        return contextlib.nullcontext()

    async def settle(self, claim: Claim, reply: Message) -> None:
        key = (claim.scope, claim.request_id)
        if self._entries.get(key) is claim.handle:
            self._entries[key] = reply
        claim.handle.finish()

    async def release(self, claim: Claim) -> None:
        key = (claim.scope, claim.request_id)
        if self._entries.get(key) is claim.handle:
            del self._entries[key]
        claim.handle.finish()
