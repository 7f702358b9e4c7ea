"""Shared fixtures: a real Redis for the whole session, a fresh run id per test, and an event loop.

- `redis_url`: `$LIBRA_TEST_REDIS_URL` if set, else a private `redis-server` (no persistence) on a
  free port, stopped at the end of the session.
- `run_id`: unique per test, so tests never share keys even on a shared Redis.
- `arun`: runs a coroutine on this test's event loop (tests stay plain sync functions; no
  pytest-asyncio). Every async object a test uses must be made on that loop. A loop still running
  after TASK_DUMP_AFTER_S prints every task's stack to stderr, so a hang that pytest-timeout ends
  (600 s) says which await never returned.
- `store` / `new_store`: `StateStore`s for `run_id` on that loop, closed after the test.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import uuid
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import pytest

from libra.redis_server import INSTALL_HINT, PrivateRedis

T = TypeVar("T")
TASK_DUMP_AFTER_S = 420.0  # below pytest-timeout's 600 s (pyproject.toml)

@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Redis that tests may write to (keys are namespaced by `run_id`)."""
    external = os.environ.get("LIBRA_TEST_REDIS_URL")
    if external:
        yield external
        return
    if shutil.which("redis-server") is None:
        pytest.fail(INSTALL_HINT)
    server = PrivateRedis(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A run id no other test uses: the test's name (trimmed) plus a random suffix."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", request.node.name)[:40]
    return f"t-{name}-{uuid.uuid4().hex[:12]}"


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Where every task of `loop` waits (its coroutine's frames), for a test that hangs."""
    tasks = asyncio.all_tasks(loop)
    print(f"\n=== the test's event loop still runs after {TASK_DUMP_AFTER_S:.0f} s: {len(tasks)} tasks ===",
          file=sys.stderr)
    for task in tasks:
        print(f"--- {task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


@pytest.fixture
def arun() -> Iterator[Callable[[Awaitable[T]], T]]:
    """Run a coroutine to completion on this test's own event loop."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # grpc.aio creates calls (stub.Method(...)) before they are awaited
    watchdog = loop.call_later(TASK_DUMP_AFTER_S, _dump_tasks, loop)
    try:
        yield loop.run_until_complete
    finally:
        watchdog.cancel()
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


@pytest.fixture
def new_store(redis_url: str, run_id: str, arun: Callable) -> Iterator[Callable[..., Awaitable[Any]]]:
    """`await new_store(**options)`: another StateStore on its own connection (default: this run)."""
    from libra.state import StateStore

    opened: list[StateStore] = []

    async def open_store(run: str | None = None, **options: Any) -> StateStore:
        store = await StateStore.connect(redis_url, run or run_id, **options)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        arun(store.close())


@pytest.fixture
def store(new_store: Callable, arun: Callable) -> Any:
    """A StateStore for this test's run, connected on this test's event loop."""
    return arun(new_store())


@pytest.fixture(scope="module", autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    """A module that builds a backend in this process (Megatron's world of one) leaves torch's
    default process group behind; a later test that forks ranks would inherit it. Tear it down
    after each module."""
    yield
    import sys

    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
