"""C-MLFQ routing as a deterministic step function: history starts, work-done and signal moves,
affinity, fallbacks, learning, and a reason on every route."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from libra.routing.baselines import LAMLFQ, LoadBalance
from libra.routing.cmlfq import CMLFQ
from libra.routing.policy import Turn, Worker
from libra.routing.prefix_tree import PrefixForest
from libra.routing.registry import make_policy
from libra.services.scheduler.config import SchedulerConfig

BUCKETS = [("long", 10_000), ("short", 100), ("medium", 1_000)]  # deliberately unordered
BIG = "search:large:success"  # default thresholds: > 2048 payload tokens is large
SMALL = "search:small:success"


def policy(cap: int = 100_000, max_moves: int = 4, workers=("s0:short", "s1:short", "m0:medium", "l0:long"),
           start_spill_factor: float = 0, min_visits_down: int = 3) -> CMLFQ:
    cmlfq = CMLFQ(cap, buckets=BUCKETS, forest=PrefixForest(min_visits=3), max_moves=max_moves,
                  start_spill_factor=start_spill_factor, min_visits_down=min_visits_down)
    for spec in workers:
        worker_id, bucket = spec.split(":")
        cmlfq.register(Worker(worker_id, bucket, f"http://{worker_id}"))
    return cmlfq


def turn(tid: str, prompt: str = "p", tokens: int = 10) -> Turn:
    return Turn(tid, prompt, 0, tokens, 10)


def teach(cmlfq: CMLFQ, signatures: list[str], remaining_after: list[int], times: int = 3, prompt: str = "other"):
    """Finished trajectories of another prompt (so that "p" has no history: it starts shortest)."""
    for _ in range(times):
        cmlfq.forest.insert(prompt, signatures, remaining_after)


def tool_turn(cmlfq: CMLFQ, tid: str, payload_tokens: int):
    """Finish the turn in flight, report a search tool return, route the next turn."""
    cmlfq.turn_done(tid, cmlfq.state.placements[tid].worker_id, 20)
    cmlfq.tool_returned(tid, "search", "success", payload_tokens)
    return cmlfq.route(turn(tid))


def test_new_trajectories_start_in_the_shortest_bucket_and_spread():
    cmlfq = policy()
    decisions = [cmlfq.route(turn(f"t{i}")) for i in range(4)]
    assert {d.bucket for d in decisions} == {"short"} and {d.reason for d in decisions} == {"new:shortest"}
    assert sorted(d.worker_id for d in decisions) == ["s0", "s0", "s1", "s1"]
    assert cmlfq.buckets == ["short", "medium", "long"]


def test_learned_long_signature_moves_up_and_short_one_moves_down():
    cmlfq = policy()
    teach(cmlfq, [BIG, SMALL], [5000, 4000, 50])
    cmlfq.route(turn("t"))
    up = tool_turn(cmlfq, "t", 5000)
    assert (up.reason, up.bucket, up.moved) == ("move:signal:up:long", "long", True)
    down = tool_turn(cmlfq, "t", 10)
    assert (down.reason, down.bucket, down.moved) == ("move:signal:down:short", "short", True)
    assert cmlfq.signals["move:signal"] == 2


def test_no_move_when_mean_and_p90_disagree_or_visits_are_few():
    cmlfq = policy()
    for remaining in [10] * 8 + [2000] * 2:  # mean 408 -> medium, p90 2000 -> long
        cmlfq.forest.insert("other", [BIG], [remaining, remaining])
    cmlfq.route(turn("t"))
    assert tool_turn(cmlfq, "t", 5000).reason == "affinity"
    teach(cmlfq, [BIG, BIG], [10, 10, 5000], times=2)  # deeper node says long, but 2 < min_visits
    decision = tool_turn(cmlfq, "t", 5000)
    assert decision.reason == "affinity" and decision.bucket == "short"
    assert cmlfq.signals == {"disagree": 2}  # the deeper node is skipped; its parent still disagrees


def test_affinity_between_moves_and_cap_breaks_it():
    cmlfq = policy(cap=100)
    first = cmlfq.route(turn("t", tokens=50))
    cmlfq.turn_done("t", first.worker_id, 10)
    again = cmlfq.route(turn("t", tokens=50))
    assert (again.reason, again.worker_id, again.moved) == ("affinity", first.worker_id, False)
    cmlfq.turn_done("t", first.worker_id, 10)
    hog = cmlfq.route(Turn("hog", "p", 0, 500, 10, frozenset({"s0", "s1"} - {first.worker_id})))
    assert hog.worker_id == first.worker_id
    moved = cmlfq.route(turn("t"))
    assert (moved.reason, moved.bucket, moved.moved) == ("least_loaded", "short", True)


def test_fallback_to_nearest_bucket_then_any_worker():
    cmlfq = policy(cap=100, workers=("s0:short", "m0:medium", "l0:long"))
    cmlfq.route(turn("hog-s", tokens=500))
    spill = cmlfq.route(turn("t"))
    assert (spill.reason, spill.bucket) == ("fallback:bucket", "medium")
    cmlfq.route(Turn("hog-m", "p", 0, 500, 10, frozenset({"s0", "l0"})))
    assert cmlfq.route(turn("u")).bucket == "long"
    cmlfq.route(Turn("hog-l", "p", 0, 500, 10, frozenset({"s0", "m0"})))
    assert cmlfq.route(turn("v")).reason == "fallback:any"


def test_buckets_without_serving_workers_are_skipped():
    cmlfq = policy(workers=("m0:medium", "l0:long"))
    start = cmlfq.route(turn("t"))
    assert (start.reason, start.bucket) == ("new:shortest", "medium")
    cmlfq.deregister("l0")
    teach(cmlfq, [BIG], [5000, 5000])
    moved = tool_turn(cmlfq, "t", 5000)
    assert (moved.reason, moved.bucket) == ("fallback:bucket", "medium")


def test_pinned_after_max_moves():
    cmlfq = policy(max_moves=1)
    teach(cmlfq, [BIG, SMALL], [5000, 4000, 50])
    cmlfq.route(turn("t"))
    assert tool_turn(cmlfq, "t", 5000).reason == "move:signal:up:long"
    stay = tool_turn(cmlfq, "t", 10)
    assert (stay.reason, stay.bucket) == ("affinity", "long") and cmlfq.signals["pinned"] == 1


def test_empty_tree_behaves_like_load_balance():
    workers = [Worker(f"w{i}", "short", f"http://w{i}") for i in range(3)]
    cmlfq, lb = CMLFQ(100, buckets=[("short", 100)]), LoadBalance(100)
    for worker in workers:
        cmlfq.register(Worker(**vars(worker)))
        lb.register(Worker(**vars(worker)))
    chosen = {"cmlfq": [], "lb": []}
    for step in range(30):
        tid, tokens = f"t{step % 7}", 10 + (step * 37) % 90
        for name, p in (("cmlfq", cmlfq), ("lb", lb)):
            decision = p.route(turn(tid, tokens=tokens))
            chosen[name].append(decision.worker_id)
            if step % 3:
                p.turn_done(tid, decision.worker_id)
            if step % 2:
                p.tool_returned(tid, "search", "success", 5)
    assert chosen["cmlfq"] == chosen["lb"]
    assert cmlfq.signals == {"no_signal": 15}


def test_finish_teaches_remaining_tokens_after_each_signature():
    cmlfq = policy()
    cmlfq.route(turn("t"))
    worker = lambda: cmlfq.state.placements["t"].worker_id  # noqa: E731 - work done may move it
    for output_tokens, payload in ((100, 5000), (50, 10)):
        cmlfq.turn_done("t", worker(), output_tokens)
        cmlfq.tool_returned("t", "search", "success", payload)
        cmlfq.route(turn("t"))
    cmlfq.turn_done("t", worker(), 30)
    cmlfq.finish("t", "p", 180)
    tree = cmlfq.forest.prompt_trees["p"]
    assert [tree.stats_at(path).mean for path in ([], [BIG], [BIG, SMALL])] == [180, 80, 30]
    assert "t" not in cmlfq.progress and "t" not in cmlfq.state.placements


def test_bad_reports_are_rejected():
    cmlfq = policy()
    worker = cmlfq.route(turn("t")).worker_id
    with pytest.raises(ValueError, match="success, failure, timeout"):
        cmlfq.tool_returned("t", "search", "error", 5)
    with pytest.raises(ValueError, match="output_tokens"):
        cmlfq.turn_done("t", worker, -1)
    assert cmlfq.progress["t"].signatures == []


def test_make_policy_from_config():
    assert isinstance(make_policy(SchedulerConfig()), LoadBalance)
    built = make_policy(SchedulerConfig(policy={"type": "cmlfq", "min_visits": 5, "p90_window": 8, "max_moves": 2,
                                                "min_visits_down": 9}), BUCKETS)
    assert isinstance(built, CMLFQ) and built.forest.min_visits == 5 and built.max_moves == 2
    assert built.min_visits_down == 9
    with pytest.raises(ValidationError, match="min_visits_down .2. must be >= scheduler.policy.min_visits .5."):
        SchedulerConfig(policy={"type": "cmlfq", "min_visits": 5, "min_visits_down": 2})
    with pytest.raises(ValueError, match="bucket list"):
        make_policy(SchedulerConfig(policy="cmlfq"))
    with pytest.raises(ValidationError, match="greater"):
        SchedulerConfig(policy={"type": "cmlfq", "tool_small_max_tokens": 10, "tool_medium_max_tokens": 10})
    with pytest.raises(ValidationError, match="scheduler.policy.min_visits applies to scheduler.policy type cmlfq"):
        SchedulerConfig(policy={"type": "load_balance", "min_visits": 5})
    with pytest.raises(ValidationError, match="scheduler.min_visits is a setting of policy cmlfq"):
        SchedulerConfig(policy="cmlfq", min_visits=5)  # the layout before the policy union


def test_worker_gone_reroutes_inside_the_bucket():
    cmlfq = policy()
    first = cmlfq.route(turn("t"))
    cmlfq.turn_done("t", first.worker_id, 5)
    cmlfq.deregister(first.worker_id)
    again = cmlfq.route(turn("t"))
    assert (again.reason, again.bucket, again.moved) == ("reroute:worker_gone", "short", True)


def test_without_a_confident_prediction_work_done_moves_a_long_trajectory_up():
    cmlfq = policy()
    cmlfq.route(turn("t"))
    limit = cmlfq.limits[0]
    cmlfq.turn_done("t", cmlfq.state.placements["t"].worker_id, limit + 1)  # already past the short bucket
    cmlfq.tool_returned("t", "search", "success", 10)
    decision = cmlfq.route(turn("t"))
    assert (decision.reason, decision.bucket) == ("move:work:up:medium", "medium")
    assert cmlfq.signals == {"move:work": 1}


def test_a_new_trajectory_spills_to_an_idling_bucket_only_at_start():
    from libra.routing.cmlfq import CMLFQ
    from libra.routing.policy import Turn, Worker

    policy = CMLFQ(10**6, buckets=[("short", 100), ("long", 1000)], start_spill_factor=2.0)
    policy.register(Worker("s0", "short", "http://s0"))
    policy.register(Worker("l0", "long", "http://l0"))
    turn = lambda tid: Turn(trajectory_id=tid, prompt_id="p", turn=0, prompt_tokens=100, max_new_tokens=100)
    assert policy.route(turn("a")).reason == "new:shortest"  # both idle: the shortest bucket
    spilled = policy.route(turn("b"))  # short carries 200 tokens, long none: long idles
    assert (spilled.worker_id, spilled.reason) == ("l0", "fallback:spill")
    assert policy.route(turn("c")).worker_id == "s0"  # 200 vs 200: no longer twice as loaded
    off = CMLFQ(10**6, buckets=[("short", 100), ("long", 1000)], start_spill_factor=0)
    off.register(Worker("s0", "short", "http://s0"))
    off.register(Worker("l0", "long", "http://l0"))
    assert {off.route(turn(t)).worker_id for t in "abc"} == {"s0"}


def finish(cmlfq: CMLFQ, tid: str, prompt: str, total: int) -> None:
    cmlfq.turn_done(tid, cmlfq.state.placements[tid].worker_id, total)
    cmlfq.finish(tid, prompt, total)


def test_a_known_prompt_starts_where_the_p90_of_its_history_points():
    cmlfq = policy()
    for i, total in enumerate([50, 60, 700]):  # p90 of the prompt's totals: 700 -> medium
        cmlfq.route(turn(f"old{i}", prompt="q"))
        finish(cmlfq, f"old{i}", "q", total)
    known = cmlfq.route(turn("t", prompt="q"))
    assert (known.reason, known.bucket) == ("new:history:medium", "medium")
    assert cmlfq.progress["t"].level == 1
    fresh = cmlfq.route(turn("u", prompt="never-seen"))
    assert (fresh.reason, fresh.bucket) == ("new:shortest", "short")


def test_work_done_is_a_floor_that_no_prediction_goes_below():
    cmlfq = policy()
    teach(cmlfq, [SMALL], [50, 20])  # the tree is sure: 20 tokens left after this outcome
    cmlfq.route(turn("t"))
    cmlfq.turn_done("t", cmlfq.state.placements["t"].worker_id, 1_500)  # produced past medium's 1000
    cmlfq.tool_returned("t", "search", "success", 10)
    up = cmlfq.route(turn("t"))
    assert (up.reason, up.bucket) == ("move:work:up:long", "long")  # not short: it already made 1500
    assert cmlfq.signals == {"move:work": 1}


def test_a_move_down_needs_min_visits_down_an_up_move_only_min_visits():
    cmlfq = policy(min_visits_down=10)
    teach(cmlfq, [BIG, SMALL], [5000, 4000, 50], times=3)
    cmlfq.route(turn("t"))
    assert tool_turn(cmlfq, "t", 5000).reason == "move:signal:up:long"  # 3 visits are enough to go up
    stay = tool_turn(cmlfq, "t", 10)
    assert (stay.reason, stay.bucket) == ("affinity", "long") and cmlfq.signals["weak_down"] == 1
    teach(cmlfq, [BIG, SMALL], [5000, 4000, 50], times=7)  # 10 visits now
    cmlfq.route(turn("u"))
    tool_turn(cmlfq, "u", 5000)
    assert tool_turn(cmlfq, "u", 10).reason == "move:signal:down:short"


def test_a_spilled_start_keeps_its_level_and_goes_back_when_its_bucket_has_room():
    cmlfq = CMLFQ(10**6, buckets=[("short", 100), ("long", 1000)], start_spill_factor=2.0)
    cmlfq.register(Worker("s0", "short", "http://s0"))
    cmlfq.register(Worker("l0", "long", "http://l0"))
    cmlfq.route(Turn("a", "p", 0, 100, 100))
    spilled = cmlfq.route(Turn("b", "p", 0, 100, 100))
    assert (spilled.worker_id, spilled.reason) == ("l0", "fallback:spill") and cmlfq.progress["b"].level == 0
    cmlfq.turn_done("a", "s0", 5)  # short has room again
    cmlfq.turn_done("b", "l0", 5)
    cmlfq.tool_returned("b", "search", "success", 5)  # nothing learned, 5 tokens made: still short
    back = cmlfq.route(Turn("b", "p", 1, 110, 100))
    assert (back.worker_id, back.reason, back.moved) == ("s0", "least_loaded", True)
    cmlfq.turn_done("b", "s0", 5)
    assert cmlfq.route(Turn("b", "p", 2, 120, 100)).reason == "affinity"


def test_without_signal_cmlfq_routes_like_la_mlfq():
    """While no tool-outcome prefix is confident (here: none has the visits), C-MLFQ has LA-MLFQ's
    information (the prompt's history, its one sample so far; work done) and makes LA-MLFQ's decisions."""
    cmlfq, la = CMLFQ(100_000, buckets=BUCKETS, forest=PrefixForest(min_visits=100), min_visits_down=100), \
        LAMLFQ(100_000, buckets=BUCKETS)
    for worker in ("s0:short", "s1:short", "m0:medium", "l0:long"):
        worker_id, bucket = worker.split(":")
        for p in (cmlfq, la):
            p.register(Worker(worker_id, bucket, f"http://{worker_id}"))
    outputs = {0: [40, 80, 900], 1: [30, 2_000, 5], 2: [300], 3: [20, 20]}
    for rnd in range(2):  # the second round starts from each prompt's one finished sample
        for n, produced in outputs.items():
            tid, prompt = f"r{rnd}t{n}", f"p{n}"
            chosen = []
            for k, tokens in enumerate(produced):
                a, b = cmlfq.route(Turn(tid, prompt, k, 10, 10)), la.route(Turn(tid, prompt, k, 10, 10))
                chosen.append((a.bucket, b.bucket))
                for p, d in ((cmlfq, a), (la, b)):
                    p.turn_done(tid, d.worker_id, tokens)
                    if k + 1 < len(produced):
                        p.tool_returned(tid, "search", "success", 10 + 100 * ((n + k) % 3))
            for p in (cmlfq, la):
                p.finish(tid, prompt, sum(produced))
            assert all(mine == theirs for mine, theirs in chosen), (tid, chosen)
    assert cmlfq.signals["move:signal"] == 0


def test_every_route_carries_an_explainable_reason():
    from libra.services.planner.sim.instance import Group
    from libra.services.planner.sim.rollout import Window
    from libra.traces.synthetic import no_signal, signal

    layout = [Group("short", 1, 2), Group("medium", 2, 1), Group("long", 4, 1)]
    buckets = [("short", 2_000), ("medium", 8_000), ("long", 32_000)]
    cmlfq = CMLFQ(10**6, buckets=buckets)
    reasons = set()
    for trace in (signal(120, 1, prefix="a"), signal(120, 2, prefix="b"), no_signal(120, 3, prefix="c")):
        reasons |= set(Window(layout, trace).run(cmlfq).reasons)
    bucket = "(short|medium|long)"
    vocabulary = re.compile(rf"new:(history:{bucket}|shortest)|move:(signal|work):(up|down):{bucket}|affinity"
                            r"|least_loaded|reroute:worker_gone|fallback:(spill|bucket|any)")
    assert all(vocabulary.fullmatch(reason) for reason in reasons), reasons
    assert {"new:history:long", "move:signal:up:long", "move:signal:down:short", "move:work:up:long"} <= reasons


def test_min_visits_above_the_default_min_visits_down_is_accepted():
    config = SchedulerConfig(policy={"type": "cmlfq", "min_visits": 30})  # min_visits_down left at 20
    assert (config.policy.min_visits, config.policy.min_visits_down) == (30, 20)
