"""The run's event loop (libra/event_loop.py): what each choice runs, and a config asking for a
loop that is not installed failing at load with the field and the fix."""

import asyncio

import pytest

from libra import event_loop
from libra.config import load_run_config
from libra.errors import ConfigError


async def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@pytest.mark.skipif(not event_loop.available(), reason="uvloop is a dependency on Linux; absent here")
def test_auto_and_uvloop_run_uvloop():
    assert event_loop.run(_loop_kind(), "auto") == "uvloop"
    assert event_loop.run(_loop_kind(), "uvloop") == "uvloop"
    assert type(event_loop.new_loop("auto")).__module__.startswith("uvloop")


def test_asyncio_runs_asyncio_own_loop():
    assert event_loop.run(_loop_kind(), "asyncio") == "asyncio"
    loop = event_loop.new_loop("asyncio")
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="event_loop must be one of auto, uvloop, asyncio"):
        event_loop.chosen("trio")


def test_config_refuses_uvloop_where_it_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(event_loop, "available", lambda: False)
    path = tmp_path / "run.yaml"
    path.write_text("event_loop: uvloop\n")
    with pytest.raises(ConfigError, match="event_loop.*pip install uvloop"):
        load_run_config(path)
    path.write_text("event_loop: auto\n")
    assert load_run_config(path).event_loop == "auto"
    assert event_loop.chosen("auto") == "asyncio"
    path.write_text("event_loop: libuv\n")
    with pytest.raises(ConfigError, match="event_loop"):
        load_run_config(path)
