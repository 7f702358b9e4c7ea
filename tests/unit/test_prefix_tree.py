"""Tool-outcome signatures and the causal prefix tree as pure data structures."""

from __future__ import annotations

import pytest

from libra.routing.prefix_tree import PrefixForest
from libra.routing.signatures import SizeThresholds, signature, size_class

SEARCH_OK = "search:small:success"
RUN_FAIL = "run:large:failure"


def test_size_classes_use_both_thresholds():
    limits = SizeThresholds(small_max_tokens=10, medium_max_tokens=100)
    assert [size_class(n, limits) for n in (0, 10, 11, 100, 101)] == ["small", "small", "medium", "medium", "large"]
    assert signature("search", "success", 5, limits) == SEARCH_OK
    assert signature("run", "timeout", 500, limits) == "run:large:timeout"
    assert signature("mcp:fetch", "failure", 50, limits) == "mcp_fetch:medium:failure"


def test_bad_status_and_bad_thresholds_say_what_to_fix():
    with pytest.raises(ValueError, match="success, failure, timeout"):
        signature("search", "error", 5, SizeThresholds())
    with pytest.raises(ValueError, match="greater than"):
        SizeThresholds(small_max_tokens=100, medium_max_tokens=100)
    with pytest.raises(ValueError, match="payload_tokens"):
        size_class(-1, SizeThresholds())


def test_lookup_returns_deepest_node_with_enough_visits():
    forest = PrefixForest(min_visits=2)
    forest.insert("p", [SEARCH_OK, RUN_FAIL], [300, 200, 50])
    stats, source, depth = forest.lookup("p", [SEARCH_OK, RUN_FAIL])
    assert stats is None and source is None and depth == 0  # one visit is not enough
    forest.insert("p", [SEARCH_OK], [100, 40])
    stats, source, depth = forest.lookup("p", [SEARCH_OK, RUN_FAIL])
    assert (source, depth, stats.visits, stats.mean) == ("prompt", 1, 2, 120.0)
    stats, _, depth = forest.lookup("p", [])
    assert depth == 0 and stats.mean == 200.0


def test_unknown_prompt_falls_back_to_global_tree():
    forest = PrefixForest(min_visits=1)
    forest.insert("a", [SEARCH_OK], [10, 4])
    forest.insert("b", [SEARCH_OK], [20, 8])
    stats, source, depth = forest.lookup("never-seen", [SEARCH_OK])
    assert (source, depth, stats.visits, stats.mean) == ("global", 1, 2, 6.0)
    _, source, _ = forest.lookup("a", [SEARCH_OK])
    assert source == "prompt"


def test_p90_reads_only_the_window():
    forest = PrefixForest(min_visits=1, window=10)
    for remaining in range(1, 11):
        forest.insert("p", [], [remaining])
    assert forest.lookup("p", [])[0].p90 == 9
    for _ in range(10):
        forest.insert("p", [], [1000])
    stats = forest.lookup("p", [])[0]
    assert stats.p90 == 1000 and stats.visits == 20  # the mean keeps all history, the p90 the window


def test_prompt_trees_are_lru_bounded():
    forest = PrefixForest(min_visits=1, max_prompt_trees=2)
    forest.insert("a", [], [1])
    forest.insert("b", [], [2])
    forest.insert("a", [], [1])  # relearned: most recent
    forest.insert("c", [], [3])
    assert list(forest.prompt_trees) == ["a", "c"]
    assert forest.lookup("b", [])[1] == "global"
    assert forest.global_tree.stats_at([]).visits == 4


def test_insert_checks_lengths():
    forest = PrefixForest()
    with pytest.raises(ValueError, match="len\\(signatures\\) \\+ 1"):
        forest.insert("p", [SEARCH_OK], [5])
    with pytest.raises(ValueError, match=">= 0"):
        forest.insert("p", [SEARCH_OK], [5, -1])


def test_serialisation_round_trip():
    forest = PrefixForest(min_visits=1, window=4, max_prompt_trees=3)
    forest.insert("a", [SEARCH_OK, RUN_FAIL], [300, 200, 7])
    forest.insert("b", [RUN_FAIL], [90, 1])
    for remaining in (5, 6, 7, 8, 9):
        forest.insert("a", [SEARCH_OK], [remaining * 10, remaining])
    blob = forest.to_bytes()
    restored = PrefixForest.from_bytes(blob)
    assert restored.to_bytes() == blob
    assert list(restored.prompt_trees) == ["b", "a"]
    for prompt, path in (("a", [SEARCH_OK, RUN_FAIL]), ("a", [SEARCH_OK]), ("z", [RUN_FAIL]), ("b", [])):
        assert restored.lookup(prompt, path) == forest.lookup(prompt, path)
    for learner in (forest, restored):  # the ring buffers carry on from the same oldest entry
        learner.insert("a", [SEARCH_OK], [1, 1])
    assert restored.to_bytes() == forest.to_bytes()
    with pytest.raises(ValueError, match="format"):
        PrefixForest.from_bytes(b'{"v": 99}')


def test_a_deeper_global_match_beats_a_shallow_prompt_match():
    forest = PrefixForest(min_visits=1, window=8, max_prompt_trees=10)
    forest.insert("p", ["calc:small:success"], [100, 10])          # the prompt tree knows only its mix
    forest.insert("q", ["search:large:success"], [9000, 8000])     # the global tree knows what search predicts
    stats, source, depth = forest.lookup("p", ["search:large:success"])
    assert source == "global" and depth == 1 and stats.mean == 8000
    stats, source, depth = forest.lookup("p", ["calc:small:success"])
    assert source == "prompt" and depth == 1  # equal depth: the prompt's own tree is more specific


def _paths(tree) -> dict[tuple[str, ...], int]:
    """Every node of `tree` by its path of signatures."""
    children: dict[int, list[tuple[str, int]]] = {}
    for key, child in tree.edges.items():
        parent, sig = key.split("/", 1)
        children.setdefault(int(parent), []).append((sig, child))
    out, todo = {(): 0}, [((), 0)]
    while todo:
        path, node = todo.pop()
        for sig, child in children.get(node, []):
            out[path + (sig,)] = child
            todo.append((path + (sig,), child))
    return out


def test_a_pruned_tree_keeps_the_most_visited_nodes_with_their_statistics():
    import random

    rng = random.Random(4)
    forest = PrefixForest(min_visits=1, window=4, max_tree_nodes=10**6)
    alphabet = [SEARCH_OK, RUN_FAIL, "run:small:success", "search:large:timeout"]
    for _ in range(400):
        path = [rng.choice(alphabet) for _ in range(rng.randint(0, 6))]
        forest.insert("p", path, [10 * (len(path) - k) + rng.randint(0, 5) for k in range(len(path) + 1)])
    tree = forest.global_tree
    before = _paths(tree)
    pruned = tree.pruned(40)
    after = _paths(pruned)
    assert len(pruned) == len(after) <= 40 < len(tree)  # every kept node reachable: a tree again
    assert set(after) <= set(before)
    least_kept = min(pruned.visits)
    assert all(tree.visits[node] <= least_kept or path in after for path, node in before.items())  # most visited
    for path, node in after.items():
        assert pruned.stats(node) == tree.stats(before[path])
    assert tree.pruned(len(tree)) is tree


def test_the_forest_never_grows_a_tree_past_its_bound_and_keeps_what_it_learned_most():
    """A long run of ever-new tool-outcome paths: the global tree stays within max_tree_nodes; the
    common prefix every trajectory shares keeps its statistics; the bound survives a restart."""
    forest = PrefixForest(min_visits=1, window=8, max_tree_nodes=64)
    for i in range(2000):
        path = [SEARCH_OK, RUN_FAIL, f"tool{i}:small:success"]  # a new last outcome every time
        forest.insert(f"p{i % 7}", path, [30, 20, 10, 0])
        assert len(forest.global_tree) <= 64 and all(len(t) <= 64 for t in forest.prompt_trees.values())
    stats, source, depth = forest.lookup("never-seen", [SEARCH_OK, RUN_FAIL, "tool5:small:success"])
    assert (source, depth, stats.visits, stats.mean) == ("global", 2, 2000, 10.0)
    restored = PrefixForest.from_bytes(forest.to_bytes())
    assert restored.max_tree_nodes == 64 and len(restored.global_tree) == len(forest.global_tree)
    with pytest.raises(ValueError, match="max_tree_nodes >= 2"):
        PrefixForest(max_tree_nodes=1)


def test_the_bound_comes_from_the_scheduler_config():
    from libra.routing.config import RoutingConfig
    from libra.routing.registry import make_policy

    config = RoutingConfig.model_validate({"policy": {"type": "cmlfq", "max_tree_nodes": 100}})
    policy = make_policy(config, [("short", 100), ("long", 1000)])
    assert policy.forest.max_tree_nodes == 100
