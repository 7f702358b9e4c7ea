"""What a second `libra up` does with an existing run directory, the `--config` forms of every
command, and the run summary's reward window — on real directories and the real CLI.

A refused start never gets as far as starting a process, so `libra up` runs here for real: a
finished run (its trainer checkpoint at trainer.steps) exits 2 naming both ways on, `--resume`
with nothing to resume exits 2, and neither touches the run directory.
"""

from __future__ import annotations

import pathlib

import pytest

from libra import run_dir
from libra.cli import build_parser, main
from libra.errors import ConfigError, FailedPrecondition
from libra.progress import reward_window

from tests.integration.test_end_to_end import _config


def _run_dir(root: pathlib.Path, step: int | None = None, warm: bool = False) -> pathlib.Path:
    """A run directory as the trainer leaves it: a checkpoint at `step`, a warm-started model."""
    path = root / "run"
    (path / "logs").mkdir(parents=True)
    (path / "logs" / "trainer.log").write_text("earlier start\n")
    if step is not None:
        (path / "checkpoints").mkdir()
        for earlier in (step - 5, step):
            if earlier > 0:
                (path / "checkpoints" / f"step{earlier}.pt").write_bytes(b"")
    if warm or step is not None:
        (path / "model" / "base").mkdir(parents=True)
        (path / "model" / "base" / "config.json").write_text("{}")
    return path


def test_an_unfinished_run_resumes_and_says_from_where(tmp_path):
    state = run_dir.inspect(_run_dir(tmp_path, step=40))
    assert (state.step, state.checkpoint.name) == (40, "step40.pt")
    note = run_dir.decide(state, "quickstart", 80, fresh=False, resume=False)
    assert note.startswith("resuming run quickstart from step 40/80 (checkpoint ")
    assert "step40.pt" in note and note.endswith("pass --fresh to start over")
    assert run_dir.decide(state, "quickstart", 80, fresh=False, resume=True) == note


def test_a_warm_started_model_alone_is_reused_and_said(tmp_path):
    state = run_dir.inspect(_run_dir(tmp_path, warm=True))
    assert state.resumable and state.checkpoint is None
    assert "reusing the warm-started model" in run_dir.decide(state, "q", 80, fresh=False, resume=True)


def test_a_finished_run_is_refused_naming_both_ways_on(tmp_path):
    state = run_dir.inspect(_run_dir(tmp_path, step=80))
    with pytest.raises(FailedPrecondition) as refused:
        run_dir.decide(state, "quickstart", 80, fresh=False, resume=False)
    message = str(refused.value)
    assert "is finished" in message and "step80.pt" in message
    assert "--fresh" in message and "--set trainer.steps=160" in message
    assert run_dir.decide(state, "quickstart", 160, fresh=False, resume=False).startswith(
        "resuming run quickstart from step 80/160")  # more steps: trains on
    assert run_dir.decide(state, "quickstart", 80, fresh=True, resume=False) is None


def test_nothing_to_resume(tmp_path):
    empty = run_dir.inspect(tmp_path / "absent")
    assert run_dir.decide(empty, "q", 80, fresh=False, resume=False) is None  # a new run: nothing to say
    with pytest.raises(FailedPrecondition, match="--resume: run q has nothing to resume"):
        run_dir.decide(empty, "q", 80, fresh=False, resume=True)
    with pytest.raises(ConfigError, match="pass one of them"):
        run_dir.decide(empty, "q", 80, fresh=True, resume=True)


def test_fresh_moves_the_run_aside_and_logs_rotate(tmp_path):
    path = _run_dir(tmp_path, step=80)
    moved = run_dir.move_aside(path)
    assert not path.exists() and moved.name.startswith("run.prev-")
    assert (moved / "checkpoints" / "step80.pt").exists()
    again = _run_dir(tmp_path, step=80)
    assert run_dir.move_aside(again) not in (None, moved)  # same second: a free name still
    assert run_dir.move_aside(path) is None

    logs = tmp_path / "logs"
    for start in range(1, 8):
        logs.mkdir()
        (logs / "trainer.log").write_text(f"start {start}\n")
        run_dir.rotate_logs(logs, keep=3)
        assert not logs.exists()
    kept = sorted(p.name for p in tmp_path.glob("logs.*"))
    assert kept == ["logs.1", "logs.2", "logs.3"]
    assert [(tmp_path / name / "trainer.log").read_text() for name in kept] == ["start 7\n", "start 6\n", "start 5\n"]
    logs.mkdir()
    assert run_dir.rotate_logs(logs) is None  # an empty directory is left as it is


@pytest.fixture
def quick_config(tmp_path) -> pathlib.Path:
    return _config(tmp_path)  # the quickstart on free ports: the port check passes


def test_libra_up_refuses_a_finished_run_and_resume_without_a_run(tmp_path, quick_config, capsys):
    path = _run_dir(tmp_path, step=80)
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    args = ["up", "--config", str(quick_config), "--run-dir", str(path)]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert "is finished" in error and "--fresh" in error and "--set trainer.steps=160" in error
    assert main([*args, "--resume"]) == 2
    assert main(["up", "--config", str(quick_config), "--run-dir", str(tmp_path / "none"), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before  # untouched
    assert not (tmp_path / "none").exists()
    with pytest.raises(SystemExit):  # argparse: not both
        build_parser().parse_args([*args, "--fresh", "--resume"])


def test_every_command_takes_config_the_same_way(tmp_path, capsys):
    config = "configs/quickstart.yaml"
    assert main(["check-config", "--config", config, "--set", "trainer.steps=7", "--no-ports"]) == 0
    assert "steps: 7" in capsys.readouterr().out
    assert main(["check-config", config, "--no-ports"]) == 0  # the older positional form still works
    assert "run_id: quickstart" in capsys.readouterr().out
    assert main(["check-config", config, "--config", config, "--offline"]) == 0
    capsys.readouterr()
    assert main(["check-config", config, "--config", str(tmp_path / "other.yaml")]) == 2
    assert main(["check-config"]) == 2
    assert "check-config --config FILE" in capsys.readouterr().err
    parser = build_parser()
    for command in (["up"], ["status"], ["serve", "planner"], ["check-config"], ["plan", "explain"]):
        assert parser.parse_args([*command, "--config", config]).config == config, command
    help_text = parser._subparsers._group_actions[0].choices["check-config"].format_help()
    assert "--config" in help_text and "FILE" not in help_text  # --config is the documented form


def test_the_summary_window_is_the_readmes():
    assert [reward_window(n) for n in (1, 2, 7, 19, 20, 80)] == [1, 1, 3, 9, 10, 10]
