"""The causal prefix tree of C-MLFQ: what a trajectory still has to generate after a prefix of
tool outcomes.

A path from the root is a sequence of signatures (`tool:size:status`, see `signatures`). Each node
keeps how many finished trajectories went through it (visits), the running mean of the output
tokens they produced *after* that prefix, and the last `window` such observations, from which the
p90 is read. There is one tree per prompt (bounded by an LRU of `max_prompt_trees`, least recently
learned first out) and one global tree for prompts never seen. No tree grows past `max_tree_nodes`:
one that does keeps its most visited half (`Tree.pruned`; a child never has more visits than its
parent, so what is kept is a tree again), which bounds the scheduler's memory and its Redis blob
on a run of any length; the nodes dropped are the rarest paths, which seldom reach min_visits.

    finish(trajectory) ──insert──▶ prompt tree[prompt_id] ─┐
                             └──▶ global tree ─────────────┤
    tool return ──lookup(prompt_id, signatures)──▶ deepest node with >= min_visits
                                                   (prompt tree first, else global; a `Walk`
                                                   resumes a trajectory's path where it got)

Pure data structure: no clock, no Redis. `to_bytes`/`from_bytes` give the compact JSON the service
stores, so a restarted scheduler keeps what it learned.
"""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from libra.errors import InvalidArgument

FORMAT_VERSION = 2


@dataclass(frozen=True)
class NodeStats:
    """What a node predicts: visits, mean and p90 of the remaining output tokens."""

    visits: int
    mean: float
    p90: int


class Tree:
    """One prefix tree stored flat, so millions of nodes stay cheap for the garbage collector:
    node `i`'s statistics live at index `i` of parallel arrays, and the edges in one dict from
    `"{parent}/{signature}"` to the child's index (strings and ints only: the GC does not track it).
    Node 0 is the root. Each window is a ring buffer; `windows[i][visits[i] % size]` is its oldest
    entry once full.
    """

    __slots__ = ("edges", "visits", "means", "p90s", "windows")

    def __init__(self) -> None:
        self.edges: dict[str, int] = {}
        self.visits = array("q", [0])
        self.means = array("d", [0.0])
        self.p90s = array("q", [-1])  # -1: not computed since the last observation
        self.windows = [array("q")]

    def child(self, node: int, sig: str) -> int:
        """The child of `node` along `sig`, or -1."""
        return self.edges.get(f"{node}/{sig}", -1)

    def add_child(self, node: int, sig: str) -> int:
        key = f"{node}/{sig}"
        found = self.edges.get(key, -1)
        if found < 0:
            found = self.edges[key] = len(self.visits)
            self.visits.append(0)
            self.means.append(0.0)
            self.p90s.append(-1)
            self.windows.append(array("q"))
        return found

    def observe(self, node: int, remaining: int, size: int) -> None:
        window, seen = self.windows[node], self.visits[node]
        if len(window) < size:
            window.append(remaining)
        else:
            window[seen % size] = remaining
        self.visits[node] = seen + 1
        self.means[node] += (remaining - self.means[node]) / (seen + 1)
        self.p90s[node] = -1

    def stats(self, node: int) -> NodeStats:
        """Visits, mean and nearest-rank p90 of the window (the p90 cached until the next observation)."""
        if self.p90s[node] < 0:
            ordered = sorted(self.windows[node])
            rank = -(-9 * len(ordered) // 10)  # ceil(0.9 * n)
            self.p90s[node] = ordered[max(rank, 1) - 1] if ordered else 0
        return NodeStats(self.visits[node], self.means[node], self.p90s[node])

    def stats_at(self, signatures: list[str]) -> NodeStats | None:
        """Statistics of the node at exactly this path, whatever its visits, or None."""
        node = 0
        for sig in signatures:
            node = self.child(node, sig)
            if node < 0:
                return None
        return self.stats(node)

    def __len__(self) -> int:
        return len(self.visits)

    def pruned(self, keep: int) -> "Tree":
        """At most `keep` nodes: the root and the nodes visited more often than the `keep`-th most
        visited one, re-indexed (parents before children, as they were). Prefix-closed, since no
        child has more visits than its parent. The tree itself when it has no more than `keep`."""
        if len(self.visits) <= keep:
            return self
        threshold = sorted(self.visits, reverse=True)[keep - 1]
        kept = [i for i, seen in enumerate(self.visits) if i == 0 or seen > threshold]
        index = {old: new for new, old in enumerate(kept)}
        tree = Tree()
        tree.visits = array("q", (self.visits[i] for i in kept))
        tree.means = array("d", (self.means[i] for i in kept))
        tree.p90s = array("q", (self.p90s[i] for i in kept))
        tree.windows = [self.windows[i] for i in kept]
        for key, child in self.edges.items():
            if child in index:
                parent, sig = key.split("/", 1)
                tree.edges[f"{index[int(parent)]}/{sig}"] = index[child]
        return tree

    def to_plain(self) -> dict:
        windows = []
        for seen, window in zip(self.visits, self.windows):
            oldest = seen % len(window) if window else 0
            windows.append(list(window[oldest:]) + list(window[:oldest]))
        return {"edges": self.edges, "visits": list(self.visits), "means": list(self.means), "windows": windows}

    @classmethod
    def from_plain(cls, plain: dict) -> "Tree":
        tree = cls()
        tree.edges = {str(k): int(v) for k, v in plain["edges"].items()}
        tree.visits, tree.means = array("q", plain["visits"]), array("d", plain["means"])
        tree.p90s = array("q", [-1] * len(tree.visits))
        tree.windows = []
        for seen, chronological in zip(tree.visits, plain["windows"]):
            cut = len(chronological) - (seen % len(chronological) if chronological else 0)
            tree.windows.append(array("q", chronological[cut:] + chronological[:cut]))
        return tree


class Walk:
    """How far `PrefixForest.lookup` got along one growing path of signatures (a live trajectory's),
    in the global tree (side 0) and in its prompt's tree (side 1): the nodes that exist along the
    path and how many of the first of them have min_visits. A tree only gains nodes and visits, so
    the next lookup on the path goes on from there instead of from the root (the same answer)."""

    __slots__ = ("trees", "nodes", "ok")

    def __init__(self) -> None:
        self.trees: list[Tree | None] = [None, None]  # the tree each side walked
        self.nodes: list[list[int]] = [[], []]
        self.ok = [0, 0]


class PrefixForest:
    """A global prefix tree plus one tree per prompt id, LRU-bounded."""

    def __init__(self, min_visits: int = 3, window: int = 64, max_prompt_trees: int = 10_000,
                 max_tree_nodes: int = 250_000):
        if min_visits < 1 or window < 1 or max_prompt_trees < 1 or max_tree_nodes < 2:
            raise InvalidArgument(f"min_visits, window and max_prompt_trees must be >= 1 and max_tree_nodes >= 2, "
                                  f"got {min_visits}, {window}, {max_prompt_trees}, {max_tree_nodes}")
        self.min_visits, self.window, self.max_prompt_trees = min_visits, window, max_prompt_trees
        self.max_tree_nodes = max_tree_nodes
        self.global_tree = Tree()
        self.prompt_trees: OrderedDict[str, Tree] = OrderedDict()

    def insert(self, prompt_id: str, signatures: list[str], remaining_after: list[int]) -> None:
        """Learn one finished trajectory.

        `remaining_after[i]` is the output tokens produced after the i-th signature, with index 0
        the root (after nothing: the trajectory's total), so it has one more entry than
        `signatures`.
        """
        if len(remaining_after) != len(signatures) + 1:
            raise InvalidArgument(f"remaining_after needs len(signatures) + 1 = {len(signatures) + 1} "
                                  f"entries (index 0 is the total), got {len(remaining_after)}")
        if any(r < 0 for r in remaining_after):
            raise InvalidArgument(f"remaining_after must be >= 0, got {remaining_after}")
        tree = self.prompt_trees.pop(prompt_id, None) or Tree()
        while len(self.prompt_trees) >= self.max_prompt_trees:
            self.prompt_trees.popitem(last=False)
        for root in (tree, self.global_tree):
            self._walk_insert(root, signatures, remaining_after)
        self.prompt_trees[prompt_id] = self._bounded(tree)  # most recently learned goes last
        self.global_tree = self._bounded(self.global_tree)

    def _bounded(self, tree: Tree) -> Tree:
        """`tree`, or its most visited half once it has grown past max_tree_nodes (a new object:
        walks on the old one start again)."""
        return tree.pruned(max(1, self.max_tree_nodes // 2)) if len(tree) > self.max_tree_nodes else tree

    def _walk_insert(self, tree: Tree, signatures: list[str], remaining_after: list[int]) -> None:
        node = 0
        tree.observe(node, remaining_after[0], self.window)
        for sig, remaining in zip(signatures, remaining_after[1:]):
            node = tree.add_child(node, sig)
            tree.observe(node, remaining, self.window)

    def lookup(self, prompt_id: str, signatures: list[str],
               walk: Walk | None = None) -> tuple[NodeStats | None, str | None, int]:
        """The deepest node with >= min_visits: (stats, "prompt" | "global", depth) or (None, None, 0).

        The prompt's own tree wins when it matches at least as deep as the global tree; a deeper
        global match wins otherwise (a prompt root only knows that prompt's mix of lengths, while
        a global node several signatures deep knows what follows those tool outcomes). `walk`: the
        path's memo, when `signatures` only grows between lookups (a trajectory's tool returns).
        """
        if walk is None:
            g_node, g_depth = self._deepest(self.global_tree, signatures)
        else:
            g_node, g_depth = self._resume(walk, 0, self.global_tree, signatures)
        tree = self.prompt_trees.get(prompt_id)
        if tree is not None:
            node, depth = self._deepest(tree, signatures) if walk is None else \
                self._resume(walk, 1, tree, signatures)
            if node >= 0 and (g_node < 0 or depth >= g_depth):
                return tree.stats(node), "prompt", depth
        if g_node >= 0:
            return self.global_tree.stats(g_node), "global", g_depth
        return None, None, 0

    def _deepest(self, tree: Tree, signatures: list[str]) -> tuple[int, int]:
        """(node, depth) of the deepest node on the path with >= min_visits, or (-1, 0)."""
        visits, least, edges = tree.visits, self.min_visits, tree.edges
        if visits[0] < least:
            return -1, 0  # children never have more visits than their parent
        best = depth = node = 0
        for depth, sig in enumerate(signatures, start=1):
            node = edges.get(f"{node}/{sig}", -1)  # tree.child, inlined: a lookup per tool return
            if node < 0 or visits[node] < least:
                return best, depth - 1
            best = node
        return best, depth

    def _resume(self, walk: Walk, side: int, tree: Tree, signatures: list[str]) -> tuple[int, int]:
        """`_deepest`, going on from where `walk` got in `tree`."""
        nodes = walk.nodes[side]
        if walk.trees[side] is not tree or len(nodes) > len(signatures):  # (a prompt tree evicted, learned anew)
            walk.trees[side], walk.nodes[side], walk.ok[side] = tree, [], 0
            nodes = walk.nodes[side]
        visits, least = tree.visits, self.min_visits
        if visits[0] < least:
            return -1, 0
        edges, node = tree.edges, nodes[-1] if nodes else 0
        for sig in signatures[len(nodes):]:  # nodes that exist stay; one missing may appear later
            node = edges.get(f"{node}/{sig}", -1)
            if node < 0:
                break
            nodes.append(node)
        ok = walk.ok[side]
        while ok < len(nodes) and visits[nodes[ok]] >= least:  # visits only grow: the first `ok` stay
            ok += 1
        walk.ok[side] = ok
        return (nodes[ok - 1] if ok else 0), ok

    # -- persistence ---------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        plain = {"v": FORMAT_VERSION, "min_visits": self.min_visits, "window": self.window,
                 "max_prompt_trees": self.max_prompt_trees, "max_tree_nodes": self.max_tree_nodes,
                 "global": self.global_tree.to_plain(),
                 "prompts": [[pid, tree.to_plain()] for pid, tree in self.prompt_trees.items()]}
        return json.dumps(plain, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> "PrefixForest":
        plain = json.loads(blob)
        if plain.get("v") != FORMAT_VERSION:
            raise InvalidArgument(f"prefix tree blob has format {plain.get('v')!r}, expected {FORMAT_VERSION}")
        forest = cls(plain["min_visits"], plain["window"], plain["max_prompt_trees"],
                     plain.get("max_tree_nodes", 250_000))  # (blobs written before the bound)
        forest.global_tree = Tree.from_plain(plain["global"])
        for pid, tree in plain["prompts"]:
            forest.prompt_trees[pid] = Tree.from_plain(tree)
        return forest
