"""The Redis step of a Slurm job (libra/slurm/redis_step.py) with a real redis-server.

Slurm ends a job by sending SIGTERM to every process of every step at once; the step must keep
Redis up for the services that are still draining, with what they wrote before (AOF), and stop
only when the job says so (stop file, then SHUTDOWN). Its Redis asks for a password and listens
on the address it is given only.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import redis

from libra.redis_server import free_port
from libra.slurm.redis_step import write_config


def _ping(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            return
        except redis.ConnectionError:
            assert time.monotonic() < deadline, f"no Redis at {url}"
            time.sleep(0.1)


def test_redis_outlives_the_jobs_sigterm_keeps_its_data_and_stops_when_told(tmp_path):
    port, password = free_port(), "s3cret-for-the-test"
    conf, stop = tmp_path / "redis.conf", tmp_path / "redis.stop"
    write_config(conf, "127.0.0.1", port, password, tmp_path / "data")
    text = conf.read_text()
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    for line in ("bind 127.0.0.1", f"requirepass {password}", "appendonly yes", "appendfsync always",
                 "protected-mode yes"):
        assert line in text.splitlines()
    log = open(tmp_path / "step.log", "wb")
    step = subprocess.Popen([sys.executable, "-m", "libra.slurm.redis_step", "--config", str(conf), "--stop-file",
                             str(stop)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    try:
        _ping(url)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping()  # no password: refused
        redis.Redis.from_url(url).set("libra:test", "written before the signal")
        os.killpg(step.pid, signal.SIGTERM)  # what Slurm does to every process of the step
        time.sleep(1.0)
        assert step.poll() is None, "the step must outlive the job's SIGTERM"
        _ping(url)
        assert redis.Redis.from_url(url).get("libra:test") == b"written before the signal"  # from the AOF
        stop.touch()
        try:
            redis.Redis.from_url(url).shutdown()
        except redis.ConnectionError:
            pass
        assert step.wait(20) == 0
    finally:
        if step.poll() is None:
            os.killpg(step.pid, signal.SIGKILL)
        log.close()
    output = (tmp_path / "step.log").read_text()
    assert "starting it again from its AOF" in output and "redis-server stopped" in output
    assert list((tmp_path / "data").glob("appendonlydir/*.aof"))


def test_a_redis_that_keeps_crashing_is_given_up(tmp_path):
    conf = tmp_path / "redis.conf"
    conf.write_text("bind 127.0.0.1\nport 1\nunknown-directive yes\n")  # redis-server refuses it at once
    done = subprocess.run([sys.executable, "-m", "libra.slurm.redis_step", "--config", str(conf), "--stop-file",
                           str(tmp_path / "stop"), "--restarts", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "giving up" in done.stdout
