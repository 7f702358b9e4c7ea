"""`libra check-config` (and `libra up`, before it starts anything) refuse what can be known bad
before a start: a model path that does not exist, a dataset with no valid row, a port in use. Each
exits 2 naming the field; a good config passes. Real files, real sockets, the real CLI."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys

from libra.cli import main
from libra.redis_server import free_port


def _config(tmp_path: pathlib.Path, extra: str = "") -> pathlib.Path:
    """The quickstart on free ports, no metrics servers, workers on any free ports."""
    addresses = ", ".join(f"{s}: 127.0.0.1:{free_port()}" for s in ("planner", "scheduler", "rollout", "trainer",
                                                                   "elastic"))
    path = tmp_path / "run.yaml"
    path.write_text(pathlib.Path("configs/quickstart.yaml").read_text()
                    + f"\naddresses: {{{addresses}}}\nmetrics: {{base_port: 0}}\n" + extra)
    return path


def test_a_good_config_passes(tmp_path, capsys):
    assert main(["check-config", "--config", str(_config(tmp_path)), "--set", "rollout.worker.base_port=0"]) == 0
    assert "run_id: quickstart" in capsys.readouterr().out


def test_a_missing_model_path_is_refused_naming_the_field(tmp_path, capsys):
    config = str(_config(tmp_path))
    absent = tmp_path / "no-such-model"
    assert main(["check-config", "--config", config, "--set", "model.source=path", "--set", f"model.path={absent}"]) == 2
    error = capsys.readouterr().err
    assert "model.path" in error and "does not exist" in error
    absent.mkdir()  # a directory, but not a model
    assert main(["check-config", "--config", config, "--set", "model.source=path", "--set", f"model.path={absent}"]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["check-config", "--config", config, "--set", "model.source=path", "--set", f"model.path={absent}",
                 "--offline"]) == 0  # only the config itself


def test_a_dataset_whose_every_line_is_broken_is_refused(tmp_path, capsys):
    data = tmp_path / "broken.jsonl"
    data.write_text('{"id": 1, "prompt": "no answer"}\nnot json at all\n{"prompt": "no id", "answer": "2"}\n')
    config = _config(tmp_path, f"\nworkload: {{name: gsm8k, data: {data}}}\n")
    assert main(["check-config", "--config", str(config), "--set", "rollout.worker.base_port=0"]) == 2
    error = capsys.readouterr().err
    assert "workload.data" in error and "no valid rows" in error
    data.write_text('{"id": 1, "prompt": "1+1?", "answer": "2"}\nnot json at all\n')  # one valid row is enough
    assert main(["check-config", "--config", str(config), "--set", "rollout.worker.base_port=0"]) == 0


def test_a_port_in_use_is_refused_naming_the_field(tmp_path, capsys):
    config = _config(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["check-config", "--config", str(config), "--set", "rollout.worker.base_port=0",
                     "--set", f"addresses.trainer=127.0.0.1:{port}"]) == 2
        assert f"addresses.trainer: port {port}" in capsys.readouterr().err
        assert main(["check-config", "--config", str(config), "--set", f"rollout.worker.base_port={port}"]) == 2
        assert "rollout.worker.base_port" in capsys.readouterr().err
        assert main(["check-config", "--config", str(config), "--set", f"addresses.trainer=127.0.0.1:{port}",
                     "--set", "rollout.worker.base_port=0", "--no-ports"]) == 0


def test_libra_up_refuses_a_missing_model_before_starting_anything(tmp_path):
    config, run_dir = _config(tmp_path), tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "libra.cli", "up", "--config", str(config), "--run-dir", str(run_dir),
                             "--set", "model.source=path", "--set", f"model.path={tmp_path / 'absent'}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "model.path" in result.stderr, result.stderr
    assert not run_dir.exists()  # refused before the run directory was made
