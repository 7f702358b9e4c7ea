"""Which asyncio event loop a Libra process runs (the run config's `event_loop`).

uvloop (libuv's loop, a well-kept drop-in for asyncio's) where it is installed, which it is with
Libra on Linux and macOS: every service and hf engine is a loop of small network messages (gRPC
streams, HTTP to the engines, Redis); in paired quickstart runs on uvloop the rollout gateway, the
scheduler and the engines spent ~6–10% less CPU, which the end-to-end race does not resolve from
its noise (docs/benchmarks.md, "Time to first learning").
`asyncio`: Python's own loop (a platform without uvloop, or to rule the loop out when debugging).

Must not know: what runs on the loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any, Coroutine

CHOICES = ("auto", "uvloop", "asyncio")


def available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def chosen(choice: str) -> str:
    """The loop `choice` runs: "uvloop" or "asyncio" ("auto": uvloop where installed)."""
    if choice not in CHOICES:
        raise ValueError(f"event_loop must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "auto":
        return "uvloop" if available() else "asyncio"
    return choice


def run(main: Coroutine[Any, Any, Any], choice: str = "auto") -> Any:
    """`asyncio.run(main)` on the loop `choice` names."""
    if chosen(choice) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def new_loop(choice: str = "auto") -> asyncio.AbstractEventLoop:
    """A new event loop of the kind `choice` names (for aiohttp's `web.run_app(loop=...)`)."""
    if chosen(choice) == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()
