"""Pieces of the Slurm job driver (libra/slurm/) that need no cluster: reading the nodes, squeue's
time left (slurmctl.py), and the restart bookkeeping of a step that dies (job.py, real processes).

The driver on a real (namespaced) multi-node Slurm: tests/integration/test_slurm_multinode.py.
"""

from __future__ import annotations

import os
import sys

from libra.slurm.job import Job
from libra.slurm.slurmctl import parse_nodes, seconds
from libra.slurm.steps import Step

SHOW_NODE = """NodeName=gpu1 Arch=x86_64 CoresPerSocket=56 CPUAlloc=0 CPUTot=112 Gres=gpu:h200:8(S:0-1) NodeAddr=10.1.0.1 NodeHostName=gpu1
NodeName=gpu2 Arch=x86_64 CPUTot=112 Gres=gpu:8 NodeAddr=gpu2-ib NodeHostName=gpu2
NodeName=cpu1 Arch=x86_64 CPUTot=64 Gres=(null) NodeAddr=cpu1 NodeHostName=cpu1"""


def test_nodes_come_with_their_address_cpus_and_gpus_in_the_jobs_order():
    nodes = parse_nodes(["gpu2", "gpu1", "cpu1"], SHOW_NODE)
    assert [(n.name, n.address, n.cpus, n.gpus) for n in nodes] == [
        ("gpu2", "gpu2-ib", 112, 8), ("gpu1", "10.1.0.1", 112, 8), ("cpu1", "cpu1", 64, 0)]


def test_time_left_in_seconds():
    assert seconds("1-02:03:04") == 93784 and seconds("2:03:04") == 7384 and seconds("3:04") == 184
    assert seconds("UNLIMITED") == float("inf") and seconds("") == float("inf")


def test_a_dead_step_is_restarted_after_a_backoff_until_it_has_died_too_often(tmp_path):
    job = Job({"SLURM_JOB_ID": "1", "LIBRA_RESTARTS": "1"})
    job.logs = tmp_path
    step = Step("planner", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    step.start()
    step.proc.wait()
    assert step.poll() == 3
    assert job._restart(step) == "" and step.next_start > 0 and step.restarts == 0  # waiting out the backoff
    step.next_start = 1.0  # the backoff is over
    assert job._restart(step) == "" and step.restarts == 1 and step.status is None  # started again
    step.proc.wait()
    assert step.poll() == 3
    assert job._restart(step) == "failed: planner exited with status 3 after 1 restart(s)"
    assert step.history == [3, 3]
