"""A lookup that goes on from its `Walk` (a live trajectory's growing path) answers exactly as one from
the root, while other trajectories grow the trees and prompt trees are evicted and learned anew."""

from __future__ import annotations

import random

import pytest

from libra.routing.prefix_tree import PrefixForest, Walk

SIGNATURES = ["run_tests:large:failure", "view_file:medium:success", "search:small:success", "edit:small:success"]


@pytest.mark.parametrize("seed", range(5))
def test_a_resumed_lookup_answers_as_one_from_the_root(seed):
    rng = random.Random(seed)
    forest = PrefixForest(min_visits=rng.choice((1, 2, 3)), window=8, max_prompt_trees=3)
    live: list[tuple[str, list[str], Walk]] = []
    compared = resumed_deeper = 0
    for _ in range(3000):
        if not live or rng.random() < 0.3:
            live.append((f"p{rng.randrange(6)}", [], Walk()))
        prompt, path, walk = live[rng.randrange(len(live))]
        if rng.random() < 0.15 or len(path) >= 8:  # it finishes: the forest learns it
            live.remove((prompt, path, walk))
            total = rng.randrange(100, 5000)
            forest.insert(prompt, path, [total] + sorted((rng.randrange(total) for _ in path), reverse=True))
            continue
        path.append(rng.choice(SIGNATURES[:2]) if rng.random() < 0.8 else rng.choice(SIGNATURES))
        want = forest.lookup(prompt, path)
        assert forest.lookup(prompt, path, walk) == want
        compared += 1
        resumed_deeper += want[2] >= 2
    assert compared > 1000 and resumed_deeper > 100  # deep paths were resumed, not only roots
