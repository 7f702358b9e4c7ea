"""Which node each rollout worker runs on, when the workers spread over several nodes.

A pure core (no processes, no Slurm): nodes with a number of free TP-rank slots each (GPUs on GPU
nodes), workers asking for `tp` slots. `take` puts a worker on the first node (in the given order)
with room for all of its ranks — a worker never spans nodes — so the workers of one bucket, which
the pool starts one after another, fill a node before the next: a plan of `TP2 × 4, TP4 × 2` on
two 8-GPU nodes puts the four TP-2 workers on the first and the two TP-4 workers on the second.
`release` gives a stopped worker's slots back (elastic plans drain and start workers at run time).

    nodes:  node1 [■■■■■■■■]   node2 [■■■■□□□□]     ■ taken by a worker's ranks
    take("long-5", tp=4) ─▶ node2 [■■■■■■■■]
    take("long-6", tp=4) ─▶ PlacementError: no node has 4 free slots (node1 0/8, node2 0/8 free)
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PlacementError(ValueError):
    """No node has room for a worker; the message lists every node's free slots."""


@dataclass
class NodeSlots:
    name: str
    address: str
    slots: int
    workers: dict[str, int] = field(default_factory=dict)  # worker key -> slots it holds

    @property
    def free(self) -> int:
        return self.slots - sum(self.workers.values())


class Placement:
    """Free slots per node and which worker holds which (module docstring)."""

    def __init__(self, nodes: list[NodeSlots]):
        if not nodes:
            raise ValueError("placement needs at least one node")
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"placement nodes must be distinct, got {names}")
        self.nodes = nodes
        self._where: dict[str, NodeSlots] = {}

    def take(self, key: str, tp: int) -> NodeSlots:
        """The node worker `key` runs on (first fit); its `tp` slots are held until `release(key)`."""
        if key in self._where:
            raise ValueError(f"worker {key!r} is placed already, on {self._where[key].name}")
        if tp < 1:
            raise ValueError(f"worker {key!r} asks for tp={tp}; it must be >= 1")
        for node in self.nodes:
            if node.free >= tp:
                node.workers[key] = tp
                self._where[key] = node
                return node
        state = ", ".join(f"{n.name} {n.free}/{n.slots}" for n in self.nodes)
        raise PlacementError(f"no rollout node has {tp} free slot(s) for worker {key!r} (free/slots: {state}); "
                             f"give rollout more nodes or GPUs (rollout.worker.launch.nodes; under Slurm "
                             f"LIBRA_WORKERS_NODES), or plan fewer or smaller workers")

    def release(self, key: str) -> None:
        """Give back the slots of worker `key` (nothing if it holds none)."""
        node = self._where.pop(key, None)
        if node is not None:
            node.workers.pop(key, None)

    def node_of(self, key: str) -> NodeSlots | None:
        return self._where.get(key)
