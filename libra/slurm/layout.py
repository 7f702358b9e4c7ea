"""Where each part of a Libra job runs on its Slurm allocation, and how the parts reach each other.

A pure core: the job's nodes (name, address, CPUs, GPUs), the LIBRA_* settings (`Settings.from_env`)
and three facts of the run config in, a `Layout` out — no Slurm calls, no processes. job.py turns
the layout into srun steps and config overrides.

```
 nodes:   node0            node1            node2            node3
 roles:   redis planner    trainer ranks    trainer ranks    rollout gateway
          scheduler        8-15             (…)              workers (first fit, a step each)
          elastic
          trainer ranks 0-7 ── MASTER_ADDR = node0, weights group at node0
```
Defaults: the control services (redis, planner, scheduler, elastic) on the first node; the
trainer on as many nodes from the first as its ranks need GPUs (one node on CPU jobs); the rollout
workers on the other nodes (all nodes when there are no others: they share with the trainer), the
rollout gateway on the first of them. LIBRA_<ROLE>_NODE(S) moves any of them (indices, ranges,
names). Every port follows LIBRA_PORT_BASE (`PORTS`), so two jobs on one node do not collide.
Addresses are the nodes' (Slurm NodeAddr, or LIBRA_ADDRESS_PATTERN such as `{node}-ib`), and any
service's can be given whole (LIBRA_<SERVICE>_ADDRESS). GPUs: the trainer's step and every GPU
worker's step ask for theirs and run exclusive (Slurm binds them); the other steps ask for none
and overlap.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping

SERVICES = ("planner", "scheduler", "rollout", "trainer", "elastic")
CONTROL = ("redis", "planner", "scheduler", "elastic")
PORTS = {"planner": 0, "scheduler": 1, "rollout": 2, "trainer": 3, "elastic": 4, "rendezvous": 5, "weights": 6,
         "redis": 7, "openai": 8, "metrics": 10, "workers": 20}
"""Port of each thing, as an offset from LIBRA_PORT_BASE (metrics: 5 ports, workers: one per worker)."""
MAX_PORT_BASE = 65535 - PORTS["workers"] - 4096


class LayoutError(ValueError):
    """A setting the allocation cannot satisfy; the message names the LIBRA_* variable to change."""


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    cpus: int
    gpus: int


@dataclass(frozen=True)
class Settings:
    """The job's LIBRA_* settings (deploy/slurm/libra.sbatch lists them)."""

    port_base: int = 50051
    placement: Mapping[str, str] = field(default_factory=dict)  # role -> LIBRA_<ROLE>_NODE(S) as given
    address_pattern: str = ""
    addresses: Mapping[str, str] = field(default_factory=dict)  # service -> LIBRA_<SERVICE>_ADDRESS
    redis_port: int = 0  # 0: port base + PORTS["redis"]
    gpus_per_node: int | None = None  # None: what the allocation says
    cpus_per_gpu: int = 0  # 0: the node's CPUs / its GPUs
    worker_slots: int = 0  # CPU jobs: worker ranks per rollout node (0: its CPUs)
    srun_args: tuple[str, ...] = ()
    srun_args_of: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # role (or "workers") -> args

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Settings":
        def number(name: str, default: int | None, low: int = 0, high: int = 1 << 20) -> int | None:
            text = env.get(name, "").strip()
            if not text:
                return default
            if not text.isdigit() or not low <= int(text) <= high:
                raise LayoutError(f"{name}={text!r}: give a whole number in {low}..{high}")
            return int(text)

        placement = {}
        for role in (*CONTROL, "rollout", "trainer", "workers"):
            for name in (f"LIBRA_{role.upper()}_NODE", f"LIBRA_{role.upper()}_NODES"):
                if env.get(name, "").strip():
                    placement[role] = env[name].strip()
        pattern = env.get("LIBRA_ADDRESS_PATTERN", "")
        if pattern and "{node}" not in pattern:
            raise LayoutError(f"LIBRA_ADDRESS_PATTERN={pattern!r} must contain {{node}} (e.g. {{node}}-ib)")
        srun_of = {role: tuple(shlex.split(env[f"LIBRA_SRUN_ARGS_{role.upper()}"]))
                   for role in (*CONTROL, "rollout", "trainer", "workers") if env.get(f"LIBRA_SRUN_ARGS_{role.upper()}")}
        return cls(port_base=number("LIBRA_PORT_BASE", 50051, 1024, MAX_PORT_BASE),
                   placement=placement, address_pattern=pattern,
                   addresses={s: env[f"LIBRA_{s.upper()}_ADDRESS"] for s in SERVICES
                              if env.get(f"LIBRA_{s.upper()}_ADDRESS")},
                   redis_port=number("LIBRA_REDIS_PORT", 0, 1024, 65535),
                   gpus_per_node=number("LIBRA_GPUS_PER_NODE", None, 0, 1024),
                   cpus_per_gpu=number("LIBRA_CPUS_PER_GPU", 0, 0, 4096),
                   worker_slots=number("LIBRA_WORKER_SLOTS", 0, 0, 4096),
                   srun_args=tuple(shlex.split(env.get("LIBRA_SRUN_ARGS", ""))), srun_args_of=srun_of)


@dataclass(frozen=True)
class RunFacts:
    """What the layout needs from the run config."""

    trainer_ranks: int = 1
    weights: str = "disk"  # weights.type
    metrics: bool = True  # metrics.base_port != 0
    fixed_worker_ports: bool = True  # rollout.worker.base_port != 0


@dataclass(frozen=True)
class Layout:
    nodes: tuple[Node, ...]
    gpu: bool
    node_of: dict[str, str]  # control roles and the rollout gateway -> node name
    trainer_nodes: tuple[str, ...]
    trainer_tasks_per_node: int
    worker_nodes: tuple[tuple[str, str, int], ...]  # (name, address, slots)
    worker_launch: str  # local (children of the gateway) or srun (a step each)
    addresses: dict[str, str]  # service -> HOST:PORT
    redis: tuple[str, int]
    rendezvous: tuple[str, int]  # the trainer ranks' MASTER_ADDR, MASTER_PORT
    srun: dict[str, tuple[str, ...]]  # role -> srun options of its step
    overrides: dict[str, Any]  # config overrides the layout implies

    def describe(self) -> list[str]:
        """One line per node: what runs there."""
        lines = []
        for node in self.nodes:
            roles = [r for r, n in self.node_of.items() if n == node.name]
            if node.name in self.trainer_nodes:
                roles.append(f"trainer ×{self.trainer_tasks_per_node}")
            slots = next((s for n, _, s in self.worker_nodes if n == node.name), 0)
            if slots:
                roles.append(f"workers ({slots} slots, {self.worker_launch})")
            lines.append(f"{node.name} ({node.address}, {node.cpus} CPUs, {node.gpus} GPUs): "
                         f"{', '.join(roles) or 'idle'}")
        return lines


def select(spec: str, nodes: tuple[Node, ...], variable: str) -> list[str]:
    """Node names from a LIBRA_<ROLE>_NODE(S) value: comma-separated indices (0), ranges (1-3) or
    node names, in the order given, without repeats."""
    names = [n.name for n in nodes]
    chosen: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if re.fullmatch(r"\d+(-\d+)?", item):
            low, _, high = item.partition("-")
            indices = range(int(low), int(high or low) + 1)
            if not indices or indices[-1] >= len(names):
                raise LayoutError(f"{variable}={spec}: index {item} is outside the job's {len(names)} node(s) "
                                  f"(0..{len(names) - 1}: {', '.join(names)})")
            picked = [names[i] for i in indices]
        elif item in names:
            picked = [item]
        else:
            raise LayoutError(f"{variable}={spec}: {item!r} is neither an index nor one of the job's nodes "
                              f"({', '.join(names)})")
        chosen += [name for name in picked if name not in chosen]
    return chosen


def plan(nodes: tuple[Node, ...], settings: Settings, run: RunFacts) -> Layout:
    """The layout of a job (module docstring); LayoutError names the setting that does not fit."""
    if not nodes:
        raise LayoutError("the job has no nodes")
    if settings.address_pattern:
        nodes = tuple(Node(n.name, settings.address_pattern.format(node=n.name), n.cpus, n.gpus) for n in nodes)
    by_name = {n.name: n for n in nodes}
    gpus = settings.gpus_per_node if settings.gpus_per_node is not None else min(n.gpus for n in nodes)
    gpu = gpus > 0
    base = settings.port_base

    def where(role: str, default: list[str], many: bool = False) -> list[str]:
        spec = settings.placement.get(role)
        variable = f"LIBRA_{role.upper()}_NODE{'S' if many else ''}"
        chosen = select(spec, nodes, variable) if spec else default
        if not many and len(chosen) != 1:
            hint = "; the rollout workers' nodes are LIBRA_WORKERS_NODES" if role == "rollout" else ""
            raise LayoutError(f"{variable}={spec}: give one node{hint}")
        return chosen

    ranks = run.trainer_ranks
    trainer_default = [nodes[i].name for i in range(min(len(nodes), -(-ranks // gpus)))] if gpu else [nodes[0].name]
    order = [n.name for n in nodes]  # Slurm numbers a step's tasks in the job's node order: rank 0 is on the first
    trainer_nodes = sorted(where("trainer", trainer_default, many=True), key=order.index)
    if ranks % len(trainer_nodes):
        raise LayoutError(f"trainer.ranks={ranks} does not spread evenly over the {len(trainer_nodes)} trainer "
                          f"node(s) {trainer_nodes}: set LIBRA_TRAINER_NODES to a count of nodes dividing {ranks}")
    per_node = ranks // len(trainer_nodes)
    if gpu and per_node > gpus:
        raise LayoutError(f"trainer.ranks={ranks} on {len(trainer_nodes)} node(s) needs {per_node} GPUs per node; "
                          f"the nodes have {gpus}: give the trainer more nodes (LIBRA_TRAINER_NODES)")
    others = [n.name for n in nodes if n.name not in trainer_nodes]
    worker_nodes = where("workers", others or [n.name for n in nodes], many=True)
    node_of = {role: where(role, [nodes[0].name])[0] for role in CONTROL}
    node_of["rollout"] = where("rollout", [worker_nodes[0]])[0]

    def slots(name: str) -> int:
        if not gpu:
            return settings.worker_slots or by_name[name].cpus
        return gpus - (per_node if name in trainer_nodes else 0)

    workers = tuple((name, by_name[name].address, slots(name)) for name in worker_nodes if slots(name) > 0)
    if not workers:
        raise LayoutError(f"no GPU is left for rollout workers on {worker_nodes} (the trainer takes {per_node} of "
                          f"{gpus} per node there): set LIBRA_WORKERS_NODES to other nodes or give the job more")
    launch = "srun" if gpu or [n for n, _, _ in workers] != [node_of["rollout"]] else "local"

    def address(service: str) -> str:
        if service in settings.addresses:
            return settings.addresses[service]
        node = trainer_nodes[0] if service == "trainer" else node_of[service]
        return f"{by_name[node].address}:{base + PORTS[service]}"

    addresses = {service: address(service) for service in SERVICES}
    rendezvous = (by_name[trainer_nodes[0]].address, base + PORTS["rendezvous"])
    cpus_per_gpu = settings.cpus_per_gpu or (max(1, min(by_name[n].cpus for n in trainer_nodes) // gpus) if gpu else 1)
    srun = {role: _control_srun(node_of[role], gpu) for role in (*CONTROL, "rollout")}
    srun["trainer"] = _trainer_srun(trainer_nodes, ranks, per_node, gpu, cpus_per_gpu)
    srun = {role: (*args, *settings.srun_args, *settings.srun_args_of.get(role, ())) for role, args in srun.items()}
    overrides: dict[str, Any] = {f"addresses.{s}": a for s, a in addresses.items()}
    overrides["rollout.openai_endpoint.port"] = base + PORTS["openai"]
    if run.metrics:
        overrides["metrics.base_port"] = base + PORTS["metrics"]
    if run.fixed_worker_ports:
        overrides["rollout.worker.base_port"] = base + PORTS["workers"]
    if run.weights == "group":
        overrides["weights.address"] = f"{rendezvous[0]}:{base + PORTS['weights']}"
    if launch == "srun":
        worker_args = (*settings.srun_args, *settings.srun_args_of.get("workers", ()))
        overrides["rollout.worker.launch"] = {
            "type": "srun", "nodes": [{"name": n, "address": a, "slots": s} for n, a, s in workers],
            "gpus_per_rank": 1 if gpu else 0, "cpus_per_rank": cpus_per_gpu, "srun_args": list(worker_args)}
    redis_node = by_name[node_of["redis"]]
    return Layout(nodes, gpu, node_of, tuple(trainer_nodes), per_node, workers, launch, addresses,
                  (redis_node.address, settings.redis_port or base + PORTS["redis"]), rendezvous, srun, overrides)


def _control_srun(node: str, gpu: bool) -> tuple[str, ...]:
    """A one-task step that shares the node with every other step and holds no GPU."""
    return ("--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", *(("--gres=none",) if gpu else ()))


def _trainer_srun(nodes: list[str], ranks: int, per_node: int, gpu: bool, cpus_per_gpu: int) -> tuple[str, ...]:
    """The trainer's ranks as the tasks of one step over its nodes, each node's GPUs theirs alone."""
    args = [f"--nodes={len(nodes)}", f"--ntasks={ranks}", f"--ntasks-per-node={per_node}",
            f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=1"]
    if gpu:
        args += ["--exact", f"--gres=gpu:{per_node}", f"--cpus-per-task={cpus_per_gpu}", "--mem=0"]
    else:
        args += ["--overlap"]
    return tuple(args)
