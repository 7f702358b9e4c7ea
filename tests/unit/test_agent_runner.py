"""The agent runner plays trajectories in token ids, masks tool tokens, retries failed workers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from libra.errors import FailedPrecondition, Unavailable
from libra.routing.policy import NO_WORKER
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
    versions: list[int]
    finish_reason: str = "stop"
    batch: float = 0.0
    engine_batch: float = 0.0


VERSIONS = {"w0": 3, "w1": 7}  # what each fake worker holds (and acknowledged)


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


def runner_for(setup, turns: list[str], fail_first: bool = False, stamps=None):
    """A runner over fake workers w0 (v3) and w1 (v7); `stamps(worker, call, n)`: the versions the
    engine reports for a turn's n ids (default: the worker's version on every id)."""
    workload, tokenizer = setup
    script = iter(turns)
    calls = {"n": 0}

    async def generate(decision, ids, budget, seed):
        calls["n"] += 1
        if fail_first and calls["n"] == 1:
            raise Unavailable("worker died")
        ids_out = tokenizer(next(script), add_special_tokens=False).input_ids
        versions = (stamps or (lambda worker, call, n: [VERSIONS[worker]] * n))(decision.worker_id, calls["n"],
                                                                                  len(ids_out))
        return Generation(ids_out, [-0.5] * len(ids_out), versions)

    router = FakeRouter(["w0", "w1"])
    runner = AgentRunner(workload, tokenizer, router, generate, VERSIONS.__getitem__,
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


def test_a_worker_the_gateway_does_not_run_is_retried_elsewhere(setup):
    """The scheduler names a worker of an earlier gateway (unknown here): the turn goes to another
    worker, the trajectory does not fail."""
    from libra.services.rollout.config import WorkerConfig
    from libra.services.rollout.workers import WorkerPool

    workload, tokenizer = setup
    prompt = workload.prompt(3)
    pool = WorkerPool(WorkerConfig(engine={"type": "hf"}), log_dir=None)
    with pytest.raises(Unavailable, match="not one of this gateway's workers"):
        pool.version_of("stale-0")
    versions = {"w1": 7}

    def version_of(worker_id):  # the pool's rule: a worker it does not run is Unavailable
        if worker_id not in versions:
            return pool.version_of(worker_id)
        return versions[worker_id]

    async def generate(decision, ids, budget, seed):
        out = tokenizer(f"<answer>{prompt.answer}</answer>", add_special_tokens=False).input_ids
        return Generation(out, [-0.5] * len(out), [7] * len(out))

    router = FakeRouter(["stale-0", "w1"])
    runner = AgentRunner(workload, tokenizer, router, generate, version_of, RolloutConfig(),
                         stop_token_ids(tokenizer, workload), seed=0)
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g3-s0", prompt_id="3", group_id="g3")))
    assert traj.reward == 1.0 and traj.status == pb.TRAJECTORY_STATUS_COMPLETED
    assert router.events[:3] == [("route", 0, ()), ("done", "stale-0", True), ("route", 0, ("stale-0",))]


def test_budget_and_turn_limit_end_the_trajectory(setup):
    runner, _, _, _ = runner_for(setup, ["<calc>1+1</calc>"] * 10)
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g3-s0", prompt_id="3", group_id="g3")))
    assert traj.finish_reason in ("max_turns", "budget") and traj.reward == 0.0
    assert traj.turns == RolloutConfig().max_turns


def test_a_weight_update_mid_turn_splits_the_turns_versions(setup):
    """The engine reports v3 for the first two ids and v4 after (a swap while it generated): the
    trajectory keeps that per id, and the tool result after the turn carries the turn's last version."""
    workload, _ = setup
    prompt = workload.prompt(0)
    turns = [f"<calc>{prompt.meta['expression']}</calc>", f"<answer>{prompt.answer}</answer>"]
    runner, _, _, _ = runner_for(setup, turns, stamps=lambda worker, call, n: [3, 3] + [4] * (n - 2) if call == 1
                                 else [4] * n)
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g4-s0", prompt_id="0", group_id="g4")))
    first = len(runner.tokenizer(turns[0], add_special_tokens=False).input_ids)
    assert list(traj.versions[:first]) == [3, 3] + [4] * (first - 2)
    assert set(traj.versions[first:]) == {4}  # the tool result and the second turn
    assert traj.reward == 1.0


def test_a_worker_reporting_a_version_older_than_it_acknowledged_is_retried_elsewhere(setup):
    """w0 acknowledged v3 but stamps v2 (mislabelled weights): the turn fails there and runs on w1."""
    workload, _ = setup
    prompt = workload.prompt(2)
    runner, router, _, _ = runner_for(setup, [f"<answer>{prompt.answer}</answer>"] * 2,
                                      stamps=lambda worker, call, n: [2 if worker == "w0" else 7] * n)
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g5-s0", prompt_id="2", group_id="g5")))
    assert router.events[:3] == [("route", 0, ()), ("done", "w0", True), ("route", 0, ("w0",))]
    assert set(traj.versions) == {7} and traj.reward == 1.0


class RestartingRouter(FakeRouter):
    """No worker serves for the first `gaps` routes (a plan is restarting them)."""

    def __init__(self, workers, gaps: int):
        super().__init__(workers)
        self.gaps = gaps

    async def route(self, trajectory_id, prompt_id, turn, prompt_tokens, max_new_tokens, exclude):
        if self.gaps:
            self.gaps -= 1
            raise FailedPrecondition(f"{NO_WORKER} (0 registered, 0 excluded): start rollout workers first")
        return await super().route(trajectory_id, prompt_id, turn, prompt_tokens, max_new_tokens, exclude)


@pytest.mark.parametrize("wait_s", [30.0, 0.0])
def test_a_turn_waits_for_workers_a_plan_is_restarting(setup, wait_s):
    workload, _ = setup
    prompt = workload.prompt(0)
    runner, _, _, _ = runner_for(setup, [f"<answer>{prompt.answer}</answer>"])
    runner.router = router = RestartingRouter(["w0", "w1"], gaps=3)
    runner.config = RolloutConfig(no_worker_wait_s=wait_s)
    play = runner.play(pb.Trajectory(trajectory_id="g0-s0", prompt_id="0", group_id="g0"))
    if wait_s == 0:  # waiting switched off: the trajectory fails on the first refusal, as before
        with pytest.raises(FailedPrecondition, match=NO_WORKER):
            asyncio.run(play)
        assert router.gaps == 2
        return
    traj = asyncio.run(play)
    assert traj.reward == 1.0 and router.gaps == 0 and [e for e in router.events if e[0] == "route"] == [
        ("route", 0, ())]


def test_each_turn_carries_the_trajectorys_time_since_its_previous_turn_outside_tool_calls(setup):
    """The gap between turns (routing, reports) is measured per turn, the first from the moment a
    runner took the trajectory from the gateway's queue, the answer's up to the trajectory's end (its
    reward); a tool call's own seconds are not in it."""
    workload, _ = setup
    prompt = workload.prompt(0)
    runner, router, _, _ = runner_for(setup, [f"<calc>{prompt.meta['expression']}</calc>",
                                              f"<answer>{prompt.answer}</answer>"])
    plain_route, plain_tool_returned = router.route, router.tool_returned

    async def slow_route(*args):
        await asyncio.sleep(0.05)
        return await plain_route(*args)

    async def slow_report(*args):
        await asyncio.sleep(0.03)
        return await plain_tool_returned(*args)

    class Slow:  # the workload, its tool calls taking 0.6 s and its reward 0.1 s
        def __getattr__(self, name):
            return getattr(workload, name)

        def episode(self, *args, **kwargs):
            episode = workload.episode(*args, **kwargs)
            call, reward = episode.call_tool, episode.reward

            async def slow_call(action, timeout_s):
                await asyncio.sleep(0.6)
                return await call(action, timeout_s)

            async def slow_reward(answer):
                await asyncio.sleep(0.1)
                return reward(answer)
            episode.call_tool, episode.reward = slow_call, slow_reward
            return episode

    router.route, router.tool_returned, runner.workload = slow_route, slow_report, Slow()
    gaps, whose = [], []

    async def on_turn(outcome, context_tokens):
        gaps.append(outcome.gap)
        whose.append(outcome.trajectory_id)
    runner.on_turn = on_turn
    taken = time.monotonic() - 0.2  # taken 0.2 s before its play began (the gateway reads and marks it)
    traj = asyncio.run(runner.play(pb.Trajectory(trajectory_id="g0-s0", prompt_id="0", group_id="g0"), taken))
    assert traj.turns == 2 and traj.tool_events[0].seconds >= 0.6 and traj.reward == 1.0
    assert 0.25 <= gaps[0] < 0.55, gaps  # the runner's start and the first route (slack for a busy machine)
    assert 0.18 <= gaps[1] < 0.55, gaps  # the tool's report, the second route, the reward; not the 0.6 s tool call
    assert whose == ["g0-s0", "g0-s0"]  # each turn record names its trajectory


def test_the_answering_turn_is_recorded_even_when_scoring_fails(setup):
    workload, _ = setup
    prompt = workload.prompt(0)
    runner, _, _, _ = runner_for(setup, [f"<answer>{prompt.answer}</answer>"])

    class Failing:  # the workload, its reward raising (a sandbox that died)
        def __getattr__(self, name):
            return getattr(workload, name)

        def episode(self, *args, **kwargs):
            episode = workload.episode(*args, **kwargs)

            def broken(answer):
                raise RuntimeError("sandbox died")
            episode.reward = broken
            return episode

    runner.workload, recorded = Failing(), []

    async def on_turn(outcome, context_tokens):
        recorded.append(outcome)
    runner.on_turn = on_turn
    with pytest.raises(RuntimeError, match="sandbox died"):
        asyncio.run(runner.play(pb.Trajectory(trajectory_id="g0-s1", prompt_id="0", group_id="g0")))
    assert len(recorded) == 1 and recorded[0].gap > 0
