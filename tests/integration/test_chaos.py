"""Chaos: one real `libra up` run in which every service is SIGKILLed once, mid-run, and so is its
Redis; the run still completes, and the completed-trajectory stream reconciles exactly.

The run is test_up_signals' cheap one (private Redis, the five services, two workers of the
transformers engine, a tiny model, 2 groups of 4 per step), CHAOS_STEPS steps, a checkpoint every
2 (the trainer is killed after an odd step: it resumes from the checkpoint before it and trains
that step again on the same entries). Once step N is printed, the process of the service (or
redis-server) is sent SIGKILL, as an operator's `kill -9 PID` would; `libra up` must start it
again (and says so) before the next fault. Afterwards the run's Redis (its append-only file in RUN_DIR/redis) is opened and:

- every step 1..CHAOS_STEPS has its record, with a whole batch, and versions only went up;
- each trajectory entered the completed stream at most once (nothing twice), and every
  trajectory of every submitted group is either in it or still queued or running (none lost);
- produced (stream entries) = trained + rejected as stale + dropped with a failed group + left in
  flight (completed, not yet consumed), and trained = the sum of the step records' batches;
- no trajectory failed because of the faults, and the scheduler restarted with its live
  trajectories (routing state restored, not re-routed as new).

docs/operations.md reports the figures this test prints (the `chaos:` line).
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import signal
import time

import pytest

from libra.redis_server import PrivateRedis
from tests.integration.test_up_signals import Up

pytestmark = pytest.mark.slow
CHAOS_STEPS = 48
"""Room after the last fault: each fault waits until `libra up` has started its process again (1 s of
backoff and the start), and a run of this size keeps training meanwhile, at several steps a second
on an idle machine; with 16 steps the run had finished before Redis's restart was seen."""
GROUPS, SAMPLES = 2, 4
FAULTS = [("scheduler", 2), ("rollout", 4), ("trainer", 7), ("elastic", 9), ("planner", 10), ("redis", 12)]


def _pid_of(up: Up, name: str) -> int:
    """The process of service `name` (or redis-server) of this run: the one `libra up` started.
    Redis rewrites its command line ("redis-server 127.0.0.1:PORT") and with it its environment:
    it is found by its port instead of the run's marker."""
    if name == "redis":
        url = next(line for line in (up.run_dir / "config.yaml").read_text().splitlines() if "redis://" in line)
        needle = f"127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}".encode()
        candidates = [int(p) for p in os.listdir("/proc") if p.isdigit() and b"redis-server" in _cmdline(int(p))]
    else:
        needle, candidates = f"serve\0{name}\0".encode(), up.marked()
    found = [pid for pid in candidates if needle in _cmdline(pid) and _session_leader(pid)]
    assert len(found) == 1, (name, found)
    return found[0]


def _appendfsync(up: Up) -> str:
    import redis as redis_client

    url = next(line for line in (up.run_dir / "config.yaml").read_text().splitlines() if "redis://" in line)
    client = redis_client.Redis.from_url(url.split(":", 1)[1].strip())
    try:
        return client.config_get("appendfsync")["appendfsync"]
    finally:
        client.close()


def _session_leader(pid: int) -> bool:
    """The process `libra up` started (each leads its own session), not one of its children."""
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _reconcile(url: str, run_id: str) -> dict[str, int]:
    """The figures of the module docstring, from the run's Redis (sync client: plain reads)."""
    import redis

    from libra.state.keys import Keys
    from libra.v1 import trainer_pb2

    keys, client = Keys(run_id), redis.Redis.from_url(url)
    try:
        steps = sorted(int(s) for s in client.zrange(keys.step_index, 0, -1))
        assert steps == list(range(1, CHAOS_STEPS + 1)), steps
        records = [trainer_pb2.StepRecord.FromString(client.hget(keys.step_records, str(s))) for s in steps]
        assert all(r.trajectories == GROUPS * SAMPLES for r in records)
        versions = [r.policy_version for r in records]
        assert versions == sorted(set(versions)) and int(client.get(keys.policy_version)) >= versions[-1], versions

        entries = [fields[b"trajectory_id"].decode() for _, fields in client.xrange(keys.completed)]
        twice = [tid for tid, n in collections.Counter(entries).items() if n > 1]
        assert twice == [], f"in the completed stream twice: {twice}"
        status = {tid: client.hget(keys.trajectory(tid), "status").decode() for tid in entries}
        groups = collections.defaultdict(list)
        for tid in entries:
            groups[tid.rsplit("-s", 1)[0]].append(status[tid])
        failed_groups = {g for g, members in groups.items() if "FAILED" in members}
        counts = collections.Counter()
        for tid in entries:
            group = tid.rsplit("-s", 1)[0]
            kind = "failed_group" if group in failed_groups else {
                "CONSUMED": "trained", "REJECTED": "rejected", "COMPLETED": "in_flight"}[status[tid]]
            counts[kind] += 1
        assert counts["trained"] == sum(r.trajectories for r in records), counts

        registered = [k.decode().rsplit(":", 1)[1] for k in client.scan_iter(match=keys.group("*"))
                      if not k.endswith(b":trajs")]
        lost = unproduced = 0
        for group in registered:
            samples = int(client.hget(keys.group(group), "samples"))
            for index in range(samples):
                tid = f"{group}-s{index}"
                if tid in status:
                    continue
                state = client.hget(keys.trajectory(tid), "status")
                if state in (b"QUEUED", b"RUNNING"):
                    unproduced += 1
                else:
                    lost += 1
        failed = sum(1 for s in status.values() if s == "FAILED")
        return {"produced": len(entries), **{kind: counts[kind] for kind in ("trained", "rejected", "failed_group",
                                                                             "in_flight")},
                "failed": failed, "queued_or_running": unproduced, "lost": lost, "groups": len(registered)}
    finally:
        client.close()


def test_every_service_and_redis_killed_once_the_run_completes_and_reconciles(tmp_path):
    up = Up(tmp_path, steps=CHAOS_STEPS, extra=("--set", "trainer.checkpoint_every=2"))
    started, back_after, killed_at = time.monotonic(), {}, {}
    try:
        for name, step in FAULTS:
            up.wait_for(f"step {step:>3}/{CHAOS_STEPS}", timeout=900)
            if name == "redis":  # what it acknowledged is on disk before the reply: nothing to lose to SIGKILL
                assert _appendfsync(up) == "always"
            os.kill(_pid_of(up, name), signal.SIGKILL)
            killed = time.monotonic()
            killed_at[name] = max((int(m.group(1)) for line in list(up.lines)
                                   if (m := re.search(r"step +(\d+)/", line))), default=0)
            back_after[name] = round(up.wait_for(f"{name} started again", timeout=300) - killed)
        code = up.process.wait(900)
        up.reader.join(10)
        assert code == 0, up.output[-4000:]
    finally:
        up.clean_up()
    seconds = time.monotonic() - started
    output = up.output
    assert output.count("starting it again in") == len(FAULTS), output[-4000:]
    assert f"step {CHAOS_STEPS:>3}/{CHAOS_STEPS}" in output and "a crash loop" not in output
    scheduler_log = (up.run_dir / "logs" / "scheduler.log").read_text()
    assert '"event": "routing state restored from redis"' in scheduler_log

    config = (up.run_dir / "config.yaml").read_text()
    run_id = next(line.split(":", 1)[1].strip() for line in config.splitlines() if line.startswith("run_id:"))
    redis = PrivateRedis(up.run_dir / "redis", log_path=tmp_path / "inspect-redis.log", persistent=True).start()
    try:
        figures = _reconcile(redis.url, run_id)
    finally:
        redis.stop()
    print(f"chaos: faults injected {len(FAULTS)}, runs completed 1, {CHAOS_STEPS} steps in {seconds:.0f}s; {figures}; "
          f"started again after (s): {back_after}; killed after step: {killed_at}")
    assert figures["lost"] == 0 and figures["failed"] == 0, figures
    assert figures["produced"] == (figures["trained"] + figures["rejected"] + figures["failed_group"]
                                   + figures["in_flight"]), figures
