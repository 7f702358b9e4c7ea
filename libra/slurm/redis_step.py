"""The Redis step of a Slurm job: redis-server with a password, on the job's network, persisted.

```
 job.py ── write_config: bind NODE_ADDRESS, requirepass, appendonly (redis.appendfsync), dir RUN_DIR/redis
        └─ srun … python -m libra.slurm.redis_step --config C --stop-file F
              └─ redis-server C        (same process group: Slurm's signals and its cleanup reach it)
 SIGTERM to the job (scancel, node failure elsewhere) ─▶ all steps at once, Redis too:
        redis-server saves its AOF and exits ─▶ no stop file yet ─▶ started again at once, from the AOF
        (the services are draining into it: checkpoints, stream acks) ─▶ job.py: stop file + SHUTDOWN
```
Slurm ends a job by signalling every process of every step at the same moment; Redis cannot be
told to ignore SIGTERM. This step ignores it itself and starts redis-server again whenever it
exits before job.py wrote the stop file, so the services' drain finds Redis back within moments
(a service waits out a Redis outage: libra/runtime.py); job.py stops it last. A crash is restarted
the same way, at most `--restarts` times, with a short backoff. SIGKILL (Slurm's, after KillWait)
ends everything; the AOF, fsynced every second, keeps what was written before.
Exit: 0 stopped through the stop file, 1 too many restarts.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time

from libra import procs


def write_config(path: pathlib.Path, address: str, port: int, password: str, data_dir: pathlib.Path,
                 appendfsync: str = "always") -> None:
    """A redis.conf (mode 0600: it holds the password) for the job's Redis."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"bind {address}", f"port {port}", "protected-mode yes", f"requirepass {password}",
             "appendonly yes", f"appendfsync {appendfsync}", 'save ""', f'dir "{data_dir}"', 'logfile ""',
             "daemonize no"]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, ("\n".join(lines) + "\n").encode())
    finally:
        os.close(fd)


def _say(message: str) -> None:
    print(f"[libra.slurm.redis_step {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(server: str, config: pathlib.Path, stop_file: pathlib.Path, restarts: int) -> int:
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, frame: signals.append(number))
    failures = 0
    while True:
        heard = len(signals)
        proc = subprocess.Popen(procs.with_parent_death_signal([server, str(config)], signal.SIGTERM))
        code = proc.wait()
        if stop_file.exists():
            _say(f"redis-server stopped (status {code})")
            return 0
        signalled = len(signals) > heard
        failures += 0 if signalled else 1
        if failures > restarts:
            _say(f"redis-server exited with status {code} {failures} times; giving up")
            return 1
        why = "on the job's stop signal, while the services still drain into it" if signalled \
            else f"with status {code}"
        _say(f"redis-server exited {why}; starting it again from its AOF")
        time.sleep(0.0 if signalled else min(5.0, float(failures)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libra.slurm.redis_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, type=pathlib.Path, help="redis.conf (write_config)")
    parser.add_argument("--stop-file", required=True, type=pathlib.Path, help="exists: a Redis exit is the end")
    parser.add_argument("--server", default="redis-server", help="redis-server binary")
    parser.add_argument("--restarts", type=int, default=5, help="crashes restarted (signals do not count)")
    args = parser.parse_args(argv)
    return run(args.server, args.config, args.stop_file, args.restarts)


if __name__ == "__main__":
    sys.exit(main())
