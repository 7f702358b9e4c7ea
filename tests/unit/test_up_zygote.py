"""`libra up`'s services forked from its zygote (libra/up.py `Children`), and started the ordinary
way once the zygote cannot fork; the zygote is kept to the stop either way (what it forked dies
with it)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from libra import procs
from libra.config import load_run_config
from libra.up import Children
from libra.zygote import ForkedProcess, Zygote

pytestmark = pytest.mark.skipif(not procs.PARENT_DEATH, reason="Linux with util-linux setpriv")


def _children(tmp_path, preload: list[str]) -> Children:
    config = load_run_config("configs/quickstart.yaml", {"run_dir": str(tmp_path / "run")})
    zygote = Zygote(preload, dict(os.environ), signal.SIGKILL, tmp_path / "zygote.log")
    # a config file that is not there: the service says so and exits 2, which is all this needs of it
    return Children(config, str(tmp_path / "missing.yaml"), "redis://127.0.0.1:1/0", dict(os.environ), zygote=zygote)


def test_a_service_is_forked_from_the_zygote_and_runs_libra_serve(tmp_path):
    children = _children(tmp_path, ["libra.cli"])
    try:
        children.start("planner")
        process = children.procs["planner"]
        assert isinstance(process, ForkedProcess) and children.fallback is None
        assert process.wait(60) == 2
        assert "missing.yaml" in (tmp_path / "run" / "logs" / "planner.log").read_text()
    finally:
        children.stop(lambda: True)
    assert children.zygote.process.wait(30) == 0  # the stop let it go


def test_a_zygote_that_refuses_leaves_the_services_to_start_as_fresh_interpreters(tmp_path):
    children = _children(tmp_path, ["no_such_module_here"])
    try:
        children.start("planner")
        children.start("scheduler")
        assert all(isinstance(children.procs[s], subprocess.Popen) for s in ("planner", "scheduler"))
        assert "ModuleNotFoundError" in children.fallback
        assert children.procs["planner"].wait(60) == 2
    finally:
        children.stop(lambda: True)
