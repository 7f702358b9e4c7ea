"""The agent runner plays trajectories in token ids, masks tool tokens, retries failed workers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from libra.errors import Unavailable
from libra.services.rollout.agent import AgentRunner
from libra.services.rollout.config import RolloutConfig
from libra.tiny_model import stop_token_ids, train_tokenizer, wrap_tokenizer
from libra.v1 import common_pb2 as pb
from libra.workloads.calculator import CalculatorWorkload
from libra.workloads.config import CalculatorConfig


@dataclass
class Decision:
    worker_id: str
    bucket: str = "short"


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"


class FakeRouter:
    def __init__(self, workers):
        self.workers, self.events = workers, []

    async def route(self, trajectory_id, prompt_id, turn, prompt_tokens, max_new_tokens, exclude):
        self.events.append(("route", turn, tuple(exclude)))
        return Decision(next(w for w in self.workers if w not in exclude))

    async def turn_done(self, trajectory_id, worker_id, output_tokens, seconds, failed):
        self.events.append(("done", worker_id, failed))

    async def tool_returned(self, trajectory_id, tool, status, payload_tokens):
        self.events.append(("tool", tool, status))

    async def finished(self, *args):
        self.events.append(("finish",))


@pytest.fixture(scope="module")
def setup():
    workload = CalculatorWorkload(CalculatorConfig(num_prompts=50, max_operations=1))
    tokenizer = wrap_tokenizer(train_tokenizer(workload, 400, 0), 512)
    return workload, tokenizer


def runner_for(setup, turns: list[str], fail_first: bool = False):
    workload, tokenizer = setup
    script = iter(turns)
    calls = {"n": 0}

    async def generate(decision, ids, budget, seed):
        calls["n"] += 1
        if fail_first and calls["n"] == 1:
            raise Unavailable("worker died")
        ids_out = tokenizer(next(script), add_special_tokens=False).input_ids
        return Generation(ids_out, [-0.5] * len(ids_out))

    router = FakeRouter(["w0", "w1"])
    runner = AgentRunner(workload, tokenizer, router, generate, lambda worker: 7 if worker == "w1" else 3,
                         RolloutConfig(), stop_token_ids(tokenizer, workload), seed=0)
    return runner, router, workload, tokenizer


def test_correct_trajectory_is_token_exact_and_masks_tool_output(setup):
    workload, _ = setup
    prompt = workload.prompt(0)
    expression = prompt.meta["expression"]
    runner, router, _, tokenizer = runner_for(setup, [f"<calc>{expression}</calc>", f"<answer>{prompt.answer}</answer>"])
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g0-s0", prompt_id="0", group_id="g0")))
    assert traj.reward == 1.0 and traj.turns == 2 and traj.finish_reason == "answer"
    prompt_ids = tokenizer(prompt.text).input_ids
    assert list(traj.token_ids[:traj.prompt_length]) == prompt_ids
    text = tokenizer.decode(list(traj.token_ids[traj.prompt_length:]))
    assert text == f"<calc>{expression}</calc><result>{prompt.answer}</result><answer>{prompt.answer}</answer>"
    masked = [t for t, m in zip(traj.token_ids[traj.prompt_length:], traj.loss_mask) if m == 0]
    assert tokenizer.decode(masked) == f"<result>{prompt.answer}</result>"
    assert len(traj.logprobs) == len(traj.loss_mask) == len(traj.versions)
    assert [e.status for e in traj.tool_events] == [pb.TOOL_STATUS_SUCCESS]
    assert ("tool", "calculator", pb.TOOL_STATUS_SUCCESS) in router.events


def test_malformed_turn_gets_a_failure_result_and_wrong_answer_scores_zero(setup):
    runner, router, _, tokenizer = runner_for(setup, ["<calc>2+</calc>", "hello</answer>", "<answer>-1</answer>"])
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g1-s0", prompt_id="1", group_id="g1")))
    assert traj.reward == 0.0 and traj.turns == 3
    assert [e.status for e in traj.tool_events] == [pb.TOOL_STATUS_FAILURE, pb.TOOL_STATUS_FAILURE]
    assert "error:" in tokenizer.decode(list(traj.token_ids))


def test_failed_worker_is_excluded_and_the_turn_retried(setup):
    workload, _ = setup
    prompt = workload.prompt(2)
    runner, router, _, _ = runner_for(setup, [f"<answer>{prompt.answer}</answer>"], fail_first=True)
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g2-s0", prompt_id="2", group_id="g2")))
    assert traj.reward == 1.0
    assert router.events[:3] == [("route", 0, ()), ("done", "w0", True), ("route", 0, ("w0",))]
    assert set(traj.versions) == {7}  # tokens carry the version of the worker that produced them


def test_budget_and_turn_limit_end_the_trajectory(setup):
    runner, _, _, _ = runner_for(setup, ["<calc>1+1</calc>"] * 10)
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g3-s0", prompt_id="3", group_id="g3")))
    assert traj.finish_reason in ("max_turns", "budget") and traj.reward == 0.0
    assert traj.turns == RolloutConfig().max_turns
