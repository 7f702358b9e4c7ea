"""Node placement of a split: which (training layout, rollout fleet) pairs the cluster's nodes hold.

A cluster of N GPUs on nodes of G GPUs is N // G full nodes and, when G does not divide N, one
partial node of N mod G. A tensor-parallel group (one training TP group, one rollout instance)
must sit inside one node, since its all-reduces run over NVLink; training and rollout may share
a node unless whole-node placement is on.

    whole_nodes on     each side gets whole nodes: no node is shared by training and rollout
    whole_nodes off    TP groups are packed into the nodes (first-fit decreasing); sides may share
    whole_nodes auto   on where it can help: a cluster of at least two whole nodes, and only while
                       the best whole-node plan is within `whole_node_slack` of the best packed
                       one (the search runs both and says which it kept and why); off on one
                       node or with a partial node, where whole nodes only forbid splits

Whole nodes buy isolation that the cost model does not price (no node's NVLink, PCIe or host
memory shared by the two sides; the elastic pool moves whole nodes), so `auto` keeps them unless
they cost a measurable share of the predicted step. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

Multiset = tuple[tuple[int, int], ...]  # ((tp, instances), ...)


def node_sizes(total: int, per_node: int) -> list[int]:
    """GPUs per node: full nodes, then the partial one (if any)."""
    full, rest = divmod(total, per_node)
    return [per_node] * full + ([rest] if rest else [])


def describe_cluster(total: int, per_node: int) -> str:
    full, rest = divmod(total, per_node)
    if not full:
        return f"{total} GPUs (part of one {per_node}-GPU node)"
    if not rest:
        return f"{total} GPUs = {full} node{'s' if full != 1 else ''} of {per_node}"
    return f"{total} GPUs = {full} full node{'s' if full != 1 else ''} of {per_node} + one of {rest}"


def auto_whole_nodes(total: int, per_node: int) -> tuple[bool, str]:
    """(whether `auto` considers whole nodes, why not when it does not)."""
    if total % per_node:
        return False, f"{describe_cluster(total, per_node)}: not a whole number of nodes, TP groups are packed"
    if total < 2 * per_node:
        return False, f"{describe_cluster(total, per_node)}: both sides share the node"
    return True, ""


class Packing:
    """Whether a split's TP groups fit the nodes without straddling one.

    Checking is needed only when some TP group could straddle: a partial node, or group sizes
    that do not all divide one another and the node size (then the sum alone does not decide).
    """

    def __init__(self, total: int, per_node: int, sizes: Sequence[int]):
        self.nodes = node_sizes(total, per_node)
        sizes = sorted({s for s in sizes if s <= per_node})
        chain = all(b % a == 0 for a, b in zip(sizes, sizes[1:])) and all(per_node % s == 0 for s in sizes)
        self.needed = bool(total % per_node) or not chain

    def fits(self, train_tp: int, train_groups: int, fleet: Multiset) -> bool:
        """First-fit decreasing of every TP group into the nodes (counts at a time)."""
        if not self.needed:
            return True
        groups: Counter = Counter({train_tp: train_groups})
        for tp, n in fleet:
            groups[tp] += n
        free = list(self.nodes)
        for size in sorted(groups, reverse=True):
            left = groups[size]
            for index, room in enumerate(free):
                if not left:
                    break
                take = min(left, room // size)
                free[index] -= take * size
                left -= take
            if left:
                return False
        return True


def whole_node_rule(train_gpus: int, total: int, per_node: int) -> str:
    """Why a split breaks the whole-node rule ('' when it does not); one text per cause, so that
    the search counts them."""
    if total < 2 * per_node:
        return "whole nodes asked but the cluster is less than two nodes (whole_nodes off lets the sides share one)"
    if train_gpus % per_node or (total - train_gpus) % per_node:
        return "not whole nodes (whole_nodes on: each side whole nodes; off lets the sides share a node)"
    return ""
