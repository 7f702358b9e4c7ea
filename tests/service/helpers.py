"""Helpers for service tests: a real gRPC server on port 0 with a real Redis, in the test's loop."""

from __future__ import annotations

from typing import Any

import grpc

from libra.config import build_run_config
from libra.runtime import RunningService


def run_config(redis_url: str, run_id: str, tmp_path, **sections: Any):
    tree = {"run_id": run_id, "run_dir": str(tmp_path / "run"), "redis": {"url": redis_url},
            "metrics": {"base_port": 0}, **sections}
    return build_run_config(tree, env={})


async def start(service) -> tuple[RunningService, grpc.aio.Channel]:
    running = await RunningService(service, 0, host="127.0.0.1").start()
    return running, grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")


def code_of(arun, call) -> grpc.StatusCode:
    """The status code a call fails with (the test fails if it succeeds)."""
    try:
        arun(call)
    except grpc.aio.AioRpcError as error:
        return error.code()
    raise AssertionError("the call succeeded; expected an error status")
