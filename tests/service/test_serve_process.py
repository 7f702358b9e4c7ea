"""`libra serve` as a real process: it binds loopback only (the gRPC port and its metrics port),
refuses to start without a token, and once started refuses a call without the token and serves one
with it."""

from __future__ import annotations

import ipaddress
import os
import pathlib
import subprocess
import sys
import time

import grpc
import yaml

from libra.redis_server import free_port
from libra.v1 import planner_pb2, planner_pb2_grpc

TOKEN = "tok-" + "0123456789abcdef" * 2


def _listening(port: int) -> set[ipaddress.IPv4Address]:
    """The IPv4 addresses (v4-mapped ones of IPv6 sockets too) that listen on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state != "0A" or int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw)
            found.add(ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip)
    return found


def test_libra_serve_listens_on_loopback_and_wants_its_token(tmp_path, redis_url, run_id, arun):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    port, metrics = free_port(), free_port()
    tree = {"run_id": run_id, "run_dir": str(tmp_path / "run"), "metrics": {"base_port": metrics}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
    command = [sys.executable, "-m", "libra.cli", "serve", "planner", "--config", str(tmp_path / "run.yaml"),
               "--redis-url", redis_url, "--port", str(port)]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2 and "security.auth: no token" in refused.stderr, refused.stderr
    token_file = tmp_path / "secret"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    tree["security"] = {"auth": {"file": str(token_file)}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
    log = tmp_path / "planner.log"
    with open(log, "wb") as sink:  # (free_port's ports are outside the range outgoing connections take)
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while not (_listening(port) and _listening(metrics)) and process.poll() is None:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    try:
        assert process.poll() is None, log.read_text()
        loopback = {ipaddress.ip_address("127.0.0.1")}
        assert _listening(port) == _listening(metrics) == loopback  # 127.0.0.1 only, metrics too

        async def calls():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as bare:
                stub = planner_pb2_grpc.PlannerStub(bare)
                try:
                    await stub.GetPlan(planner_pb2.GetPlanRequest(), timeout=10)
                except grpc.aio.AioRpcError as error:
                    without = error.code()
                plan = await stub.GetPlan(planner_pb2.GetPlanRequest(), timeout=10, wait_for_ready=True,
                                          metadata=(("authorization", f"Bearer {TOKEN}"),))
            return without, plan
        without, plan = arun(calls())
        assert without == grpc.StatusCode.UNAUTHENTICATED and plan.generation >= 1
    finally:
        process.terminate()
        process.wait(30)
