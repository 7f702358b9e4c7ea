"""The run record, TensorBoard and W&B sinks, the services' probes, and `libra report`'s reading
of a run (libra/telemetry, services/*/telemetry.py)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
from prometheus_client import REGISTRY

from libra.errors import ConfigError
from libra.telemetry import record as run_record
from libra.telemetry.config import TelemetryConfig
from libra.telemetry.recorder import Recorder, run_clock
from libra.telemetry.report import render, write_report
from libra.telemetry.sinks import Entry, RunRecordSink
from libra.v1 import common_pb2, planner_pb2, rollout_pb2, scheduler_pb2, trainer_pb2
from tests.telemetry_run import Clock, run_config, write_run


def tensorboard_tags(logdir: pathlib.Path) -> dict[str, tuple[str, list[tuple[int, object]]]]:
    """What TensorBoard reads from `logdir`: tag -> (plugin, [(step, value)])."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea
    from tensorboard.util import tensor_util

    accumulator = pea.EventAccumulator(str(logdir), size_guidance={pea.TENSORS: 0})
    accumulator.Reload()
    return {tag: (accumulator.SummaryMetadata(tag).plugin_data.plugin_name,
                  [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)])
            for tag in accumulator.Tags()["tensors"]}


def lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_record_goes_to_the_run_record_and_tensorboard_reads_it_back(tmp_path):
    clock = Clock()
    recorder = Recorder(tmp_path, "trainer", "r", TelemetryConfig(), clock=clock)
    for step in (1, 2):
        clock.t += 10
        recorder.write("step", step=step, scalars={"reward/mean": 0.25 * step}, histograms={"staleness": [0, 1, 1]},
                       text={"note/why": f"step **{step}**"}, policy_version=step + 1)
    recorder.close()
    rows = lines(tmp_path / "telemetry" / "trainer.jsonl")
    assert [(r["kind"], r["step"], r["scalars"]["reward/mean"], r["policy_version"]) for r in rows] == \
        [("step", 1, 0.25, 2), ("step", 2, 0.5, 3)]
    assert rows[1]["t"] - rows[0]["t"] == 10
    tags = tensorboard_tags(tmp_path / "tensorboard" / "trainer")
    assert tags["reward/mean"][0] == "scalars" and [(s, float(v)) for s, v in tags["reward/mean"][1]] == \
        [(1, 0.25), (2, 0.5)]
    assert tags["staleness"][0] == "histograms" and tags["note/why"][0] == "text"
    assert tags["note/why"][1][1][1].item() == b"step **2**"


def test_without_tensorboard_only_the_run_record_is_written(tmp_path):
    recorder = Recorder(tmp_path, "rollout", "r", TelemetryConfig(tensorboard=False))
    recorder.write("sample", scalars={"rollout/queued": 3})
    recorder.close()
    assert not (tmp_path / "tensorboard").exists()
    assert lines(tmp_path / "telemetry" / "rollout.jsonl")[0]["scalars"] == {"rollout/queued": 3}


def test_the_run_clock_is_the_first_service_s_and_steps_count_from_it(tmp_path):
    first, later = Clock(100.0), Clock(130.0)
    a = Recorder(tmp_path, "planner", "r", TelemetryConfig(tensorboard=False), clock=first)
    b = Recorder(tmp_path, "scheduler", "r", TelemetryConfig(tensorboard=False), clock=later)
    assert a.started_at == b.started_at == 100.0 == run_clock(tmp_path / "telemetry", 999.0)
    assert b.write("sample").step == 30  # a service without training steps: the run's elapsed seconds
    a.close(), b.close()


def test_a_full_disk_stops_the_sink_not_the_service(tmp_path):
    sink = RunRecordSink(pathlib.Path("/dev/full"))
    for step in range(3):
        sink.write(Entry("step", 0.0, step, {"reward/mean": 1.0}))  # ENOSPC on the first: no raise
    assert sink.broken


def test_nan_is_written_as_null_not_as_invalid_json(tmp_path):
    recorder = Recorder(tmp_path, "trainer", "r", TelemetryConfig(tensorboard=False))
    recorder.write("step", step=1, scalars={"loss/policy": float("nan")})
    recorder.close()
    assert json.loads((tmp_path / "telemetry" / "trainer.jsonl").read_text())["scalars"] == {"loss/policy": None}


def test_trainer_probe_records_per_trajectory_values_of_a_real_batch(tmp_path):
    from libra.services.trainer.batches import BatchAssembler, build_batch
    from libra.services.trainer.telemetry import BatchSummary, TrainerProbe

    assembler = BatchAssembler(max_staleness=2)
    for i, (reward, born) in enumerate([(1.0, 5), (0.0, 5), (1.0, 4), (1.0, 3)]):
        assembler.add(f"e{i}", common_pb2.Trajectory(
            trajectory_id=f"g-s{i}", group_id="g", sample_index=i, status=common_pb2.TRAJECTORY_STATUS_COMPLETED,
            prompt_length=1, token_ids=[1, 2, 3], loss_mask=[1, 0], logprobs=[-1.0, 0.0], versions=[born, 0],
            reward=reward, turns=2), samples=4)
    groups = assembler.take_ready(5, limit=1).admitted
    batch, stats = build_batch(groups, 5)
    before = REGISTRY.get_sample_value("libra_trainer_trained_trajectories_total") or 0.0
    probe = TrainerProbe(Recorder(tmp_path, "trainer", "r", TelemetryConfig(tensorboard=False)), run_config(tmp_path))
    probe.step(trainer_pb2.StepRecord(step=7, policy_version=6, mean_reward=stats.mean_reward, trajectories=4,
                                      wait_seconds=2.0, train_seconds=1.0, publish_seconds=0.5, rejected_stale=8,
                                      timestamp=1e9), BatchSummary.of(groups, batch, {"grad_norm": 0.5}, 5))
    probe.recorder.close()
    row = lines(tmp_path / "telemetry" / "trainer.jsonl")[0]
    assert row["step"] == 7 and row["policy_version"] == 6 and row["staleness_counts"] == {"0": 2, "1": 1, "2": 1}
    s = row["scalars"]
    assert s["reward/mean"] == 0.75 and s["reward/min"] == 0.0 and s["staleness/max"] == 2
    assert s["time/step_s"] == 3.5 and s["policy/grad_norm"] == 0.5 and s["staleness/rejected_trajectories"] == 8
    assert s["advantage/mean"] == pytest.approx(0.0, abs=1e-6) and s["advantage/std"] > 0
    assert REGISTRY.get_sample_value("libra_trainer_trained_trajectories_total") == before + 4
    assert REGISTRY.get_sample_value("libra_trainer_grad_norm") == 0.5


def test_rollout_probe_samples_rates_latencies_and_worker_versions(tmp_path):
    from libra.services.rollout.telemetry import RolloutProbe
    from libra.services.rollout.workers import PoolWorker

    clock = Clock()
    probe = RolloutProbe(Recorder(tmp_path, "rollout", "r", TelemetryConfig(tensorboard=False), clock=clock),
                         run_config(tmp_path), clock=clock)
    workers = [PoolWorker("short-0", "short", 1, None, None, version=3, inflight=2),
               PoolWorker("long-0", "long", 1, None, None, version=2)]
    stats = rollout_pb2.RolloutStats(completed=10, turns=20, generated_tokens=500)
    probe.sample(stats, workers)  # the baseline
    routed = REGISTRY.get_sample_value("libra_rollout_route_seconds_count") or 0.0
    for seconds in (0.1, 0.2, 0.3, 0.4):
        probe.turn("short", seconds, route_s=seconds / 10)
    probe.turn("long", 2.0)  # a turn whose wait for the scheduler was not measured
    clock.t += 2.0
    probe.sample(rollout_pb2.RolloutStats(completed=12, turns=25, generated_tokens=600), workers)  # not due yet
    clock.t += 3.0
    probe.sample(rollout_pb2.RolloutStats(completed=20, turns=30, generated_tokens=1000, queued=4), workers[:1])
    probe.recorder.close()
    [row] = lines(tmp_path / "telemetry" / "rollout.jsonl")
    s = row["scalars"]
    assert s["rollout/trajectories_per_s"] == 2.0 and s["rollout/turns_per_s"] == 2.0 and s["rollout/queued"] == 4
    assert s["turn_latency/short/p50_s"] == 0.3 and s["turn_latency/max_s"] == 2.0 and s["turns/long_per_s"] == 0.2
    assert (s["route_wait/p50_s"], s["route_wait/max_s"]) == (0.03, 0.04)
    assert REGISTRY.get_sample_value("libra_rollout_route_seconds_count") == routed + 4
    [worker] = row["workers"]
    assert worker.pop("busy_s") >= 0  # two requests in flight since it was made: seconds of this test
    assert worker == {"id": "short-0", "bucket": "short", "version": 3, "inflight": 2, "state": "starting"}
    version = "libra_rollout_worker_policy_version"
    assert REGISTRY.get_sample_value(version, {"worker": "short-0", "bucket": "short"}) == 3
    assert REGISTRY.get_sample_value(version, {"worker": "long-0", "bucket": "long"}) is None  # left the pool
    assert REGISTRY.get_sample_value("libra_rollout_turn_seconds_count", {"bucket": "long"}) >= 1


def test_scheduler_probe_records_every_move_and_samples_when_due(tmp_path):
    from libra.routing.policy import Decision, Turn
    from libra.services.scheduler.telemetry import SchedulerProbe

    clock = Clock()
    probe = SchedulerProbe(Recorder(tmp_path, "scheduler", "r", TelemetryConfig(tensorboard=False), clock=clock),
                           run_config(tmp_path), clock=clock)
    calls = []

    def stats() -> scheduler_pb2.SchedulerStats:
        calls.append(clock.t)
        return scheduler_pb2.SchedulerStats(policy="cmlfq", reasons={"new:shortest": 3, "move:work:up:long": 1},
                                            buckets=[scheduler_pb2.BucketStats(bucket="short", outstanding_requests=2)])

    for reason in ("new:shortest", "move:work:up:long", "affinity"):
        probe.routed(Turn("t1", "p", 1, 10, 10), Decision("w1", "long", "http://w1", reason), stats)
        clock.t += 1.0
    clock.t += 5.0
    probe.routed(Turn("t2", "p", 0, 10, 10), Decision("w0", "short", "http://w0", "new:shortest"), stats)
    probe.recorder.close()
    rows = lines(tmp_path / "telemetry" / "scheduler.jsonl")
    assert [r["kind"] for r in rows] == ["sample", "move", "sample"] and len(calls) == 2
    assert rows[1]["reason"] == "move:work:up:long" and rows[1]["trajectory_id"] == "t1" and rows[1]["turn"] == 1
    assert rows[0]["scalars"]["routed/move_work_up_long"] == 1 and rows[0]["buckets"]["short"]["requests"] == 2
    assert REGISTRY.get_sample_value("libra_scheduler_outstanding_requests", {"bucket": "short"}) == 2


def test_planner_probe_records_decisions_with_reasons_and_calibration(tmp_path):
    from libra.services.planner.calibration import Calibration
    from libra.services.planner.cost_rollout import RolloutEfficiency
    from libra.services.planner.cost_train import TrainEfficiency
    from libra.services.planner.hardware import gpu_named, model_named
    from libra.services.planner.telemetry import PlannerProbe

    probe = PlannerProbe(Recorder(tmp_path, "planner", "r", TelemetryConfig()), run_config(tmp_path))
    calibration = Calibration(model_named("qwen3-4b"), gpu_named("h200-141g"), RolloutEfficiency(), TrainEfficiency())
    calibration.steps.add(4.0, 5.0)
    probe.tick(calibration.snapshot())
    plan = common_pb2.Plan(generation=3, buckets=[common_pb2.BucketSpec(name="short", tp=2, max_tokens=100,
                                                                           replicas=2)])
    probe.decision(planner_pb2.PlanDecision(timestamp=1e9, chosen=plan, applied=True, trigger="queue",
                                            reason="queue 3x the capacity", predicted_gain=12.5))
    probe.recorder.close()
    tick, decision = lines(tmp_path / "telemetry" / "planner.jsonl")
    assert tick["scalars"]["planner/predicted_step_s"] == 4.0 and tick["scalars"]["planner/measured_step_s"] == 5.0
    assert decision["reason"] == "queue 3x the capacity" and decision["trigger"] == "queue" and decision["applied"]
    assert decision["generation"] == 3 and "short tp2x2" in decision["plan"] and decision["predicted_gain_s"] == 12.5
    assert tensorboard_tags(tmp_path / "tensorboard" / "planner")["plan/generation"][1][0][1] == 3
    assert REGISTRY.get_sample_value("libra_planner_plan_generation") == 3


def test_the_record_reads_back_a_restarted_step_once_and_skips_a_torn_line(tmp_path):
    config = write_run(tmp_path / "run", steps=6, tensorboard=False)
    trainer = config.run_path / "telemetry" / "trainer.jsonl"
    rows = lines(trainer)
    again = {**rows[3], "scalars": {**rows[3]["scalars"], "reward/mean": 0.123}}  # step 4 after a restart
    trainer.write_text("".join(json.dumps(r) + "\n" for r in [*rows[:4], again]) + '{"kind": "step", "t": 1')
    record = run_record.load(config.run_path)
    assert [r["step"] for r in record.steps] == [1, 2, 3, 4] and record.steps[3]["scalars"]["reward/mean"] == 0.123
    assert record.skipped == 1
    assert sum(record.staleness_counts().values()) == sum(r["scalars"]["batch/trajectories"] for r in record.steps)
    lags = record.worker_lags()
    assert set(lags) == {"short-0", "long-0"} and max(lags["long-0"][1]) >= 1 and set(lags["short-0"][1]) <= {0, 1}


def test_the_report_shows_every_chart_of_a_run_and_needs_nothing_else(tmp_path):
    config = write_run(tmp_path / "run", steps=12, tensorboard=False)
    page = write_report(config.run_path).read_text()
    charts = re.findall(r'<figure class="chart" id="([a-z-]+)"', page)
    assert charts == ["reward-step", "reward-time", "step-time", "rollout", "buckets", "planner", "staleness",
                      "worker-lag"]
    assert page.count("<svg") == len(charts) and 'class="empty"' not in page
    assert "no candidate beats the plan in force" in page and "<script" not in page
    assert not re.search(r'(src|href)="(?!#)', page), "the page must not load anything"
    assert len(set(re.findall(r'id="([^"]+)"', page))) == len(re.findall(r'id="([^"]+)"', page)), "duplicate ids"


def test_a_run_with_little_recorded_says_what_is_missing(tmp_path):
    config = run_config(tmp_path / "run")
    from libra.services.planner.telemetry import PlannerProbe

    probe = PlannerProbe(Recorder(config.run_path, "planner", "r", TelemetryConfig(tensorboard=False)), config)
    probe.decision(planner_pb2.PlanDecision(timestamp=1e9, chosen=common_pb2.Plan(generation=1), applied=True,
                                            trigger="config", reason="configured"))
    probe.recorder.close()
    page = render(run_record.load(config.run_path), {"run_id": "early", "planner": {"mode": "static"}})
    assert "<svg" not in page and "No training step was recorded yet." in page and "static mode" in page
    assert "configured" in page


def test_a_directory_without_a_run_record_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="has no run record"):
        run_record.load(tmp_path)
    with pytest.raises(ConfigError, match="is not a directory"):
        run_record.load(tmp_path / "missing")
    result = subprocess.run([sys.executable, "-m", "libra.cli", "report", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "has no run record" in result.stderr


def test_telemetry_config_errors_name_the_field(tmp_path):
    from libra.config import build_run_config

    with pytest.raises(ConfigError, match=r"telemetry\.sample_s"):
        build_run_config({"telemetry": {"sample_s": 0}}, env={})
    with pytest.raises(ConfigError, match=r"telemetry\.wandb\.project"):
        build_run_config({"telemetry": {"wandb": {"mode": "offline"}}}, env={})
    with pytest.raises(ConfigError, match=r"telemetry\.tensorbord: unknown key"):
        build_run_config({"telemetry": {"tensorbord": False}}, env={})


def test_wandb_when_configured_but_not_installed_leaves_the_other_sinks(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    config = TelemetryConfig(tensorboard=False, wandb={"project": "libra"})
    recorder = Recorder(tmp_path, "trainer", "r", config)
    assert [sink.name for sink in recorder.sinks] == ["run record"]
    recorder.close()


def test_wandb_offline_gets_the_same_scalars(tmp_path):
    wandb = pytest.importorskip("wandb", reason="wandb is optional (pip install wandb): its sink is not tested here")
    recorder = Recorder(tmp_path, "trainer", "r", TelemetryConfig(tensorboard=False, wandb={"project": "libra"}))
    recorder.write("step", step=1, scalars={"reward/mean": 0.5}, histograms={"staleness": [0, 1]})
    recorder.close()
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and wandb.__version__
