"""Baseline routing policies: length-aware, LA-MLFQ and the clairvoyant heuristic — levels, affinity, fallbacks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from libra.routing.baselines import LAMLFQ, Clairvoyant, LengthAware
from libra.routing.config import LaMlfqPolicy
from libra.routing.policy import Turn, Worker
from libra.routing.registry import make_policy
from libra.services.scheduler.config import SchedulerConfig

BUCKETS = [("long", 10_000), ("short", 100), ("medium", 1_000)]  # deliberately unordered
WORKERS = ("s0:short", "s1:short", "m0:medium", "l0:long")


def register(policy, workers=WORKERS):
    for spec in workers:
        worker_id, bucket = spec.split(":")
        policy.register(Worker(worker_id, bucket, f"http://{worker_id}"))
    return policy


def turn(tid: str, prompt_tokens: int = 10, prompt: str = "p", exclude=frozenset()) -> Turn:
    return Turn(tid, prompt, 0, prompt_tokens, 10, frozenset(exclude))


def test_length_aware_picks_the_smallest_bucket_that_fits_the_prompt():
    policy = register(LengthAware(100_000, buckets=BUCKETS))
    buckets = [policy.route(turn(f"t{n}", n)).bucket for n in (1, 100, 101, 1_000, 5_000, 50_000)]
    assert buckets == ["short", "short", "medium", "medium", "long", "long"]
    assert policy.state.reasons["prompt_length:short"] == 2


def test_length_aware_keeps_the_worker_while_the_level_holds_and_moves_when_it_grows():
    policy = register(LengthAware(100_000, buckets=BUCKETS))
    first = policy.route(turn("t", 50))
    policy.turn_done("t", first.worker_id, 30)
    again = policy.route(turn("t", 90))
    assert (again.reason, again.worker_id, again.moved) == ("affinity", first.worker_id, False)
    policy.turn_done("t", first.worker_id, 30)
    grown = policy.route(turn("t", 900))
    assert (grown.reason, grown.bucket, grown.moved) == ("prompt_length:medium", "medium", True)


def test_length_aware_falls_back_to_the_nearest_bucket_then_any_worker():
    policy = register(LengthAware(100, buckets=BUCKETS), ("s0:short", "m0:medium", "l0:long"))
    policy.route(turn("hog-m", 500))  # medium over the cap
    spill = policy.route(turn("t", 500))
    assert (spill.reason, spill.bucket) == ("fallback:bucket", "long")  # tie: the longer bucket fits
    policy.route(turn("hog-l", 50_000))
    policy.route(turn("hog-s", 50))
    assert policy.route(turn("u", 500)).reason == "fallback:any"


def test_la_mlfq_starts_short_and_demotes_as_output_outgrows_the_bucket():
    policy = register(LAMLFQ(100_000, buckets=BUCKETS))
    start = policy.route(turn("t"))
    assert (start.reason, start.bucket) == ("new:shortest", "short")
    policy.turn_done("t", start.worker_id, 100)  # == max_tokens of short: not exceeded yet
    assert policy.route(turn("t")).reason == "affinity"
    policy.turn_done("t", start.worker_id, 1)
    demoted = policy.route(turn("t"))
    assert (demoted.reason, demoted.bucket, demoted.moved) == ("demote:medium", "medium", True)
    policy.turn_done("t", demoted.worker_id, 5_000)  # crosses medium too: straight to long
    assert policy.route(turn("t")).bucket == "long"


def test_la_mlfq_places_a_known_prompt_from_its_history():
    policy = register(LAMLFQ(100_000, buckets=BUCKETS, max_history=1))
    worker = policy.route(turn("t", prompt="p")).worker_id
    policy.turn_done("t", worker, 700)
    policy.finish("t", "p", 700)
    known = policy.route(turn("u", prompt="p"))
    assert (known.reason, known.bucket) == ("new:history", "medium")
    policy.finish("u", "q", 20_000)  # a second prompt evicts the first (max_history=1)
    assert list(policy.history) == ["q"]
    assert policy.route(turn("v", prompt="p")).reason == "new:shortest"
    with pytest.raises(ValueError, match="output_tokens"):
        policy.turn_done("v", policy.state.placements["v"].worker_id, -1)


def test_clairvoyant_routes_by_true_remaining_output():
    remaining = {"t": 5_000}
    policy = register(Clairvoyant(100_000, buckets=BUCKETS, remaining_of=remaining.__getitem__))
    first = policy.route(turn("t"))
    assert (first.reason, first.bucket) == ("clairvoyant:long", "long")
    policy.turn_done("t", first.worker_id, 4_950)
    remaining["t"] = 50
    down = policy.route(turn("t"))
    assert (down.reason, down.bucket, down.moved) == ("clairvoyant:short", "short", True)
    with pytest.raises(ValueError, match="remaining_of"):
        Clairvoyant(100, buckets=BUCKETS)


def test_bucket_policies_skip_buckets_without_serving_workers():
    policy = register(LAMLFQ(100_000, buckets=BUCKETS), ("m0:medium", "l0:long"))
    start = policy.route(turn("t"))
    assert (start.reason, start.bucket) == ("fallback:bucket", "medium")


def test_make_policy_builds_baselines_and_refuses_the_clairvoyant_heuristic():
    built = make_policy(SchedulerConfig(policy={"type": "la_mlfq", "max_history": 7}), BUCKETS)
    assert isinstance(built, LAMLFQ) and built.max_history == 7 and built.buckets == ["short", "medium", "long"]
    assert isinstance(make_policy(SchedulerConfig(policy="length_aware"), BUCKETS), LengthAware)
    with pytest.raises(ValueError, match="bucket list"):
        make_policy(SchedulerConfig(policy="length_aware"))
    with pytest.raises(ValueError, match="evaluation only"):
        make_policy(SchedulerConfig.model_construct(policy=LaMlfqPolicy.model_construct(type="clairvoyant")), BUCKETS)
    with pytest.raises(ValidationError):
        SchedulerConfig(policy="clairvoyant")
    with pytest.raises(ValidationError, match="max_prompt_trees of la_mlfq is now its history size"):
        SchedulerConfig(policy="la_mlfq", max_prompt_trees=7)  # the layout before the policy union
