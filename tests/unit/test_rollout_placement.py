"""Rollout workers over several nodes (services/rollout/placement.py, launch.py): which node each
worker gets, the srun step it runs as, and what it inherits. No processes here: the workers as
real srun steps on namespaced Slurm nodes are tests/integration/test_slurm_multinode.py.
"""

from __future__ import annotations

import pathlib

import pytest
from pydantic import ValidationError

from libra.services.rollout.config import WorkerConfig
from libra.services.rollout.launch import LocalLauncher, SrunLauncher, build_launcher, srun_command
from libra.services.rollout.placement import NodeSlots, Placement, PlacementError
from libra.services.rollout.workers import worker_process_class


def two_nodes() -> Placement:
    return Placement([NodeSlots("gpu1", "10.0.0.1", 8), NodeSlots("gpu2", "10.0.0.2", 8)])


def test_first_fit_keeps_a_buckets_workers_together_and_never_splits_a_worker():
    placement = two_nodes()
    short = [placement.take(f"short-{i}", 2).name for i in range(4)]
    long = [placement.take(f"long-{i}", 4).name for i in range(4, 6)]
    assert short == ["gpu1"] * 4 and long == ["gpu2"] * 2
    with pytest.raises(PlacementError, match=r"no rollout node has 1 free slot\(s\).*gpu1 0/8, gpu2 0/8"):
        placement.take("extra", 1)


def test_a_released_worker_gives_its_slots_back_and_a_worker_too_large_for_any_node_is_refused():
    placement = two_nodes()
    placement.take("a", 6)
    placement.take("b", 6)
    with pytest.raises(PlacementError):
        placement.take("c", 4)
    placement.release("a")
    assert placement.take("c", 4).name == "gpu1" and placement.node_of("c").free == 4
    with pytest.raises(PlacementError, match="no rollout node has 9 free"):
        placement.take("huge", 9)
    with pytest.raises(ValueError, match="placed already"):
        placement.take("c", 1)


def test_srun_command_gpu_workers_are_exclusive_steps_with_their_gpus_cpu_workers_overlap():
    gpu = WorkerConfig(launch={"type": "srun", "nodes": [{"name": "gpu1", "slots": 8}], "cpus_per_rank": 14,
                               "srun_args": ["--qos=high"]}).launch
    assert srun_command(gpu, "77", "gpu1", "long-3", tp=4) == [
        "srun", "--jobid=77", "--nodes=1", "--ntasks=1", "--nodelist=gpu1", "--job-name=libra-worker-long-3",
        "--kill-on-bad-exit=1", "--exact", "--gres=gpu:4", "--cpus-per-task=56", "--mem=0", "--qos=high"]
    cpu = WorkerConfig(launch={"type": "srun", "nodes": [{"name": "n1", "slots": 2}], "gpus_per_rank": 0}).launch
    argv = srun_command(cpu, "77", "n1", "short-0", tp=1)
    assert "--overlap" in argv and not any(a.startswith("--gres") for a in argv)


def test_an_srun_worker_listens_on_its_nodes_address_and_does_not_inherit_the_gateways_step(
        monkeypatch, tmp_path: pathlib.Path):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "5")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "2")
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    config = WorkerConfig(engine="hf", launch={"type": "srun", "gpus_per_rank": 0,
                                               "nodes": [{"name": "n1", "address": "127.100.0.11", "slots": 1},
                                                         {"name": "n2", "address": "127.100.0.12", "slots": 1}]})
    launcher = build_launcher(config.launch)
    assert isinstance(launcher, SrunLauncher) and launcher.job_id == "77"
    engine = worker_process_class("hf")
    first = launcher.create(engine, config, "short-0", model_dir=tmp_path, index=0, log_dir=tmp_path, port=41020, tp=1,
                            policy_version=3)
    second = launcher.create(engine, config, "long-1", model_dir=tmp_path, index=1, log_dir=tmp_path, port=41021, tp=1,
                             policy_version=3)
    assert (first.base_url, second.base_url) == ("http://127.100.0.11:41020", "http://127.100.0.12:41021")
    command = second.command()
    assert command[:5] == ["srun", "--jobid=77", "--nodes=1", "--ntasks=1", "--nodelist=n2"]
    assert command[command.index("--host") + 1] == "127.100.0.12" and "libra.services.rollout.engines.hf_server" in command
    env = second.environment()
    assert env["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    assert not {"SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_CPUS_PER_TASK"} & set(env)
    with pytest.raises(PlacementError):
        launcher.create(engine, config, "long-2", model_dir=tmp_path, index=2, log_dir=tmp_path, port=41022, tp=1)
    launcher.release("short-0")
    assert launcher.create(engine, config, "long-2", model_dir=tmp_path, index=2, log_dir=tmp_path, port=41022,
                           tp=1).node.name == "n1"


def test_srun_launch_outside_a_job_and_repeated_nodes_are_refused(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    launch = WorkerConfig(launch={"type": "srun", "nodes": [{"name": "n1", "slots": 1}]}).launch
    with pytest.raises(ValueError, match="needs a Slurm job"):
        build_launcher(launch)
    with pytest.raises(ValidationError, match="names a node twice"):
        WorkerConfig(launch={"type": "srun", "nodes": [{"name": "n1", "slots": 1}, {"name": "n1", "slots": 2}]})
    assert isinstance(build_launcher(WorkerConfig().launch), LocalLauncher)
