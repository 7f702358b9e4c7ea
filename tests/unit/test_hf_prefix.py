"""The hf engine's prefix cache (engines/hf_prefix.py): the longest cached beginning of a prompt is
found and reused, capacity and weight changes empty it, and an engine that reuses a prefix samples
what an engine without the cache samples (same ids, log-probs within float noise), on both forward
passes, for an agent's next turn and for a group's shared prompt (computed once in a prefill,
with or without the cache)."""

from __future__ import annotations

import threading

import pytest
import torch

from libra.services.rollout.engines.hf_engine import HFEngine, Request
from libra.services.rollout.engines.hf_prefix import PrefixCache

from tests.fixtures_model import make_random_llama


def _kv(length: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, length, 4), fill), torch.full((2, length, 4), -fill)) for _ in range(3)]


def test_the_longest_cached_beginning_is_found_and_one_position_is_always_left():
    cache = PrefixCache(capacity_tokens=100)
    cache.insert([1, 2, 3], _kv(3, 1.0))
    cache.insert([1, 2, 3, 4, 5], _kv(5, 2.0))
    n, kv = cache.lookup([1, 2, 3, 4, 5, 6, 7])
    assert n == 5 and float(kv[0][0][0, 0, 0]) == 2.0
    n, kv = cache.lookup([1, 2, 3, 9])  # the longer entry does not begin it
    assert n == 3 and float(kv[2][1][0, 0, 0]) == -1.0
    n, kv = cache.lookup([1, 2, 3])  # the whole prompt cached: its last position is still computed
    assert n == 2 and kv[0][0].shape == (2, 2, 4)
    assert cache.lookup([7, 1, 2, 3]) == (0, None) and cache.lookup([1]) == (0, None)
    assert (cache.lookups, cache.hits, cache.hit_tokens) == (5, 3, 10)


def test_capacity_evicts_the_least_recently_used_and_clear_empties_it():
    cache = PrefixCache(capacity_tokens=10)
    cache.insert([1, 2, 3, 4], _kv(4, 1.0))
    cache.insert([5, 6, 7, 8], _kv(4, 2.0))
    assert cache.lookup([1, 2, 3, 4, 0])[0] == 4  # used: now the most recent
    cache.insert([9, 9, 9], _kv(3, 3.0))  # 11 tokens > 10: the least recently used goes
    assert cache.lookup([5, 6, 7, 8, 0]) == (0, None) and cache.lookup([1, 2, 3, 4, 0])[0] == 4
    cache.insert(list(range(11)), _kv(11, 4.0))  # larger than the whole cache: not kept
    assert cache.tokens == 7 and len(cache) == 2
    cache.clear()
    assert cache.tokens == 0 and cache.lookup([1, 2, 3, 4, 0]) == (0, None)
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCache(-1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_random_llama(tmp_path_factory.mktemp("prefix") / "model", seed=3))


def _engine(model_dir: str, forward: str, mib: float) -> HFEngine:
    engine = HFEngine(model_dir, max_model_len=256, forward=forward, prefix_cache_mib=mib)
    engine.eos_id = -1  # a random model may say EOS at any step: only max_tokens ends a row here
    return engine


def _generate(engine: HFEngine, prompts: list[list[int]], max_tokens: int) -> list[Request]:
    """Greedy completions of `prompts`, submitted while the engine is paused so one prefill takes them all."""
    done = threading.Semaphore(0)
    requests = [Request(list(p), max_tokens, 0.0, 1.0, frozenset(), None, lambda r: done.release()) for p in prompts]
    engine.pause(True)
    for request in requests:
        engine.submit(request)
    engine.pause(False)
    for _ in requests:
        assert done.acquire(timeout=60)
    assert all(r.error is None for r in requests)
    return requests


@pytest.mark.parametrize("forward", ["auto", "transformers"])
def test_a_next_turn_and_a_shared_prompt_sample_what_they_would_without_the_cache(model_dir, forward):
    cached, plain = _engine(model_dir, forward, 16), _engine(model_dir, forward, 0)
    try:
        prompt, tool = [5, 17, 9, 33, 2, 41], [7, 7, 12]
        firsts = [_generate(e, [prompt, prompt, prompt, [8, 8, 1]], 6) for e in (cached, plain)]
        assert cached.prefill_tokens == plain.prefill_tokens == len(prompt) + 3  # the group's prompt computed once
        nexts, computed = [], []
        for engine, first in zip((cached, plain), firsts):
            fresh = [9, 4, 4, 2, 8, 31, 5, 5, 40, 1]  # in the same prefill: a prompt the cache knows nothing of
            turns = [r.prompt + r.generated + tool for r in (first[0], first[3])] + [fresh]  # two agents' next turns
            before = engine.prefill_tokens
            nexts.append(_generate(engine, turns, 6))
            computed.append(engine.prefill_tokens - before)
        assert computed == [2 * (1 + len(tool)) + len(fresh), sum(map(len, turns))]  # the reply's last id, the tool's
        for a, b in zip(firsts[0] + nexts[0], firsts[1] + nexts[1]):
            assert a.generated == b.generated
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert cached.prefix.hits == 2 and plain.prefix.hits == 0  # the two next turns
        assert cached.prefix.hit_tokens == sum(len(t) - 1 - len(tool) for t in turns[:2])
        member = _generate(cached, [prompt], 6)[0]  # a group member arriving later: the prompt's entry
        assert cached.prefix.hits == 3 and member.generated == firsts[0][0].generated
        alone = _generate(plain, [prompt], 6)[0]  # what a group member gets when its prompt is no one else's
        assert all(r.generated == alone.generated and r.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
                   for r in firsts[1][:3])
        swapped = threading.Event()
        cached.control(cached.refresh_kv, lambda result, error: swapped.set())  # what a weight load runs
        assert swapped.wait(30)
        assert cached.prefix.tokens == 0 and len(cached.prefix) == 0
    finally:
        cached.stop()
        plain.stop()


@pytest.mark.parametrize("forward", ["auto", "transformers"])
def test_rows_finishing_at_different_steps_and_a_later_wave_sample_what_each_samples_alone(model_dir, forward):
    """Rows leave the batch at the step they finish while others decode, and a later wave is merged
    into the running batch: every request gets exactly the ids and log-probs it gets alone, nothing
    is sampled for it after its answer, and the batch is empty at the end."""
    torch.manual_seed(0)
    prompts = [torch.randint(3, 200, (n,)).tolist() for n in (5, 9, 7, 12, 6, 10, 8, 11)]
    lengths = [2, 9, 4, 12, 3, 7, 5, 10]
    engine = _engine(model_dir, forward, 0)
    done, answered = threading.Semaphore(0), []
    requests = [Request(list(p), n, 0.0, 1.0, frozenset(), None,
                        lambda r: (answered.append((r, len(r.generated))), done.release()))
                for p, n in zip(prompts[:6], lengths[:6])]
    engine.pause(True)
    for request in requests:
        engine.submit(request)
    engine.pause(False)
    for _ in range(2):  # the two shortest are answered while the others decode: a wave joins them
        assert done.acquire(timeout=60)
    later = [Request(list(p), n, 0.0, 1.0, frozenset(), None,
                     lambda r: (answered.append((r, len(r.generated))), done.release()))
             for p, n in zip(prompts[6:], lengths[6:])]
    for request in later:
        engine.submit(request)
    for _ in range(len(requests) + len(later) - 2):
        assert done.acquire(timeout=60)
    engine.stop()
    assert all(length == len(request.generated) == request.max_tokens for request, length in answered)  # none after
    assert engine.running == 0 and not engine._rows
    for request in requests + later:
        solo = _engine(model_dir, forward, 0)
        alone = _generate(solo, [request.prompt], request.max_tokens)[0]
        solo.stop()
        assert request.generated == alone.generated
        assert request.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
