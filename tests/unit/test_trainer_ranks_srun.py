"""The trainer's ranks as the tasks of an srun step (services/trainer/ranks.py): Slurm's variables
become torchrun's, and the tasks meet at MASTER_ADDR:MASTER_PORT.

Real processes with the variables srun gives two tasks on two nodes (one task each); the real
multi-node step runs in tests/integration/test_slurm_multinode.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from libra.errors import ConfigError
from libra.redis_server import free_port
from libra.services.trainer.ranks import srun_environment, tasks_on_node

TASK = """
import os, torch, torch.distributed as dist
from libra.services.trainer import ranks
rank, world = ranks.launched()
group = ranks.join()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value, group=group)
print(rank, world, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], int(value.item()), flush=True)
dist.destroy_process_group()
"""


def test_tasks_on_node_reads_slurms_compressed_counts():
    assert [tasks_on_node("8(x2),4", node) for node in range(3)] == [8, 8, 4]
    assert tasks_on_node("1", 0) == 1
    with pytest.raises(ConfigError, match="outside SLURM_STEP_TASKS_PER_NODE"):
        tasks_on_node("2(x2)", 2)


def test_srun_variables_become_torchruns_and_the_rendezvous_must_be_given():
    env = {"SLURM_PROCID": "9", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "41005"}
    assert srun_environment(env) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}
    with pytest.raises(ConfigError, match="MASTER_PORT is not set"):
        srun_environment({**env, "MASTER_PORT": ""})


def test_two_srun_tasks_join_one_world_through_the_given_rendezvous():
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, "-c", TASK], stdout=subprocess.PIPE, text=True,
                              env={**base, "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0",
                                   "SLURM_NODEID": str(rank), "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in range(2)]
    outputs = [proc.communicate(timeout=120)[0].split() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs == [["0", "2", "0", "1", "3"], ["1", "2", "0", "1", "3"]]  # both ranks, one sum (1 + 2)


def test_a_one_task_step_is_a_plain_process():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    code = "from libra.services.trainer import ranks; print(*ranks.launched())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})
    assert out.stdout.split() == ["0", "1"], out.stderr
