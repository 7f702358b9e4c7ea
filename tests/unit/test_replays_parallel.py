"""The replanner's replays in worker processes (`planner.replan.sim_workers`, sim/replays.py): the
same decisions as one after the other, a pool that really runs elsewhere and stops, and a worker's
death reported as an error that names the setting."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from libra.services.planner.config import ReplanSettings
from libra.services.planner.evaluate import Replay
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import SearchConfig, search
from libra.services.planner.sim import run as sim_run
from libra.services.planner.sim.cluster import SimConfig
from libra.services.planner.sim.rank import SimRanker
from libra.services.planner.sim.replays import MAX_AUTO_WORKERS, OWNER_POLL_S, ReplayPool, resolve_workers
from libra.traces import synthetic

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODEL, GPU = model_named("qwen2.5-3b"), gpu_named("h200-141g")
# decide after every step on a short window, so that a small drifting run moves
EVERY_STEP = dict(interval_s=1, queue_depth_high=0, active_rollouts_high=0, rejected_fraction_high=0,
                  time_ratio_high=0, warmup_steps=0, cooldown_s=0, recheck_s=0, confirm=1, sim_window_steps=3,
                  sim_warmup_steps=1, window_steps=8, shortlist=2, neighbours=2)


def test_an_online_run_decides_the_same_with_replay_workers():
    trace = synthetic.drifting(11, 8, 8, 0, 4.0, 1)
    runs = [sim_run.simulate(MODEL, GPU, 32, trace, "online", "cmlfq", SimConfig(),
                             ReplanSettings(**EVERY_STEP, sim_workers=workers)) for workers in (1, 2)]
    alone, side_by_side = runs
    assert alone.plan_changes, "the run must move for the comparison to mean anything"
    assert side_by_side.plan_changes == alone.plan_changes  # the same moves, steps, reasons
    assert side_by_side.first_plan == alone.first_plan and side_by_side.steps == alone.steps
    # the run's CPU counts its replay workers' too (none with one worker: the replays ran here)
    assert alone.worker_cpu_s == 0.0 and 0.0 < side_by_side.worker_cpu_s < side_by_side.cpu_s


def _window_and_plans():
    trace = synthetic.drifting(6, 4, 8, 0, 0.0, 1)
    config = SearchConfig(total_gpus=16, group_size=8)
    result = search(MODEL, GPU, trace.pairs(0), config.model_copy(update={"distinct_splits": True, "top_k": 3}))
    return trace, config, result.alternatives


def test_the_pool_plays_elsewhere_returns_in_order_and_stops():
    trace, config, plans = _window_and_plans()
    best, other = plans[0], plans[-1]
    alone = SimRanker(MODEL, GPU, config, SimConfig(), window_steps=3, warmup_steps=1)
    pooled = SimRanker(MODEL, GPU, config, SimConfig(), window_steps=3, warmup_steps=1, workers=2)
    window = alone.repeated(trace.steps[0])
    replays = [Replay(best, config.rollout, config.train),
               Replay(best, config.rollout.model_copy(update={"decode_bw": config.rollout.decode_bw / 2}),
                      config.train),
               Replay(best, config.rollout, config.train, move_to=other, transition_s=30.0),
               Replay(other, config.rollout, config.train)]
    try:
        expected = alone.play_all(window, replays)
        assert pooled.play_all(window, replays) == expected
        assert expected[1].per_step_s > expected[0].per_step_s  # half the decode speed is slower: order kept
        workers = list(pooled.pool._executor._processes.values())
        assert len(workers) == 2 and all(p.pid != os.getpid() and p.is_alive() for p in workers)
    finally:
        pooled.close()
    assert all(not p.is_alive() for p in workers) and pooled.pool._executor is None


def _ignores(pid: int, signum: int) -> bool:
    """Does the process ignore the signal (Linux /proc: SigIgn, a mask in hex)?"""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigIgn:")).split()[1]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def test_workers_leave_sigint_and_sigterm_to_their_owner():
    """A Ctrl-C or a batch system's SIGTERM reaches the whole process group; the workers ignore it so
    that the owner can finish its step with them and save (sim/checkpoint.py). Before, the workers
    died and the decision failed ("a replay worker process died")."""
    trace, config, plans = _window_and_plans()
    ranker = SimRanker(MODEL, GPU, config, SimConfig(), window_steps=3, warmup_steps=1, workers=2)
    window = ranker.repeated(trace.steps[0])
    replays = [Replay(plans[0], config.rollout, config.train), Replay(plans[-1], config.rollout, config.train)]
    try:
        expected = ranker.play_all(window, replays)
        workers = list(ranker.pool._executor._processes.values())
        deadline = time.monotonic() + 60  # (a worker may still be starting: its set-up not run yet)
        while not all(_ignores(w.pid, signal.SIGTERM) and _ignores(w.pid, signal.SIGINT) for w in workers):
            assert time.monotonic() < deadline, "the workers do not ignore SIGINT and SIGTERM"
            time.sleep(0.05)
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
            os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(worker.is_alive() for worker in workers)
        assert ranker.play_all(window, replays) == expected
        assert list(ranker.pool._executor._processes.values()) == workers  # the same processes
    finally:
        ranker.close()


GROUP_SIGNAL = r"""
import os, signal, sys, time
sys.path.insert(0, "tests/unit")
from test_replays_parallel import GPU, MODEL, Replay, SimConfig, SimRanker, _window_and_plans

got = []
signal.signal(signal.SIGTERM, lambda *_: got.append("TERM"))  # the owner's own handlers (a checkpointed run's)
signal.signal(signal.SIGINT, lambda *_: got.append("INT"))
trace, config, plans = _window_and_plans()
ranker = SimRanker(MODEL, GPU, config, SimConfig(), window_steps=3, warmup_steps=1, workers=2)
window = ranker.repeated(trace.steps[0])
replays = [Replay(plans[0], config.rollout, config.train), Replay(plans[-1], config.rollout, config.train)]
expected = ranker.play_all(window, replays)
os.killpg(0, signal.SIGTERM)  # what `timeout`, a batch system or Ctrl-C does: every process of the group
os.killpg(0, signal.SIGINT)
time.sleep(1.0)
again = ranker.play_all(window, replays * 3)  # more replays than workers: the pool may start more of them
print("owner got", sorted(got), "same", again == expected * 3, flush=True)
ranker.close()
"""


def test_a_signal_to_the_whole_process_group_leaves_the_pool_working():
    """`timeout` and Ctrl-C signal the whole process group, the pool's forkserver too. The forkserver
    is started with both signals blocked, so it lives, and the owner's next decision plays in the
    same pool; before, its death closed every worker's sentinel and the pool counted all of them
    dead ("a replay worker process died" just as a run was asked to save and stop)."""
    done = subprocess.run([sys.executable, "-c", GROUP_SIGNAL], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, start_new_session=True)  # a group of its own to signal
    assert done.returncode == 0, done.stderr[-2000:]
    assert "owner got ['INT', 'TERM'] same True" in done.stdout, done.stdout + done.stderr[-2000:]


class _KillsTheWorker:
    """Unpickled in a worker, it ends that worker's process (what the OOM killer would do)."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_dead_worker_is_an_error_naming_the_setting_and_the_pool_starts_again():
    trace, config, plans = _window_and_plans()
    ranker = SimRanker(MODEL, GPU, config, SimConfig(), window_steps=3, warmup_steps=1, workers=2)
    window = ranker.repeated(trace.steps[0])
    fine = Replay(plans[0], config.rollout, config.train)
    try:
        with pytest.raises(RuntimeError, match="replay worker process died.*sim_workers"):
            ranker.play_all(window, [fine, Replay(_KillsTheWorker(), config.rollout, config.train)])
        assert ranker.pool._executor is None  # closed: the next decision starts a fresh pool
        assert ranker.play_all(window, [fine, fine])[0] == SimRanker(
            MODEL, GPU, config, SimConfig(), window_steps=3, warmup_steps=1).play_all(window, [fine])[0]
    finally:
        ranker.close()


def test_the_setting_is_bounded_and_zero_means_the_cores_at_hand():
    with pytest.raises(ValidationError, match="sim_workers"):
        ReplanSettings(sim_workers=-1)
    with pytest.raises(ValidationError, match="sim_workers"):
        ReplanSettings(sim_workers=10_000)
    assert 1 <= resolve_workers(0) <= min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0)))
    assert ReplayPool(3).workers == 3


def test_auto_workers_respect_a_containers_cpu_quota(tmp_path):
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")  # one CPU, whatever the affinity says
    assert resolve_workers(0, str(quota)) == 1
    quota.write_text("max 100000\n")  # no quota: the affinity decides
    assert resolve_workers(0, str(quota)) == min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0)))
    assert resolve_workers(0, str(tmp_path / "absent")) == resolve_workers(0, str(quota))
    assert resolve_workers(5, str(quota)) == 5  # a number given is taken as given


OWNER_KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_replays_parallel import _window_and_plans, MODEL, GPU
from libra.services.planner.evaluate import Replay
from libra.services.planner.sim.cluster import SimConfig
from libra.services.planner.sim.rank import SimRanker
trace, config, plans = _window_and_plans()
ranker = SimRanker(MODEL, GPU, config, SimConfig(), window_steps=3, warmup_steps=1, workers=2)
ranker.play_all(ranker.repeated(trace.steps[0]), [Replay(plans[0], config.rollout, config.train)] * 2)
print(*ranker.pool._executor._processes, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would: no close(), no atexit
"""


def test_workers_end_when_their_owner_is_killed_outright(tmp_path):
    """Killed with SIGKILL and not yet reaped by its parent (a zombie), the owner is gone for its
    workers: they end within a few polls instead of waiting for work forever."""
    out = tmp_path / "pids"
    with out.open("w") as sink:
        owner = subprocess.Popen([sys.executable, "-c", OWNER_KILLED.format(tests=os.path.dirname(__file__))],
                                 stdout=sink, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(out.read_text().split()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(pid) for pid in out.read_text().split()]
    assert len(workers) == 2

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    try:
        deadline = time.monotonic() + 10 * OWNER_POLL_S
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(owner.pid), "the owner should be a zombie here (killed, not reaped)"
        assert not any(alive(pid) for pid in workers), "replay workers outlived their killed owner"
    finally:
        assert owner.wait(timeout=30) == -signal.SIGKILL


def test_libra_sim_takes_the_workers_from_its_flag_with_the_same_result(tmp_path):
    def sim(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "libra.cli", "sim", "--cluster", "configs/hardware/h200-141g.yaml",
                               "--model", "configs/models/qwen3-4b.yaml", "--gpus", "16", "--steps", "10",
                               "--planner", "online", *extra], capture_output=True, text=True, timeout=300)

    results = []
    for workers in ("1", "2"):
        done = sim("--sim-workers", workers, "--json", str(tmp_path / f"w{workers}.json"))
        assert done.returncode == 0, done.stderr
        result = json.loads((tmp_path / f"w{workers}.json").read_text())
        results.append({k: v for k, v in result.items() if k not in ("wall_s", "cpu_s")})
    assert results[0] == results[1] and results[0]["trajectories_per_s"] > 0
    bad = sim("--sim-workers", "-3")
    assert bad.returncode == 2 and "--sim-workers must be in 0..256" in bad.stderr and "Traceback" not in bad.stderr
