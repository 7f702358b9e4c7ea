"""The online planner as a real gRPC server over a real Redis, with a real elastic coordinator:
history in, calibrated decisions stored and explained, plans applied, restarts without recounting."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys

import pytest

from libra.runtime import RunningService
from libra.services.elastic.server import ElasticService
from libra.services.planner.preflight import load_trace
from libra.services.planner.server import ONLINE_BLOB, PlannerService
from libra.v1 import common_pb2, planner_pb2, planner_pb2_grpc
from tests.service.helpers import run_config, start

TRACE = load_trace("configs/traces/agentic-longtail.csv")
REPLAN = {"interval_s": 0, "queue_depth_high": 0, "active_rollouts_high": 0, "rejected_fraction_high": 0,
          "time_ratio_high": 1.5, "warmup_steps": 2, "min_history_samples": 64, "cooldown_s": 100,
          "recheck_s": 0, "batch_sequences": 64, "sim_window_steps": 3, "sim_warmup_steps": 1}


def planner_config(redis_url, run_id, tmp_path, elastic_port: int, **replan):
    return run_config(redis_url, run_id, tmp_path, addresses={"elastic": f"127.0.0.1:{elastic_port}"},
                      planner={"mode": "online", "cluster": {"gpus": 16, "tick_s": 3600},
                               "replan": {**REPLAN, **replan}})


def step_record(step: int, **kw) -> common_pb2.HistoryRecord:
    lengths = TRACE[(step * 64) % 448:(step * 64) % 448 + 64]
    fields = dict(kind="step", step=step, seconds=100.0, rollout_seconds=95.0, train_seconds=5.0, sequences=64,
                  prompt_lengths=[p for p, _ in lengths], output_lengths=[o for _, o in lengths])
    return common_pb2.HistoryRecord(**{**fields, **kw})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def explain(arun, chan, limit=50) -> planner_pb2.ExplainResponse:
    return arun(planner_pb2_grpc.PlannerStub(chan).Explain(planner_pb2.ExplainRequest(limit=limit)))


@pytest.mark.parametrize("workers", [1, 2])  # replays in the planner's process, or side by side in 2 workers
def test_online_planner_calibrates_decides_applies_and_resumes(redis_url, run_id, tmp_path, arun, store, workers):
    elastic, _ = arun(start(ElasticService(run_config(redis_url, run_id, tmp_path))))
    config = planner_config(redis_url, run_id, tmp_path, elastic.port, sim_workers=workers)
    service, clock = PlannerService(config), Clock()
    service.clock = clock
    running, chan = arun(start(service))
    assert arun(service.tick()) is None  # no history: no trigger, nothing stored
    for step in range(1, 4):
        arun(store.append_history("step", step_record(step)))
    arun(store.append_history("step", step_record(4, seconds=-5.0)))  # bad: ignored with a reason
    arun(store.append_history("turn", common_pb2.HistoryRecord(kind="turn", bucket="short", prompt_tokens=10,
                                                               output_tokens=10, seconds=math.nan)))
    arun(store.append_history("turn", common_pb2.HistoryRecord(kind="turn", bucket="short", prompt_tokens=10,
                                                               output_tokens=10, seconds=0.5, gap_seconds=0.2)))
    decision = arun(service.tick())
    assert decision.trigger == "ratio" and decision.applied, decision.reason
    assert decision.chosen.generation == 2 and decision.chosen.source == "replan"
    assert decision.inputs["rollout_train_ratio"] > 1.5 and decision.trace_sequences == 64
    plan = arun(store.get_plan())
    assert plan.generation == 2 and plan.source == "replan" and plan.reason == decision.reason[:400]
    assert arun(store.recall_result("ElasticCoordinator.ApplyPlan", "planner-apply-gen2")) is not None  # it got there
    blob = json.loads(arun(store.load_blob(ONLINE_BLOB)))
    assert "pending_apply" not in blob and blob["read"] == {"turn": 2, "step": 4}

    # Explain: the config decision, then the replan, with reasons and the calibration
    reply = explain(arun, chan)
    assert [(d.trigger, d.applied) for d in reply.decisions] == [("config", True), ("ratio", True)]
    assert reply.mode == "online" and reply.plan.generation == 2
    rejected = dict(reply.calibration.rejected)
    assert rejected["step: time_s is negative"] == 1 and rejected["turn: seconds is not a finite number"] == 1
    assert reply.calibration.steps_read == 4 and reply.calibration.turns_read == 2
    names = {e.name: e for e in reply.calibration.efficiencies}
    assert set(names) == {"prefill_mfu", "decode_bw", "step_overhead_s", "step_per_seq_s", "request_s", "turn_gap_s",
                          "train_mfu", "train_overhead_s", "rollout_pipeline"}
    assert names["turn_gap_s"].calibrated == pytest.approx(0.2) and names["turn_gap_s"].samples == 1

    # pressure persists: the cooldown gates it, once (a repeat is not stored again)
    for step in range(5, 7):
        arun(store.append_history("step", step_record(step)))
    clock.now += 10
    gated = arun(service.tick())
    assert gated is not None and not gated.applied and "cooldown" in gated.reason
    clock.now += 10
    arun(store.append_history("step", step_record(7)))
    assert arun(service.tick()) is None
    assert len(explain(arun, chan).decisions) == 3
    # after the cooldown the plan in force is evaluated against the best and (calibrated) kept
    clock.now += 200
    arun(store.append_history("step", step_record(8)))
    kept = arun(service.tick())
    assert kept is not None and not kept.applied and kept.reason.startswith("not applied"), kept.reason
    assert "simulated on the last" in kept.reason  # the replay of the recent batches judged it
    assert kept.HasField("current") and kept.predicted_current_seconds > 0
    reply = explain(arun, chan)
    step_time = [t for t in reply.calibration.times if t.what == "step"][0]
    assert step_time.samples >= 4 and step_time.measured_seconds == 100.0 and step_time.predicted_seconds > 0
    pool = service.replanner.ranker.pool
    assert pool.workers == workers and (pool.worker_cpu_s > 0) == (workers > 1)  # the replays ran where asked
    arun(running.stop())
    assert pool._executor is None  # a stopped planner leaves no replay workers behind

    # a restarted planner continues from the cursor: nothing is read twice
    service = PlannerService(config)
    service.clock = clock
    running, chan = arun(start(service))
    arun(service.tick())
    assert explain(arun, chan).calibration.steps_read == 8
    arun(store.append_history("step", step_record(9)))
    arun(service.tick())
    reply = explain(arun, chan)
    assert reply.calibration.steps_read == 9 and service.replanner.steps_observed == 8  # step 4 was bad
    arun(running.stop())
    arun(elastic.stop())


def test_apply_survives_an_unavailable_coordinator(redis_url, run_id, tmp_path, arun, store):
    port = free_port()  # nothing listens here yet
    config = planner_config(redis_url, run_id, tmp_path, port)
    service = PlannerService(config)
    running, chan = arun(start(service))
    for step in range(1, 4):
        arun(store.append_history("step", step_record(step)))
    decision = arun(service.tick())
    assert decision.applied and arun(store.get_plan()).generation == 2  # decided and stored regardless
    assert json.loads(arun(store.load_blob(ONLINE_BLOB)))["pending_apply"] == 2
    assert arun(store.recall_result("ElasticCoordinator.ApplyPlan", "planner-apply-gen2")) is None
    elastic = arun(RunningService(ElasticService(run_config(redis_url, run_id, tmp_path)), port,
                                  host="127.0.0.1").start())
    arun(service.tick())  # the pending plan goes out now (the signal persists: a cooldown decision too)
    assert "pending_apply" not in json.loads(arun(store.load_blob(ONLINE_BLOB)))
    assert arun(store.recall_result("ElasticCoordinator.ApplyPlan", "planner-apply-gen2")) is not None
    decisions = explain(arun, chan).decisions
    assert [d.applied for d in decisions] == [True, True, False] and "cooldown" in decisions[2].reason
    assert arun(store.get_plan()).generation == 2
    arun(running.stop())
    arun(elastic.stop())


def test_observe_history_feeds_the_same_path(redis_url, run_id, tmp_path, arun, store):
    config = planner_config(redis_url, run_id, tmp_path, free_port(), time_ratio_high=0)
    service = PlannerService(config)
    running, chan = arun(start(service))
    stub = planner_pb2_grpc.PlannerStub(chan)
    records = [step_record(1), step_record(2, train_seconds=math.inf)]
    meta = common_pb2.RequestMeta(request_id="obs-1", run_id=run_id)
    assert arun(stub.ObserveHistory(planner_pb2.ObserveHistoryRequest(meta=meta, records=records))).applied
    arun(service.tick())
    reply = explain(arun, chan)
    assert reply.calibration.steps_read == 2 and reply.calibration.rejected["step: train_s is not a finite number"] == 1
    assert service.replanner.steps_observed == 1

    async def cli(*extra: str) -> str:  # `libra plan explain` as a process, against this planner
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "libra.cli", "plan", "explain", "--run-id", run_id,
            "--set", f"addresses.planner=127.0.0.1:{running.port}", "--set", "security.auth=none", *extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        return out.decode()
    text = arun(cli())
    assert "mode: online" in text and "trigger=config APPLIED" in text and "(0 turns, 2 steps read)" in text
    assert "ignored: step: train_s is not a finite number x1" in text
    assert json.loads(arun(cli("--json")))["calibration"]["stepsRead"] == "2"
    arun(running.stop())
