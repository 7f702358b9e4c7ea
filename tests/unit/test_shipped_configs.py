"""Every config the repository ships validates: run configs, the files they and the planner read,
and the configs the deployments start (Docker Compose, Slurm), with the environment those set."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from libra.config import build_run_config, load_run_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN_CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "headline").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _from_the_repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # configs name their data files relative to the directory libra runs in


def test_the_run_configs_are_all_found():
    names = {path.stem for path in RUN_CONFIGS}
    assert {"quickstart", "gsm8k", "dapo", "search_r1", "code_agent", "swe"} <= names
    assert {"a-sync-colocated", "b-async-even", "c-libra-static", "d-libra-full"} <= names  # configs/headline/


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda path: str(path.relative_to(ROOT / "configs")))
def test_run_config_validates_and_its_resolved_form_too(path):
    config = load_run_config(path, env={})
    # `libra check-config` prints this resolved form; it must load back to the same config.
    resolved = yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json")))
    assert build_run_config(resolved, env={}) == config


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda path: str(path.relative_to(ROOT / "configs")))
def test_run_config_workload_data_is_usable(path):
    from libra.workloads.base import build_workload

    workload = build_workload(load_run_config(path, env={}).workload)
    for prompt_id in range(workload.num_prompts):
        assert workload.prompt(prompt_id).text  # raises InvalidArgument naming the line of a bad row


def test_hardware_model_and_trace_files_load():
    from libra.services.planner.hardware import load_gpu, load_model
    from libra.traces.files import read

    for path in sorted((ROOT / "configs" / "hardware").glob("*.yaml")):
        assert load_gpu(path).name, path
    for path in sorted((ROOT / "configs" / "models").glob("*.yaml")):
        assert load_model(path).name, path
    traces = sorted((ROOT / "configs" / "traces").iterdir())
    assert traces
    for path in traces:
        assert read(path), path


def test_docker_compose_services_start_on_a_valid_config():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    seen = set()
    for name, service in compose["services"].items():
        if name == "redis" or "monitoring" in service.get("profiles", []):  # not Libra services (test_monitoring.py)
            continue
        command = service["command"]
        assert command[:2] == ["serve", name] and command[2] == "--config", command
        default = re.fullmatch(r"\$\{LIBRA_CONFIG:-/app/(.+)\}", command[3])
        assert default, f"{name}: --config {command[3]!r} is not ${{LIBRA_CONFIG:-/app/FILE}}"
        # The image copies configs/ to /app/configs (deploy/Dockerfile).
        env = {key: str(value) for key, value in service["environment"].items()}
        config = load_run_config(ROOT / default.group(1), env=env)
        assert config.address_of(name) == env[f"LIBRA_{name.upper()}_ADDRESS"]
        seen.add(name)
    assert seen == {"planner", "scheduler", "rollout", "trainer", "elastic"}


def test_slurm_job_starts_on_a_valid_config():
    from libra.slurm.job import DEFAULT_CONFIG

    script = (ROOT / "deploy" / "slurm" / "libra.sbatch").read_text()
    assert "LIBRA_CONFIG" in script and f"({DEFAULT_CONFIG})" in script, "libra.sbatch no longer names its default config"
    # The job's documented LIBRA_EXTRA_ARGS examples, on top of the addresses it exports.
    overrides = {key: yaml.safe_load(value) for key, value in re.findall(r"--set (\S+?)=([^\s\"]+)", script)}
    assert overrides
    env = {f"LIBRA_{name.upper()}_ADDRESS": f"node0:{50051 + i}"
           for i, name in enumerate(("planner", "scheduler", "rollout", "trainer", "elastic"))}
    env["LIBRA_REDIS_URL"] = "redis://node0:6379/0"
    config = load_run_config(ROOT / DEFAULT_CONFIG, overrides, env=env)
    assert config.trainer.steps == overrides["trainer.steps"]
