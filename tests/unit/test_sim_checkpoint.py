"""A simulation stopped part way goes on from its checkpoint exactly as if it had never stopped
(services/planner/sim/checkpoint.py), and a checkpoint that is not this run's is refused by name."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import pytest

from libra.config import load_run_config
from libra.errors import InvalidArgument
from libra.services.planner.sim import design as sim_design
from libra.services.planner.sim.checkpoint import Checkpoint, Stopped as SavedAndStopped, header
from libra.services.planner.sim.cluster import Simulator

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 10


class Stopped(Exception):
    pass


def design(workers: int = 1):
    """(d) at 16 GPUs, its replanner replaying short windows (3 steps after 2 to warm up) so that its
    decisions replay from the third step on."""
    config = load_run_config(ROOT / "configs/headline/d-libra-full.yaml",
                             {"planner.cluster.gpus": 16, "planner.replan.sim_workers": workers,
                              "planner.replan.sim_window_steps": 3, "planner.replan.sim_warmup_steps": 2}, env={})
    return sim_design.design_of(config)


def trace():
    return sim_design.design_trace("r2e", STEPS, 16, 8, 0, 1.0)


TOLD: list[str] = []  # what the uninterrupted run below told as it went (its `notes`)


@pytest.fixture(scope="module")
def whole():
    run = sim_design.simulate_design(design(), trace(), STEPS, notes=TOLD.append)
    assert [c.step for c in run.result.plan_changes] == [2, 5]  # the cases cover what they claim
    return figures(run)


def figures(run) -> dict:
    result = run.result
    return {"steps": [(s.step, s.time_s, s.rollout_s, s.train_s, s.sequences) for s in result.steps],
            "changes": [(c.step, c.time_s, c.after, c.reason, c.moved_turns) for c in result.plan_changes],
            "routes": result.routes, "reasons": dict(result.reasons), "makespan": result.makespan_s,
            "tokens": result.output_tokens, "busy": run.usage.fractions(), "staleness": dict(run.usage.staleness),
            "rejected": run.usage.rejected, "last_plan": result.last_plan}


def stop_after(step: int):
    def progress(record) -> None:
        if record.step == step:
            raise Stopped
    return progress


@pytest.mark.parametrize("stop", [1, 3, 6])
def test_a_run_stopped_part_way_goes_on_from_its_checkpoint_exactly(tmp_path, stop, whole):
    """Online (d) at 16 GPUs moves after steps 2 and 5: stopped before, between and after the moves
    (the checkpoint is the step before the stop's: the stop's own step is played again)."""
    checkpoint = Checkpoint(tmp_path / "run.pkl", key="test run", every_s=0)
    with pytest.raises(Stopped):
        sim_design.simulate_design(design(), trace(), STEPS, progress=stop_after(stop), checkpoint=checkpoint)
    assert checkpoint.path.exists() and checkpoint.saved == stop
    assert header(checkpoint.path)["step"] == stop  # saved at the end of step stop - 1
    again = Checkpoint(tmp_path / "run.pkl", key="test run", every_s=0)
    resumed = sim_design.simulate_design(design(), trace(), STEPS, checkpoint=again)
    assert figures(resumed) == whole
    assert resumed.result.cpu_s > 0 and resumed.result.wall_s > 0


def test_a_resumed_run_tells_its_decisions_as_they_are_taken(tmp_path, whole):
    """`notes` (what `libra sim` prints as it goes) is not in a checkpoint; a resumed run is given it
    again: the decisions after the resume that replayed are told, the first plan's choice (made
    before the checkpoint) is not told again."""
    checkpoint = Checkpoint(tmp_path / "run.pkl", key="test run", every_s=0)
    with pytest.raises(Stopped):
        sim_design.simulate_design(design(), trace(), STEPS, progress=stop_after(1), checkpoint=checkpoint)
    lines: list[str] = []
    resumed = sim_design.simulate_design(design(), trace(), STEPS, checkpoint=Checkpoint(checkpoint.path, key="test run"),
                                         notes=lines.append)
    assert figures(resumed) == whole

    def decisions(told: list[str]) -> list[str]:  # "  decision after step 4: keep (6 replays", CPU-s left out
        return [line.split(",")[0] for line in told if line.startswith("  decision after step")]
    assert decisions(lines) and decisions(lines) == decisions(TOLD)  # every one is after step 1
    assert any("first plan" in line for line in TOLD) and not any("first plan" in line for line in lines)


def test_a_resumed_run_replays_in_the_workers_it_is_given(tmp_path, whole):
    """Saved with its replays in this process, resumed with two worker processes: the same run."""
    checkpoint = Checkpoint(tmp_path / "run.pkl", key="k", every_s=0)
    with pytest.raises(Stopped):
        sim_design.simulate_design(design(), trace(), STEPS, progress=stop_after(2), checkpoint=checkpoint)
    resumed = sim_design.simulate_design(design(workers=2), trace(), STEPS, checkpoint=checkpoint)
    assert figures(resumed) == whole
    assert resumed.result.worker_cpu_s > 0  # the decisions after the resume ran in the workers


def test_checkpoints_not_of_this_run_are_refused_by_name(tmp_path):
    checkpoint = Checkpoint(tmp_path / "run.pkl", key="gpus 16", every_s=0)
    with pytest.raises(Stopped):
        sim_design.simulate_design(design(), trace(), STEPS, progress=stop_after(1), checkpoint=checkpoint)
    other = Checkpoint(tmp_path / "run.pkl", key="gpus 24")
    with pytest.raises(InvalidArgument, match=r"^\S+run.pkl holds another run's checkpoint \(saved for 'gpus 16', this run is 'gpus 24'\)"):
        sim_design.simulate_design(design(), trace(), STEPS, checkpoint=other)
    garbage = tmp_path / "garbage.pkl"
    garbage.write_bytes(b"not a pickle")
    with pytest.raises(InvalidArgument, match="not a readable simulation checkpoint"):
        Simulator.resume(garbage)
    foreign = tmp_path / "foreign.pkl"
    foreign.write_bytes(pickle.dumps({"some": "dict"}))
    with pytest.raises(InvalidArgument, match="not a simulation checkpoint of this version"):
        Simulator.resume(foreign)
    with pytest.raises(InvalidArgument, match="no checkpoint at"):
        Simulator.resume(tmp_path / "absent.pkl")
    old_format = tmp_path / "old.pkl"
    old_format.write_bytes(pickle.dumps({"format": "libra-sim-checkpoint/1", "key": "gpus 16", "simulator": None}))
    with pytest.raises(InvalidArgument, match=r"^\S+old.pkl is not a simulation checkpoint of this version \(libra-sim-checkpoint/2\)"):
        Simulator.resume(old_format, "gpus 16")
    with pytest.raises(InvalidArgument, match="every_s must be >= 0"):
        Checkpoint(tmp_path / "x.pkl", every_s=-1)


def test_a_checkpoint_saved_by_other_code_is_refused_naming_the_module(tmp_path):
    """The header fingerprints the source of every libra module loaded when it was saved; one that
    differs now is named, and the refusal comes before the simulator is unpickled (here: cut short)."""
    checkpoint = Checkpoint(tmp_path / "run.pkl", key="k", every_s=0)
    with pytest.raises(Stopped):
        sim_design.simulate_design(design(), trace(), STEPS, progress=stop_after(1), checkpoint=checkpoint)
    code = header(checkpoint.path)["code"]
    assert {"libra.services.planner.sim.cluster", "libra.services.planner.audit", "libra.traces.spec"} <= set(code)
    assert Simulator.resume(checkpoint.path, "k") is not None  # this code saved it: accepted
    with open(checkpoint.path, "rb") as source:
        saved, rest = pickle.load(source), source.read()
    edited = tmp_path / "edited.pkl"
    edited.write_bytes(pickle.dumps({**saved, "code": {**code, "libra.services.planner.audit": "0" * 64}})
                       + rest[:len(rest) // 2])
    with pytest.raises(InvalidArgument, match=r"^\S+edited.pkl was saved by other code: libra.services.planner.audit changed since"):
        Simulator.resume(edited, "k")
    gone = tmp_path / "gone.pkl"
    gone.write_bytes(pickle.dumps({**saved, "code": {**code, "libra.services.planner.removed": "0" * 64}}) + rest)
    with pytest.raises(InvalidArgument, match=r"^\S+gone.pkl was saved by other code: libra.services.planner.removed changed since"):
        Simulator.resume(gone, "k")


def test_a_signal_saves_the_run_at_the_steps_end_and_stops_it(tmp_path, whole):
    """SIGTERM inside `stop_on_signals`: the run saves after the step it is in and raises Stopped,
    naming the file; run again it ends as a run never stopped. The old handler is back after."""
    checkpoint = Checkpoint(tmp_path / "run.pkl", key="k", every_s=3600)

    def terminate_at_step_3(record) -> None:
        if record.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SavedAndStopped, match=f"stopped after step 3 of {STEPS} and saved to {tmp_path / 'run.pkl'}"):
        with checkpoint.stop_on_signals():
            sim_design.simulate_design(design(), trace(), STEPS, progress=terminate_at_step_3, checkpoint=checkpoint)
    assert signal.getsignal(signal.SIGTERM) is before
    assert checkpoint.saved == 1 and header(checkpoint.path)["step"] == 4
    resumed = sim_design.simulate_design(design(), trace(), STEPS, checkpoint=Checkpoint(checkpoint.path, key="k"))
    assert figures(resumed) == whole


def test_libra_sim_refuses_a_checkpoint_of_other_inputs_naming_the_flag(tmp_path, capsys):
    """A checkpoint saved for 16 GPUs is not continued by a run asked for 24 (exit 2, both named), and
    a bad --checkpoint-every-s is refused by name before anything runs."""
    from libra.cli import main

    args = ["sim", "--config", str(ROOT / "configs/headline/d-libra-full.yaml"), "--trace", "r2e", "--steps", "4",
            "--prompts", "16", "--checkpoint", str(tmp_path / "run.pkl"), "--checkpoint-every-s", "0"]
    checkpoint = Checkpoint(tmp_path / "run.pkl", key="not these inputs")
    checkpoint.save({"not": "a simulator"}, 1)
    assert main(args + ["--set", "planner.cluster.gpus=16"]) == 2
    assert "holds another run's checkpoint (saved for 'not these inputs'" in capsys.readouterr().err
    assert main(args[:-1] + ["-1", "--set", "planner.cluster.gpus=16"]) == 2
    assert "--checkpoint-every-s must be 0..86400 seconds, got -1.0" in capsys.readouterr().err
    assert (tmp_path / "run.pkl").exists()  # refused, not overwritten


def test_checkpoints_are_written_no_more_often_than_asked(tmp_path):
    checkpoint = Checkpoint(tmp_path / "run.pkl", every_s=3600)
    sim_design.simulate_design(design(), trace(), STEPS, checkpoint=checkpoint)
    assert checkpoint.saved == 0 and not checkpoint.path.exists()


@pytest.mark.slow
def test_libra_sim_killed_or_stopped_goes_on_from_its_checkpoint(tmp_path):
    """`libra sim --checkpoint`: SIGKILLed once its first checkpoint is on disk, run again (it goes on),
    sent SIGTERM once it has saved again (it saves and exits 75), run a third time: the same JSON as a
    run never stopped (timings aside), and no checkpoint left once it is done."""
    libra = [sys.executable, "-m", "libra.cli", "sim", "--config", str(ROOT / "configs/headline/d-libra-full.yaml"),
             "--set", "planner.cluster.gpus=48", "--trace", "r2e", "--steps", "12", "--prompts", "48"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(libra + ["--json", str(tmp_path / "whole.json")], check=True, env=env, cwd=tmp_path,
                   capture_output=True, timeout=600)
    saved = tmp_path / "run.pkl"
    resumable = libra + ["--checkpoint", str(saved), "--checkpoint-every-s", "0", "--json", str(tmp_path / "part.json")]

    def start_and_wait_for_a_checkpoint() -> subprocess.Popen:
        before = saved.stat().st_mtime_ns if saved.exists() else None
        process = subprocess.Popen(resumable, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline and \
                (not saved.exists() or saved.stat().st_mtime_ns == before):
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be stopped"
        return process

    killed = start_and_wait_for_a_checkpoint()
    killed.kill()
    killed.communicate(timeout=30)
    assert saved.exists() and killed.returncode == -signal.SIGKILL and not (tmp_path / "part.json").exists()
    stopped = start_and_wait_for_a_checkpoint()
    stopped.send_signal(signal.SIGTERM)
    out, err = stopped.communicate(timeout=300)
    assert stopped.returncode == 75, err[-2000:]
    assert f"going on from the checkpoint {saved}" in out
    assert f"and saved to {saved}: run the same command again to go on from there" in err
    assert saved.exists() and not (tmp_path / "part.json").exists()
    again = subprocess.run(resumable, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    timings = ("wall_s", "cpu_s", "worker_cpu_s")
    whole, part = (json.loads((tmp_path / name).read_text()) for name in ("whole.json", "part.json"))
    assert {k: v for k, v in part.items() if k not in timings} == {k: v for k, v in whole.items() if k not in timings}
    assert not saved.exists()
