"""A vLLM worker dies with the process that launched it, even when that process is SIGKILLed:
the api_server gets SIGTERM from the kernel and takes its EngineCore and worker processes down
itself (a SIGKILLed api_server would leave them running), so nothing holds the worker's port.

The launching process stands in for the rollout service (it starts the worker exactly as
WorkerPool does: `VllmWorkerProcess.start`). The transformers engine, launched the same way, is
covered by tests/integration/test_up_signals.py (its SIGKILL case kills the rollout service).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from libra.redis_server import free_port
from tests.fixtures_model import make_random_llama

pytestmark = pytest.mark.slow
LAUNCHER = textwrap.dedent("""
    import asyncio, sys, time
    from libra.services.rollout.config import WorkerConfig
    from libra.services.rollout.engines.vllm_worker import VllmWorkerProcess
    config = WorkerConfig(engine={"type": "vllm", "kv_cache_gib": 0.125}, max_model_len=512, max_num_seqs=16,
                          cpu_threads=1)
    worker = VllmWorkerProcess(config, sys.argv[1], 0, sys.argv[2], port=int(sys.argv[3])).start()
    asyncio.run(worker.wait_ready(240))
    print(worker.process.pid, flush=True)
    time.sleep(600)
""")


def _group(pgid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, …
                found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_a_vllm_worker_dies_with_its_sigkilled_launcher(tmp_path):
    pytest.importorskip("vllm")
    model, port = make_random_llama(tmp_path / "model", seed=0), free_port()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(model), str(tmp_path / "logs"), str(port)],
                                stdout=subprocess.PIPE, text=True)
    server = 0
    try:
        server = int(launcher.stdout.readline() or 0)
        assert server, f"the worker did not start: {(tmp_path / 'logs' / 'worker-0.log').read_text()[-3000:]}"
        tree = _group(server)
        assert len(tree) >= 3 and not _port_free(port), tree  # api_server, EngineCore, worker process
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while _group(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group(server) == [], "vLLM processes outlived the SIGKILLed launcher"
        assert _port_free(port)
    finally:
        launcher.kill()
        launcher.wait()
        if server:
            try:
                os.killpg(server, signal.SIGKILL)
            except ProcessLookupError:
                pass
