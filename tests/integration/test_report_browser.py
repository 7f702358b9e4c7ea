"""Seeing a run as a person would: `libra report`'s page in a real headless browser (Debian's
chromium: no console error, no request but the page itself, every chart drawn), and the run's
event files in a real TensorBoard server (the tags each service writes, with their values)."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from libra.redis_server import free_port
from libra.telemetry.report import write_report
from tests.integration.browser import CHROMIUM, visit
from tests.telemetry_run import write_run

pytestmark = pytest.mark.slow

CHARTS = """JSON.stringify([...document.querySelectorAll('figure.chart')].map(figure => {
  const svg = figure.querySelector('svg');
  const box = svg.getBoundingClientRect();
  const content = svg.querySelector('g').getBBox();
  return {id: figure.id, width: box.width, height: box.height, contentWidth: content.width,
          contentHeight: content.height, drawn: svg.querySelectorAll('path, use, rect, text').length,
          text: [...svg.querySelectorAll('text')].map(t => t.textContent).join(' ')};
}))"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_the_report_loads_without_errors_and_every_chart_renders(tmp_path):
    import matplotlib.image

    config = write_run(tmp_path / "run", steps=20, tensorboard=False)
    page = write_report(config.run_path)
    seen = visit(page, CHARTS)
    assert seen.console_errors == []
    assert seen.requests == [page.resolve().as_uri()], "the page must load nothing but itself"
    charts = json.loads(seen.value)
    assert [c["id"] for c in charts] == ["reward-step", "reward-time", "step-time", "rollout", "buckets", "planner",
                                         "staleness", "worker-lag"]
    for chart in charts:
        assert chart["width"] > 600 and chart["height"] > 150, chart["id"]
        assert chart["contentWidth"] > 500 and chart["contentHeight"] > 150 and chart["drawn"] > 30, chart["id"]
    assert "training step" in charts[0]["text"] and "versions behind" in charts[-1]["text"]
    pixels = matplotlib.image.imread(io.BytesIO(seen.screenshot), format="png")
    assert pixels.shape[0] > 3000 and pixels.shape[1] == 1000 and pixels.std() > 0.05


def _json(url: str):
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed (the cpu extra)")
def test_tensorboard_shows_every_service_s_tags(tmp_path):
    config = write_run(tmp_path / "run", steps=8)
    port = free_port()
    logdir = config.run_path / "tensorboard"
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                               "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base, tags, deadline = f"http://127.0.0.1:{port}/data/plugin/scalars", {}, time.monotonic() + 120
        while time.monotonic() < deadline and len(tags) < 4:
            time.sleep(1.0)
            try:
                tags = _json(f"{base}/tags")
            except OSError:
                continue
        assert set(tags) == {"trainer", "rollout", "scheduler", "planner"}
        for run, tag in (("trainer", "reward/mean"), ("trainer", "time/train_s"), ("trainer", "staleness/mean"),
                         ("rollout", "rollout/trajectories_per_s"), ("rollout", "turn_latency/p90_s"),
                         ("rollout", "workers/long-0/policy_version"), ("scheduler", "buckets/short/workers"),
                         ("scheduler", "routed/move_signal_up_long"), ("planner", "planner/predicted_step_s")):
            assert tag in tags[run], (run, tag)
        points = _json(f"{base}/scalars?run=trainer&tag={urllib.parse.quote('time/train_s')}")
        assert [step for _, step, _ in points] == list(range(1, 9)) and {v for _, _, v in points} == {1.5}
    finally:
        server.terminate()
        server.wait(timeout=30)
