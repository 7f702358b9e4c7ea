"""benchmarks/headline_sim.py with --jobs > 1, stopped by a signal to its main process only (as
`timeout` sends it): the runs in progress are told, save and stop; a queued run never starts; the
process exits with `Stopped` and leaves no worker behind. Without checkpoints there is nothing to
save: it exits at once (128 + the signal) and kills its workers. Unstopped, every row is kept.

Each run is the script's own `run_one` (its config, checkpoint and signal handling) around a
stand-in for the simulation (the signal path is the subject, not the simulator): it records that it
started and its pid, then waits for its checkpoint's stop flag as a simulation would at a step's end."""

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = r"""
import os, pathlib, sys, time, types
sys.path.insert(0, sys.argv[1])
import headline_sim as hs
from libra.services.planner.sim.checkpoint import Stopped
out, mode = pathlib.Path(sys.argv[2]), sys.argv[3]
hs.CHECKPOINTS[0] = None if mode == "no-checkpoint" else out

def stand_in(design, trace, steps, checkpoint=None):
    label = design.label
    (out / f"pid-{label}").write_text(str(os.getpid()))
    (out / f"started-{label}").touch()
    if mode == "quick":
        raise ValueError("a design this trace cannot run")  # run_one's row that says why
    if mode == "no-checkpoint":
        while True:  # a run with nothing to save: it is killed
            time.sleep(0.05)
    while not checkpoint.stop:
        time.sleep(0.02)
    (out / f"saved-{label}").touch()
    raise Stopped(f"{label} saved at its step's end")

hs.sim_design.simulate_design = stand_in
hs.sim_design.design_of = lambda config: types.SimpleNamespace(label=config.run_id)
hs.TRACES[("stand-in", 1)] = None
jobs = [(f"r{i}", "d", 8, {"run_id": f"r{i}"}, f"cmd {i}", ("stand-in", 1), "design") for i in range(3)]
try:
    rows = hs.run_all(jobs, 2, out / "rows.jsonl")
except Stopped as stopped:
    print(f"stopped: {stopped}", flush=True)
    sys.exit(75)
print("rows", len(rows), flush=True)
"""


def _start(tmp_path: pathlib.Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(ROOT / "benchmarks"), str(tmp_path), mode],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (reaped by init soon) counts as gone
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


def _started(tmp_path: pathlib.Path) -> list[str]:
    return sorted(p.name.removeprefix("started-") for p in tmp_path.glob("started-*"))


def test_sigterm_to_the_main_process_saves_the_running_and_starts_no_more(tmp_path):
    process = _start(tmp_path, "checkpoint")
    _wait_for(lambda: len(_started(tmp_path)) == 2, "two runs to start")
    running = _started(tmp_path)
    pids = [int((tmp_path / f"pid-{label}").read_text()) for label in running]
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 75, out + err
    assert "stopped: " in out and "saved at its step's end" in out
    assert sorted(p.name.removeprefix("saved-") for p in tmp_path.glob("saved-*")) == running
    assert _started(tmp_path) == running  # the third, queued, never started
    _wait_for(lambda: all(_gone(pid) for pid in pids), "the workers to exit", 10)


def test_without_checkpoints_a_signal_stops_at_once_and_kills_the_workers(tmp_path):
    process = _start(tmp_path, "no-checkpoint")
    _wait_for(lambda: len(_started(tmp_path)) == 2, "two runs to start")
    pids = [int((tmp_path / f"pid-{label}").read_text()) for label in _started(tmp_path)]
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM, out + err
    _wait_for(lambda: all(_gone(pid) for pid in pids), "the workers to be killed", 10)


def test_unstopped_every_row_is_kept(tmp_path):
    process = _start(tmp_path, "quick")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, out + err
    assert "rows 3" in out
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 3



def test_a_run_asked_to_stop_while_it_was_set_up_saves_at_its_first_step(tmp_path, monkeypatch):
    """The signal came after the worker took the run (its first check passed) and before the run
    caught signals itself: the run is told at once, so it saves at its first step's end instead of
    playing to its last. Unasked, it plays on."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import headline_sim

    told = []

    def stand_in(design, trace, steps, checkpoint=None):
        told.append(checkpoint.stop)
        raise headline_sim.Stopped("saved")

    monkeypatch.setattr(headline_sim.sim_design, "simulate_design", stand_in)
    monkeypatch.setattr(headline_sim.sim_design, "design_of", lambda config: None)
    monkeypatch.setitem(headline_sim.TRACES, ("stand-in", 1), None)
    monkeypatch.setattr(headline_sim, "CHECKPOINTS", [tmp_path])
    job = ("r0", "d", 8, {}, "cmd 0", ("stand-in", 1), "design")
    for answers in ([False, False], [False, True]):  # _stopping() before the set-up, then inside the run's scope
        asked = iter(answers)
        monkeypatch.setattr(headline_sim, "_stopping", lambda: next(asked))
        with pytest.raises(headline_sim.Stopped, match="saved"):
            headline_sim.run_one(job)
    assert told == [False, True]


def test_a_run_that_fails_while_stopping_leaves_no_row_and_one_that_fails_unasked_says_why(tmp_path, monkeypatch):
    """A row is kept in the rows file and never run again. A run that breaks once it was asked to stop
    (its replay workers signalled with it, say) is a stop, not a row: run again, it goes on from its
    last checkpoint. Unasked, a setting the design cannot run is a row that says why."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import headline_sim

    def stand_in(design, trace, steps, checkpoint=None):
        checkpoint.stop = stopping
        raise RuntimeError("a replay worker process died")

    monkeypatch.setattr(headline_sim.sim_design, "simulate_design", stand_in)
    monkeypatch.setattr(headline_sim.sim_design, "design_of", lambda config: None)
    monkeypatch.setitem(headline_sim.TRACES, ("stand-in", 1), None)
    monkeypatch.setattr(headline_sim, "CHECKPOINTS", [tmp_path])
    monkeypatch.setattr(headline_sim, "_stopping", lambda: False)
    job = ("r0", "d", 8, {}, "cmd 0", ("stand-in", 1), "design")
    stopping = True
    with pytest.raises(headline_sim.Stopped, match="r0: stopped .*replay worker process died.*checkpoint is kept"):
        headline_sim.run_all([job], 1, tmp_path / "rows.jsonl")
    assert not (tmp_path / "rows.jsonl").exists()
    stopping = False
    row = headline_sim.run_all([job], 1, tmp_path / "rows.jsonl")[0]
    assert row["error"] == "a replay worker process died"
    assert json.loads((tmp_path / "rows.jsonl").read_text())["error"] == row["error"]


def test_ablation_rows_runs_the_rows_asked_for(tmp_path, monkeypatch):
    """--ablation-rows splits the ablation over machines: only the rows named are run (the elastic
    pool's row only when named), (d) itself always."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import headline_sim

    ran = []

    def run_all(jobs, processes, rows_file):
        ran.extend(job[0] for job in jobs)
        return []

    monkeypatch.setattr(headline_sim, "run_all", run_all)
    monkeypatch.setattr(headline_sim, "elastic_off", lambda job, rows, rows_file: ran.append(job[0]) or {
        "label": job[0], "key": "d", "role": "ablation"})
    monkeypatch.setattr(headline_sim, "print_scale", lambda report: None)
    for rows, expected in ((["scheduler"], ["C-MLFQ"]), (["elastic", "replanning"], ["replanning", "elastic"]),
                           (list(headline_sim.ABLATION_ROWS), ["C-MLFQ", "homogeneous", "replanning", "elastic"])):
        ran.clear()
        args = argparse.Namespace(only=["d"], online_gpus=[48], ablation_gpus=[48], ablation_rows=rows, steps=2, jobs=1,
                                  seed=0, drift=1.0, out=str(tmp_path / "out.json"))
        headline_sim.scale(48, args)
        assert ran[0] == headline_sim.TITLES["d"]
        assert len(ran) == 1 + len(expected) and all(word in label for word, label in zip(expected, ran[1:])), ran
