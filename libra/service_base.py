"""Helpers every service uses: Redis with retries at start, and request-field validation.

The run check and the request id of a call are the RPC boundary's (`libra.boundary`).
"""

from __future__ import annotations

from typing import Any

from libra.errors import InvalidArgument
from libra.rpc import retry_until
from libra.security import redacted


async def connect_store(url: str, run_id: str, timeout_s: float | None = None):
    """Connect to Redis (retrying with backoff until it answers) and return a StateStore."""
    from libra.state import StateStore

    if not url:
        raise InvalidArgument("redis.url is empty: pass --redis-url or set LIBRA_REDIS_URL")
    holder: dict[str, Any] = {}

    async def attempt() -> bool:
        store = await StateStore.connect(url, run_id)
        await store.ping()
        holder["store"] = store
        return True

    await retry_until(attempt, f"redis at {redacted(url)}", timeout_s)
    return holder["store"]


def require(value: Any, field: str, hint: str = "") -> Any:
    """Raise INVALID_ARGUMENT when a required request field is empty."""
    if value in (None, "", 0) or (hasattr(value, "__len__") and len(value) == 0):
        raise InvalidArgument(f"{field} is required" + (f": {hint}" if hint else ""))
    return value
