"""What benchmarks/sim_vs_real.py measures besides its figures: the simulator's engines, timed (each
turn's latency and mean batch, each trajectory's turn seconds), and the diagnostics that say where
a miss comes from: seconds per token by batch, the turn model alone at the measured batches, and a
trajectory's time split into turns, gaps and tools, simulated against measured.
"""

from __future__ import annotations

import bisect
import math
import statistics

from kept_runs import Loaded, percentile
from libra.services.planner import cost_rollout
from libra.services.planner.calibration import Calibration
from libra.services.planner.gaps import GapSampler
from libra.services.planner.hardware import GpuSpec, ModelSpec
from libra.services.planner.prefills import Prefills
from libra.services.planner.sim.engines import CostModelEngines
from libra.traces import files

# One core of this machine as the cost model's "device": nominal figures (fp32 on a 2-core VM);
# the calibration corrects the efficiencies that scale them. Training's calibrated MFU is capped at
# 1, so the nominal FLOP rate must leave it room: a trainer that leaves out its sequences of
# advantage 0 (trainer.skip_zero_advantage) steps in less time than the cost model's FLOPs over
# every sequence of the batch take at 0.05 TFLOPS (round 9's synchronous runs: 0.08 s against 0.20
# at MFU 1), and a calibration pinned at the cap then charges such a step 2.4x what it took.
CPU_CORE = GpuSpec(name="cpu-core", source="nominal: one core of the dev machine, fp32", memory_gib=8.0,
                   hbm_gbps=10.0, bf16_tflops=0.2, nvlink_gbps=0.0, internode_gbps=10.0, gpus_per_node=2)


class Timed:
    """An engine that remembers when each turn arrived, how long it took to its last token, and the
    mean number of sequences the engine ran meanwhile (the batch a real turn record carries)."""

    def __init__(self, inner, latencies: list[float], batches: list[float],
                 by_trajectory: dict[str, float] | None = None):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_by_trajectory", {} if by_trajectory is None else by_trajectory)
        object.__setattr__(self, "_arrived", {})
        object.__setattr__(self, "_latencies", latencies)
        object.__setattr__(self, "_batches", batches)
        object.__setattr__(self, "_area", 0.0)  # integral of running sequences over time
        object.__setattr__(self, "held", [])  # (arrival, reply back) of each turn: a request in flight

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)

    def advance(self, now: float) -> None:
        inner = self._inner
        running = inner.seqs if hasattr(inner, "seqs") else len(inner.running)  # cost-model or simple instance
        object.__setattr__(self, "_area", self._area + running * max(0.0, now - inner.last))
        self._inner.advance(now)

    def enqueue(self, unit) -> None:
        self._arrived[id(unit)] = (self._inner.last, self._area)  # the simulator advanced the engine to now
        self._inner.enqueue(unit)

    def complete(self):
        unit = self._inner.complete()
        arrived = self._arrived.pop(id(unit), None)
        if arrived is not None:
            span = self._inner.last - arrived[0]
            latency = span + self._inner.request_s * unit.reply  # + the way back, as the rollout loop charges it
            self._latencies.append(latency)
            self.held.append((arrived[0], arrived[0] + latency))
            tid = unit.spec.trajectory_id
            self._by_trajectory[tid] = self._by_trajectory.get(tid, 0.0) + latency
            if span > 0:
                self._batches.append((self._area - arrived[1]) / span)
        return unit

    def evict(self):
        units = self._inner.evict()
        for unit in units:
            self._arrived.pop(id(unit), None)
        return units


def in_flight_share(intervals: list[tuple[float, float]], span: float, start: float = 0.0) -> float:
    """The share of [start, span] covered by the intervals: the time a worker had a request in flight,
    as the gateway counts it (sent to reply received) and the measured busy fraction samples it."""
    return sum(busy_periods(intervals, start, span)) / (span - start) if span > start else 0.0


def busy_periods(intervals: list[tuple[float, float]], start: float, end: float) -> list[float]:
    """A worker's busy periods within [start, end] (the stretches with a request in flight, the
    intervals merged where they overlap or touch), each one's seconds: how often it went idle, and
    for how long it stayed busy in between."""
    periods: list[float] = []
    low = high = None
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= a:
            continue
        if high is None or a > high:
            if high is not None:
                periods.append(high - low)
            low, high = a, b
        else:
            high = max(high, b)
    if high is not None:
        periods.append(high - low)
    return periods


def period_summary(periods: list[float], steps: int) -> list[float]:
    """[busy periods per training step, their median in ms]."""
    return [round(len(periods) / max(1, steps), 2), round(statistics.median(periods) * 1e3, 1) if periods else 0.0]


class TimedEngines:
    """Timed engines, named into the run's own buckets in the order the simulator creates them."""

    def __init__(self, inner: CostModelEngines, buckets: list[str] | None = None):
        self.inner, self.latencies, self.batches, self.engines, self.buckets = inner, [], [], [], buckets
        self.by_trajectory: dict[str, float] = {}  # trajectory id -> its turns' seconds, route to reply

    def holds(self, tp: int) -> bool:
        return self.inner.holds(tp)

    def max_context_tokens(self) -> float:
        return self.inner.max_context_tokens()

    def instance(self, wid: str, bucket: str, tp: int, replicas: int, up_at: float):
        if self.buckets and len(self.engines) < len(self.buckets):
            bucket = self.buckets[len(self.engines)]
        engine = Timed(self.inner.instance(wid, bucket, tp, replicas, up_at), self.latencies, self.batches,
                       self.by_trajectory)
        self.engines.append(engine)
        return engine


BATCHES = ((1, 4), (5, 16), (17, 64))


def trajectory_time(run: Loaded, specs: list, simulated: dict[str, float], gaps: GapSampler | None) -> dict:
    """Where a trajectory's time went, simulated against measured, over the trajectories both name
    (turn records carry their trajectory since HistoryRecord field 20; {} for runs before it): its
    model turns (route to reply), the gaps before them, its tool calls (the trace's, on both sides),
    and the whole (their sum: mean, p90 and, like each part, the standard deviation over the
    trajectories), each [simulated, measured], in seconds; and the measured mean gap before a
    trajectory's first turn (its queue and first route) and before its later ones."""
    measured: dict[str, list[float]] = {}
    firsts: dict[str, tuple[float, float]] = {}  # trajectory -> (its first turn's start, that turn's gap)
    for turn in run.turns:
        if turn.get("trajectory_id"):
            start = turn["timestamp"] - turn["seconds"]
            if turn["trajectory_id"] not in firsts or start < firsts[turn["trajectory_id"]][0]:
                firsts[turn["trajectory_id"]] = (start, turn.get("gap_seconds", 0.0))
            row = measured.setdefault(turn["trajectory_id"], [0.0, 0.0, 0.0])
            row[0] += 1
            row[1] += turn["seconds"]
            row[2] += turn.get("gap_seconds", 0.0)
    tools = {spec.trajectory_id: sum(t.latency_s for t in spec.turns) for spec in specs}
    played: dict[str, tuple[int, float, str]] = {}  # the run's id -> (batch, seconds, id) of its first copy played
    for sim_id, seconds in simulated.items():
        copy = files.copy_of(sim_id)
        if copy and (copy[1] not in played or copy[0] < played[copy[1]][0]):
            played[copy[1]] = (copy[0], seconds, sim_id)
    ids = [tid for tid in measured if tid in played and tid in tools]
    if not ids:
        return {}
    sim_turns, real_turns = [played[t][1] for t in ids], [measured[t][1] for t in ids]
    sim_gaps = [sum(gaps.draw(played[t][2], k) for k in range(int(measured[t][0]))) if gaps else 0.0 for t in ids]
    real_gaps = [measured[t][2] for t in ids]
    sim_whole = [turns + gaps + tools[t] for turns, gaps, t in zip(sim_turns, sim_gaps, ids)]
    real_whole = [turns + gaps + tools[t] for turns, gaps, t in zip(real_turns, real_gaps, ids)]

    def pair(sim: list[float], real: list[float]) -> list[float]:
        return [round(statistics.fmean(sim), 4), round(statistics.fmean(real), 4)]

    def spread(sim: list[float], real: list[float]) -> list[float]:
        return [round(statistics.pstdev(sim), 4), round(statistics.pstdev(real), 4)]
    return {"trajectories": len(ids), "turns_s": pair(sim_turns, real_turns), "gaps_s": pair(sim_gaps, real_gaps),
            "tools_s": round(statistics.fmean(tools[t] for t in ids), 4), "whole_s": pair(sim_whole, real_whole),
            "whole_p90_s": [round(percentile(sim_whole, 90), 4), round(percentile(real_whole, 90), 4)],
            "sd_s": {"turns": spread(sim_turns, real_turns), "gaps": spread(sim_gaps, real_gaps),
                     "whole": spread(sim_whole, real_whole)},
            "measured_gap_s": {"first_turn": round(statistics.fmean(firsts[t][1] for t in ids), 4),
                               "later_turns": round(sum(measured[t][2] - firsts[t][1] for t in ids)
                                                    / max(1.0, sum(measured[t][0] - 1 for t in ids)), 4),
                               **gap_percentiles(run)}}


def gap_percentiles(run: Loaded) -> dict[str, list[float]]:
    """The measured gaps' p50 and p99, [first turns, later turns] (the place of a turn, turn_number)."""
    first = [t["gap_seconds"] for t in run.turns if t.get("turn_number") == 1 and t.get("gap_seconds")]
    later = [t["gap_seconds"] for t in run.turns if t.get("turn_number", 0) > 1 and t.get("gap_seconds")]
    if len(first) < 2 or len(later) < 2:
        return {}
    return {f"p{q}": [round(percentile(first, q), 4), round(percentile(later, q), 4)] for q in (50, 99)}


def fitted_turns(run: Loaded, cal: Calibration, model: ModelSpec, engine_batch: bool = True) -> list[float]:
    """Each measured turn's seconds as the calibrated turn model predicts them at the turn's own
    measured batch (the engine's, where it reported one and `engine_batch`; else the requests in
    flight on its worker) and with the prefills that paused it as the calibration counts them
    (`prefills.Prefills`, from the records before it): the model alone, without the simulator's
    dynamics (which set the batch there)."""
    engine = cost_rollout.instance(model, CPU_CORE, 1, cal.rollout_efficiency())
    prefills = Prefills(cal.settings.turn_window)
    out = []
    for t in run.turns:
        paused = prefills.charge(engine.prefill_seconds, t.get("trajectory_id", ""), t.get("worker_id", ""),
                                 t["prompt_tokens"], t["output_tokens"], t["timestamp"], t["seconds"])
        out.append(turn_seconds(engine, t["prompt_tokens"], t["output_tokens"],
                                (t.get("engine_batch", 0.0) if engine_batch else 0.0) or t["batch"], paused))
    return out


def turn_seconds(engine, prompt: float, output: float, batch: float, prefill_s: float | None = None) -> float:
    """The calibrated turn model's seconds for one turn at a given mean batch (one cost-model engine),
    its prefill `prefill_s` where given (else its whole context's)."""
    batch = max(1.0, batch)
    step = engine.decode_step_seconds(batch, batch * (prompt + output / 2.0))
    if prefill_s is None:
        prefill_s = engine.prefill_seconds(prompt) if prompt else 0.0
    return prefill_s + output * step + engine.eff.request_s


def per_token(turns: list[dict], engine) -> dict[str, list[float]]:
    """Turn seconds per generated token by the worker's batch (measured), beside the calibrated
    cost model's decode step at that batch (context 30 tokens a sequence): is the step's cost
    flat in the batch, as on a CPU running a tiny model, or growing, as the cost model says?"""
    found = {}
    for lo, hi in BATCHES:
        chosen = [t for t in turns if lo <= t["batch"] <= hi]
        tokens = sum(t["output_tokens"] for t in chosen)
        if tokens:
            middle = (lo + hi) // 2
            found[f"{lo}-{hi}"] = [round(sum(t["seconds"] for t in chosen) / tokens, 4),
                                   round(engine.decode_step_seconds(middle, middle * 30), 4)]
    return found


def shared_deviation(run: Loaded, fitted: list[float]) -> dict[str, float | None]:
    """How the measured turns' deviations from the calibrated turn model (`fitted`: each turn's seconds at its
    own batch) go together, as correlations: between turns of different trajectories that start within 20 ms of
    each other (shared in time), 100-200 ms apart (how long it lasts), on different buckets' workers within 20
    ms (one engine's or the whole machine's), whose replies arrive within 20 ms of each other (also split by
    worker, where the turn records name it); between consecutive turns of one trajectory (carried by the
    trajectory); with the number of turns starting in the turn's first 50 ms (other sequences joining the
    engines) and with the share of the turn overlapping a training step (the trainer)."""
    turns = sorted((t["timestamp"] - t["seconds"], t["seconds"] - f, t.get("trajectory_id", ""), t["timestamp"],
                    t["bucket"]) for t, f in zip(run.turns, fitted))
    starts = [t[0] for t in turns]
    trains = [(s["timestamp"] - s["train_seconds"], s["timestamp"]) for s in run.steps]

    def apart(low: float, high: float, other_bucket: bool = False) -> list[tuple[float, float]]:
        pairs = []
        for i, a in enumerate(turns):
            for b in turns[bisect.bisect_left(starts, a[0] + low, i + 1):bisect.bisect_left(starts, a[0] + high)]:
                if a[2] != b[2] and (a[4] != b[4] or not other_bucket):
                    pairs.append((a[1], b[1]))
        return pairs
    replies = sorted((t[3], t[1], t[2]) for t in turns)
    by_reply = sorted((t["timestamp"], t["seconds"] - f, t.get("trajectory_id", ""), t.get("worker_id", ""))
                      for t, f in zip(run.turns, fitted))

    def replies_near(same_worker: bool) -> list[tuple[float, float]]:  # replies within 20 ms, by worker
        reply_times = [r[0] for r in by_reply]
        return [(a[1], b[1]) for i, a in enumerate(by_reply) if a[3]
                for b in by_reply[i + 1:bisect.bisect_right(reply_times, a[0] + 0.02)]
                if b[3] and a[2] != b[2] and (a[3] == b[3]) == same_worker]
    own: dict[str, list[float]] = {}
    for start, deviation, tid, _, _ in turns:
        if tid:
            own.setdefault(tid, []).append(deviation)
    joined = [(bisect.bisect_left(starts, s + 0.05) - bisect.bisect_right(starts, s), d) for s, d, *_ in turns]
    overlap = [(sum(max(0.0, min(end, b) - max(s, a)) for a, b in trains) / (end - s) if end > s else 0.0, d)
               for s, d, _, end, _ in turns]

    def corr(pairs: list[tuple[float, float]]) -> float | None:  # None: too few pairs, or one side constant
        if len(pairs) < 10:
            return None
        try:
            return round(statistics.correlation([p for p, _ in pairs], [q for _, q in pairs]), 3)
        except statistics.StatisticsError:  # (no training overlaps a turn, say)
            return None
    return {"other_trajectories_within_20ms": corr(apart(0.0, 0.02)),
            "other_trajectories_100_to_200ms_apart": corr(apart(0.1, 0.2)),
            "other_bucket_within_20ms": corr(apart(0.0, 0.02, other_bucket=True)),
            "replies_within_20ms": corr([(a[1], b[1]) for a, b in zip(replies, replies[1:])
                                         if b[0] - a[0] < 0.02 and a[2] != b[2]]),
            "replies_within_20ms_same_worker": corr(replies_near(True)),
            "replies_within_20ms_other_worker": corr(replies_near(False)),
            "consecutive_turns_of_one": corr([pair for devs in own.values() for pair in zip(devs, devs[1:])]),
            "turns_starting_in_first_50ms": corr(joined), "share_overlapping_training": corr(overlap),
            **{f"own_{k}": corr([(t.get(k, 0), t["seconds"] - f) for t, f in zip(run.turns, fitted)])
               for k in ("prompt_tokens", "output_tokens", "batch", "turn_number")},
            "deviation_sd_s": round(statistics.pstdev(t["seconds"] - f for t, f in zip(run.turns, fitted)), 4)}


def answer_waves(run: Loaded, within_s: float = 0.0005) -> dict[str, float]:
    """Whether the run's turns reach their engines in waves: the share of turns whose route answer
    came within `within_s` of another turn's (the answers of one scheduler write resume together at
    the gateway), beside the share Poisson arrivals at the same rate would give; the route wait's
    share of the gaps and its median (turn records' route_seconds; absent in runs recorded before)."""
    starts = sorted(t["timestamp"] - t["seconds"] for t in run.turns)
    if len(starts) < 2 or starts[-1] <= starts[0]:
        return {}
    near = sum(bisect.bisect_right(starts, s + within_s) - bisect.bisect_left(starts, s - within_s) > 1
               for s in starts) / len(starts)
    rate = len(starts) / (starts[-1] - starts[0])
    out = {"answers_together": round(near, 3), "if_poisson": round(1 - math.exp(-2 * within_s * rate), 3)}
    routes = [t["route_seconds"] for t in run.turns if t.get("route_seconds")]
    gaps = sum(t.get("gap_seconds", 0.0) for t in run.turns if t.get("route_seconds"))
    if routes and gaps > 0:
        out.update(route_share_of_gap=round(sum(routes) / gaps, 3), route_p50_s=round(statistics.median(routes), 4))
    return out
