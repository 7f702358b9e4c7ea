"""Where a Slurm job's parts run (libra/slurm/layout.py): roles on nodes, ranks and GPUs per step,
addresses and ports, and the settings an allocation cannot satisfy (the error names the variable).

The same layouts run for real over namespaced Slurm nodes in tests/integration/test_slurm_multinode.py.
"""

from __future__ import annotations

import pytest

from libra.slurm.layout import PORTS, LayoutError, Node, RunFacts, Settings, plan, select


def cpu_nodes(count: int) -> tuple[Node, ...]:
    return tuple(Node(f"node{i}", f"127.100.0.{10 + i}", 2, 0) for i in range(count))


def gpu_nodes(count: int, gpus: int = 8) -> tuple[Node, ...]:
    return tuple(Node(f"gpu{i}", f"10.1.0.{i}", 112, gpus) for i in range(count))


def test_one_cpu_node_runs_everything_there_with_its_workers_as_children_of_the_gateway():
    layout = plan(cpu_nodes(1), Settings(), RunFacts())
    assert set(layout.node_of.values()) == {"node0"} and layout.trainer_nodes == ("node0",)
    assert layout.worker_launch == "local" and "rollout.worker.launch" not in layout.overrides
    assert layout.addresses["trainer"] == "127.100.0.10:50054"
    assert all("--overlap" in args and "--gres=none" not in args for args in layout.srun.values())


def test_two_cpu_nodes_put_rollout_on_the_second_and_every_port_follows_the_base():
    layout = plan(cpu_nodes(2), Settings(port_base=41000), RunFacts())
    assert layout.node_of == {"redis": "node0", "planner": "node0", "scheduler": "node0", "elastic": "node0",
                              "rollout": "node1"}
    assert layout.addresses == {"planner": "127.100.0.10:41000", "scheduler": "127.100.0.10:41001",
                                "rollout": "127.100.0.11:41002", "trainer": "127.100.0.10:41003",
                                "elastic": "127.100.0.10:41004"}
    assert layout.redis == ("127.100.0.10", 41000 + PORTS["redis"])
    assert layout.rendezvous == ("127.100.0.10", 41005)
    assert layout.overrides["metrics.base_port"] == 41010
    assert layout.overrides["rollout.worker.base_port"] == 41020
    assert layout.overrides["rollout.openai_endpoint.port"] == 41008
    other = plan(cpu_nodes(2), Settings(port_base=42000), RunFacts())
    ours = {v for k, v in layout.overrides.items() if isinstance(v, int)} | {layout.redis[1], layout.rendezvous[1]}
    theirs = {v for k, v in other.overrides.items() if isinstance(v, int)} | {other.redis[1], other.rendezvous[1]}
    assert not ours & theirs  # two jobs on one node: no port in common


def test_disabled_metrics_and_free_worker_ports_stay_as_the_config_says():
    layout = plan(cpu_nodes(1), Settings(), RunFacts(metrics=False, fixed_worker_ports=False))
    assert "metrics.base_port" not in layout.overrides and "rollout.worker.base_port" not in layout.overrides


def test_two_nodes_of_eight_gpus_trainer_on_one_workers_on_the_other_each_step_with_its_gpus():
    layout = plan(gpu_nodes(2), Settings(), RunFacts(trainer_ranks=8, weights="group"))
    assert layout.gpu and layout.trainer_nodes == ("gpu0",) and layout.trainer_tasks_per_node == 8
    assert layout.srun["trainer"] == ("--nodes=1", "--ntasks=8", "--ntasks-per-node=8", "--nodelist=gpu0",
                                      "--kill-on-bad-exit=1", "--exact", "--gres=gpu:8", "--cpus-per-task=14",
                                      "--mem=0")
    assert layout.srun["planner"][-2:] == ("--overlap", "--gres=none")  # the control steps hold no GPU
    assert layout.worker_launch == "srun"
    assert layout.overrides["rollout.worker.launch"] == {
        "type": "srun", "nodes": [{"name": "gpu1", "address": "10.1.0.1", "slots": 8}], "gpus_per_rank": 1,
        "cpus_per_rank": 14, "srun_args": []}
    assert layout.overrides["weights.address"] == f"10.1.0.0:{50051 + PORTS['weights']}"  # the trainer's node
    assert layout.node_of["rollout"] == "gpu1"


def test_trainer_ranks_spread_over_their_nodes_rank_zero_on_the_first_in_the_jobs_order():
    layout = plan(gpu_nodes(4), Settings(placement={"trainer": "2,1"}), RunFacts(trainer_ranks=16))
    assert layout.trainer_nodes == ("gpu1", "gpu2") and layout.trainer_tasks_per_node == 8
    assert layout.rendezvous[0] == "10.1.0.1" and layout.addresses["trainer"].startswith("10.1.0.1:")
    assert [n for n, _, _ in layout.worker_nodes] == ["gpu0", "gpu3"]
    assert "--nodes=2" in layout.srun["trainer"] and "--nodelist=gpu1,gpu2" in layout.srun["trainer"]


def test_by_default_the_trainer_takes_the_nodes_its_ranks_need_and_a_shared_node_splits_its_gpus():
    assert plan(gpu_nodes(3), Settings(), RunFacts(trainer_ranks=16)).trainer_nodes == ("gpu0", "gpu1")
    one = plan(gpu_nodes(1), Settings(), RunFacts(trainer_ranks=4))
    assert one.worker_nodes == (("gpu0", "10.1.0.0", 4),)  # 8 GPUs: 4 train, 4 for the workers


def test_roles_move_by_index_range_or_name_and_addresses_can_be_overridden():
    settings = Settings(placement={"redis": "node2", "planner": "1", "workers": "1-2", "rollout": "node2"},
                        address_pattern="{node}-ib", addresses={"scheduler": "sched.example:7000"})
    layout = plan(cpu_nodes(3), settings, RunFacts())
    assert layout.node_of["redis"] == "node2" and layout.node_of["planner"] == "node1"
    assert layout.redis[0] == "node2-ib" and layout.addresses["planner"] == "node1-ib:50051"
    assert layout.addresses["scheduler"] == "sched.example:7000"
    assert layout.worker_launch == "srun"  # workers on node1 and node2, the gateway on node2
    assert [node["name"] for node in layout.overrides["rollout.worker.launch"]["nodes"]] == ["node1", "node2"]
    assert layout.overrides["rollout.worker.launch"]["gpus_per_rank"] == 0


def test_per_role_srun_arguments_are_appended_to_that_roles_step_and_the_workers():
    settings = Settings(srun_args=("--exclude=bad1",), srun_args_of={"trainer": ("--cpu-bind=cores",),
                                                                     "workers": ("--mem-per-gpu=80G",)})
    layout = plan(gpu_nodes(2), settings, RunFacts(trainer_ranks=8))
    assert layout.srun["trainer"][-2:] == ("--exclude=bad1", "--cpu-bind=cores")
    assert layout.srun["planner"][-1] == "--exclude=bad1"
    assert layout.overrides["rollout.worker.launch"]["srun_args"] == ["--exclude=bad1", "--mem-per-gpu=80G"]


def test_select_keeps_the_order_given_and_drops_repeats():
    assert select("2,0-1,node2", cpu_nodes(3), "V") == ["node2", "node0", "node1"]


@pytest.mark.parametrize("settings, run, message", [
    (Settings(placement={"rollout": "5"}), RunFacts(), "LIBRA_ROLLOUT_NODE=5: index 5 is outside the job's 2"),
    (Settings(placement={"planner": "nodeX"}), RunFacts(), "'nodeX' is neither an index nor one of the job's nodes"),
    (Settings(placement={"redis": "0,1"}), RunFacts(), "LIBRA_REDIS_NODE=0,1: give one node"),
    (Settings(placement={"trainer": "0,1"}), RunFacts(trainer_ranks=3), "does not spread evenly"),
])
def test_settings_the_allocation_cannot_satisfy_are_refused_naming_the_variable(settings, run, message):
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(cpu_nodes(2), settings, run)


def test_gpu_settings_that_do_not_fit_are_refused():
    with pytest.raises(LayoutError, match="needs 16 GPUs per node; the nodes have 8"):
        plan(gpu_nodes(2), Settings(placement={"trainer": "0"}), RunFacts(trainer_ranks=16))
    with pytest.raises(LayoutError, match="no GPU is left for rollout workers"):
        plan(gpu_nodes(1), Settings(), RunFacts(trainer_ranks=8))


def test_settings_come_from_the_environment_and_bad_values_are_named():
    settings = Settings.from_env({"LIBRA_PORT_BASE": "40000", "LIBRA_TRAINER_NODES": "0-1", "LIBRA_GPUS_PER_NODE": "4",
                                  "LIBRA_SRUN_ARGS_WORKERS": "--mem-per-gpu=80G --qos=high",
                                  "LIBRA_TRAINER_ADDRESS": "t:1", "LIBRA_ADDRESS_PATTERN": "{node}-ib"})
    assert settings.port_base == 40000 and settings.placement == {"trainer": "0-1"} and settings.gpus_per_node == 4
    assert settings.srun_args_of == {"workers": ("--mem-per-gpu=80G", "--qos=high")}
    assert settings.addresses == {"trainer": "t:1"} and settings.address_pattern == "{node}-ib"
    with pytest.raises(LayoutError, match="LIBRA_PORT_BASE='80'"):
        Settings.from_env({"LIBRA_PORT_BASE": "80"})
    with pytest.raises(LayoutError, match="LIBRA_ADDRESS_PATTERN='ib'.*must contain"):
        Settings.from_env({"LIBRA_ADDRESS_PATTERN": "ib"})
