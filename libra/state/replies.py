"""Request-id idempotency in Redis: which request ids ran, the first reply to each, and the claim
held by the call that is running one.

Owns the `req:*`, `claim:*` and `reply:*` keys. Knows nothing of gRPC: replies are bytes (the
RPC boundary, `libra.boundary`, serializes them); scopes are names like `Trainer.Pause`.

The boundary's sequence for one mutating call (`libra.replay.RedisReplies`):

```
 claim_request ──▶ "reply"   a stored reply: answer it (a replay)
               ──▶ "claimed" this call runs it; renew_claim while it runs, then
                             settle_request (reply kept, claim dropped) or, on an error,
                             release_claim (a retry runs it again)
               ──▶ "running" another call holds the claim: wait and claim again
```

A claim is a lease: a call that dies (its process killed) stops renewing it, so it expires and a
retry runs the request. `once` / `remember_result` / `recall_result` / `forget_request` are plain
markers without a claim; no service uses them any more (a marker set before work that then fails
would make the retry skip the work): every mutating RPC is once-per-request-id at the boundary.
"""

from __future__ import annotations

from libra.errors import InvalidArgument
from libra.state.base import StoreBase

DAY_S = 86_400

# KEYS: claim, reply   ARGV: token, lease ms
# Returns {2, reply} stored reply, {1} claimed by this token, {0} another call holds the claim.
CLAIM = """
local reply = redis.call('GET', KEYS[2])
if reply then return {2, reply} end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1} end
return {0}
"""

# KEYS: claim, reply   ARGV: token, reply, ttl s. The first reply stays (NX); the claim goes if it is ours.
SETTLE = """
redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', ARGV[3])
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""

# KEYS: claim   ARGV: token [, lease ms]. Renews (with a lease) or drops (without) a claim we hold.
TOUCH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) else redis.call('DEL', KEYS[1]) end
return 1
"""


def _check_ttl(ttl_s: int) -> int:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1:
        raise InvalidArgument(f"ttl_s must be an int >= 1; got {ttl_s!r}")
    return ttl_s


def _lease_ms(lease_s: float) -> int:
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not lease_s >= 0.01:
        raise InvalidArgument(f"lease_s must be a number of seconds >= 0.01; got {lease_s!r}")
    return int(lease_s * 1000)


class ReplyStore(StoreBase):
    """Idempotency markers, claims and stored replies of mutating requests, per scope."""

    # -- the boundary's claim protocol ---------------------------------------------------------
    async def claim_request(self, scope: str, request_id: str, token: str,
                            lease_s: float) -> tuple[str, bytes | None]:
        """("reply", bytes) if a reply is stored; ("claimed", None) if `token` now holds the claim
        for `lease_s`; ("running", None) if another call holds it."""
        keys = [self.keys.claim(scope, request_id), self.keys.reply(scope, request_id)]
        found = await self._eval(CLAIM, keys, [token, _lease_ms(lease_s)])
        state = int(found[0])
        if state == 2:
            return "reply", bytes(found[1])
        return ("claimed" if state == 1 else "running"), None

    async def renew_claim(self, scope: str, request_id: str, token: str, lease_s: float) -> bool:
        """Extend our claim by `lease_s`; False if it is no longer ours (it expired)."""
        keys = [self.keys.claim(scope, request_id)]
        return bool(await self._eval(TOUCH, keys, [token, _lease_ms(lease_s)]))

    async def settle_request(self, scope: str, request_id: str, token: str, reply: bytes,
                             ttl_s: int = DAY_S) -> None:
        """Keep `reply` for replays (`ttl_s`; a reply stored first stays) and drop our claim."""
        keys = [self.keys.claim(scope, request_id), self.keys.reply(scope, request_id)]
        await self._eval(SETTLE, keys, [token, bytes(reply), _check_ttl(ttl_s)])

    async def release_claim(self, scope: str, request_id: str, token: str) -> bool:
        """Drop our claim without a reply (the call failed): a retry runs the request again."""
        return bool(await self._eval(TOUCH, [self.keys.claim(scope, request_id)], [token]))

    # -- plain markers ---------------------------------------------------------------------------
    async def once(self, scope: str, request_id: str, ttl_s: int = DAY_S) -> bool:
        """True the first time `request_id` is seen in `scope` (within `ttl_s`); False for replays."""
        key = self.keys.request(scope, request_id)
        redis = await self._ready()
        return bool(await redis.set(key, repr(self._clock()), nx=True, ex=_check_ttl(ttl_s)))

    async def remember_result(self, scope: str, request_id: str, payload: bytes, ttl_s: int = DAY_S) -> bool:
        """Keep the first answer to a request for its replays; False if one was kept already."""
        key = self.keys.reply(scope, request_id)
        redis = await self._ready()
        return bool(await redis.set(key, bytes(payload), nx=True, ex=_check_ttl(ttl_s)))

    async def recall_result(self, scope: str, request_id: str) -> bytes | None:
        """The answer kept for a request; None if the first call has not finished (or it expired)."""
        key = self.keys.reply(scope, request_id)
        redis = await self._ready()
        found = await redis.get(key)
        return bytes(found) if found is not None else None

    async def forget_request(self, scope: str, request_id: str) -> None:
        """Drop a request's marker and answer, so that a retry after a failed first call runs again."""
        redis = await self._ready()
        await redis.delete(self.keys.request(scope, request_id), self.keys.reply(scope, request_id))
