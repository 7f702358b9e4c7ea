"""`libra status --watch`: follows a live service (a real `libra serve planner` process on a real
Redis), as plain text blocks when its output is not a terminal and redrawn in place when it is,
and ends by itself when the run's services are gone."""

from __future__ import annotations

import os
import pathlib
import pty
import select
import signal
import subprocess
import sys
import time

import yaml

from libra.config import SERVICES
from libra.redis_server import free_port
from tests.service.test_grpcurl import Planner, _clean_env, _token_file


def _config(tmp_path: pathlib.Path, run_id: str) -> pathlib.Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "run_id": run_id, "run_dir": str(tmp_path / "run"), "metrics": {"base_port": 0},
        "addresses": {s: f"127.0.0.1:{free_port()}" for s in SERVICES},
        "security": {"auth": {"file": _token_file(tmp_path)}}}))
    return path


def _read_until(stream, needle: str, timeout_s: float) -> str:
    seen, deadline = "", time.monotonic() + timeout_s
    while needle not in seen and time.monotonic() < deadline:
        if select.select([stream], [], [], 0.5)[0]:
            chunk = os.read(stream.fileno() if hasattr(stream, "fileno") else stream, 65536).decode(errors="replace")
            if not chunk:
                break
            seen += chunk
    assert needle in seen, f"{needle!r} not shown within {timeout_s:.0f}s:\n{seen}"
    return seen


def test_watch_follows_a_live_service_in_plain_text_and_ends_with_the_run(tmp_path, redis_url, run_id):
    config = _config(tmp_path, run_id)
    port = int(yaml.safe_load(config.read_text())["addresses"]["planner"].rsplit(":", 1)[1])
    log = tmp_path / "planner.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "libra.cli", "serve", "planner", "--config", str(config),
                                    "--redis-url", redis_url], stdout=sink, stderr=subprocess.STDOUT, env=_clean_env())
    planner = Planner(process, port, log)
    watch = None
    try:
        planner.wait_serving()
        watch = subprocess.Popen([sys.executable, "-m", "libra.cli", "status", "--watch", "0.5", "--config",
                                  str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_clean_env())
        shown = _read_until(watch.stdout, "plan      gen 1", 60)
        assert "planner SERVING" in shown and "scheduler UNAVAILABLE" in shown
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        rest, _ = watch.communicate(timeout=60)  # every service gone: the watch ends by itself
        assert watch.returncode == 0
        text = shown + rest.decode(errors="replace")
        assert "\x1b" not in text and text.count("--- libra status") >= 2
        assert "planner UNAVAILABLE" in text.split("--- libra status")[-1]
    finally:
        for child in (watch, process):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()


def test_watch_on_a_terminal_redraws_in_place_until_ctrl_c(tmp_path):
    config = _config(tmp_path, "tty")  # lines are cut to the terminal's width (80 here): a short run id
    main, terminal = pty.openpty()
    watch = subprocess.Popen([sys.executable, "-m", "libra.cli", "status", "--watch", "0.3", "--config", str(config)],
                             stdin=terminal, stdout=terminal, stderr=terminal, env=_clean_env())
    os.close(terminal)
    try:
        shown = _read_until(main, "trainer   127.0.0.1", 60)
        assert shown.startswith("\x1b[H\x1b[J") and "(Ctrl-C stops)" in shown
        _read_until(main, "\x1b[H\x1b[J", 30)  # the next refresh redraws from the top
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        os.close(main)
