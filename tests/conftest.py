"""Shared fixtures: a real Redis for the whole session, a fresh run id per test, and an event loop.

- `redis_url`: `$LIBRA_TEST_REDIS_URL` if set, else a private `redis-server` (no persistence) on a
  free port, stopped at the end of the session.
- `run_id`: unique per test, so tests never share keys even on a shared Redis.
- `arun`: runs a coroutine on this test's event loop (tests stay plain sync functions; no
  pytest-asyncio). Every async object a test uses must be made on that loop.
- `store` / `new_store`: `StateStore`s for `run_id` on that loop, closed after the test.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import pytest

T = TypeVar("T")
INSTALL_HINT = ("redis-server is needed by the service and integration tests: install it "
                "(`apt-get install redis-server`, `brew install redis`, or `conda install -c conda-forge "
                "redis`) or point LIBRA_TEST_REDIS_URL at a Redis you can flush keys in")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start_redis(binary: str, workdir: str) -> tuple[subprocess.Popen, int]:
    """Start redis-server on a free port; retry with another port if one was taken meanwhile."""
    for _ in range(3):
        port = _free_port()
        with open(os.path.join(workdir, f"redis-{port}.log"), "wb") as log:
            process = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", "",
                 "--appendonly", "no", "--daemonize", "no"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process.poll() is None:
            if _answers_ping(port):
                return process, port
            time.sleep(0.02)
        process.kill()
        process.wait()
    pytest.fail(f"redis-server did not start; see the logs in {workdir}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Redis that tests may write to (keys are namespaced by `run_id`)."""
    external = os.environ.get("LIBRA_TEST_REDIS_URL")
    if external:
        yield external
        return
    binary = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
                                               else None)
    if binary is None:
        pytest.fail(INSTALL_HINT)
    process, port = _start_redis(binary, str(tmp_path_factory.mktemp("redis")))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A run id no other test uses: the test's name (trimmed) plus a random suffix."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", request.node.name)[:40]
    return f"t-{name}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def arun() -> Iterator[Callable[[Awaitable[T]], T]]:
    """Run a coroutine to completion on this test's own event loop."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # grpc.aio creates calls (stub.Method(...)) before they are awaited
    try:
        yield loop.run_until_complete
    finally:
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
