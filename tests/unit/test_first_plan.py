"""A run's first plan (sim/rank.first_plan): the search's shortlist ranked by replaying the first
batch on the cluster simulator, as the replanner ranks later plans."""

from __future__ import annotations

import dataclasses
import math

import pytest

from libra.errors import InvalidArgument
from libra.services.planner.config import ReplanSettings
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import SearchConfig, search
from libra.services.planner.sim import control, run as sim_run
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.rank import SimRanker, first_plan
from libra.traces import synthetic

MODEL, GPU = model_named("qwen3-4b"), gpu_named("h200-141g")
SETTINGS = ReplanSettings(sim_window_steps=5, sim_warmup_steps=2)


@pytest.mark.parametrize("gpus,seed", [(8, 0), (16, 1)])
def test_the_first_plan_runs_a_stationary_trace_faster_than_the_closed_forms_best(gpus, seed):
    """The closed form ranks one synchronous step knowing every length; the replay plays the
    asynchronous pipeline with a router that does not. On a trace without drift the replayed choice
    runs the whole trace at least as fast as the search's best (here faster: they differ)."""
    config = SearchConfig(total_gpus=gpus, group_size=4, exact_multiset_limit=64)
    trace = synthetic.drifting(12, gpus, 4, seed=seed, drift=0.0)
    chosen = first_plan(MODEL, GPU, config, SimConfig(), trace.steps[0], SETTINGS)
    assert chosen.searched.step_s == search(MODEL, GPU, trace.pairs(0), config).best.step_s  # (ties aside)
    per_step = [seconds for _, seconds in chosen.ranked]
    assert per_step == sorted(per_step) and chosen.ranked[0][0] == chosen.chosen
    assert any(candidate == chosen.searched for candidate, _ in chosen.ranked)
    assert chosen.chosen != chosen.searched, chosen.reason
    assert "the fastest of" in chosen.reason and "closed form's best" in chosen.reason
    fast = sim_run.run_plan(MODEL, GPU, trace, chosen.chosen, config).trajectories_per_s
    searched = sim_run.run_plan(MODEL, GPU, trace, chosen.searched, config).trajectories_per_s
    assert fast > searched


def test_the_window_is_the_first_batch_again_with_its_prompts_named_apart():
    """Each replayed step is the first batch, under new trajectory and prompt ids (a policy that
    learns per prompt must not be told the lengths of the copy it is about to route)."""
    trace = synthetic.drifting(2, 4, 4, seed=2, drift=0.0)
    ranker = SimRanker(MODEL, GPU, SearchConfig(total_gpus=8), SimConfig(), window_steps=3, warmup_steps=1)
    window = ranker.repeated(trace.steps[0])
    assert len(window.steps) == ranker.window_steps == 4
    assert all([spec.turns for spec in step] == [spec.turns for spec in trace.steps[0]] for step in window.steps)
    prompts = [{spec.prompt_id for spec in step} for step in window.steps]
    assert all(len(p) == 4 for p in prompts) and not set.intersection(*prompts)
    assert [{spec.step for spec in step} for step in window.steps] == [{0}, {1}, {2}, {3}]


def test_static_and_online_start_from_it_unless_ranking_is_closed_form():
    config = SearchConfig(total_gpus=8, group_size=4, exact_multiset_limit=64)
    trace = synthetic.drifting(10, 8, 4, seed=0, drift=0.0)
    expected = first_plan(MODEL, GPU, config, SimConfig(), trace.steps[0], SETTINGS).chosen
    static = control.static(MODEL, GPU, config, SETTINGS, SimConfig())
    assert static.initial(trace) == expected and "step 0's batch: the fastest of" in static.reason
    online = control.Online(MODEL, GPU, config, SETTINGS.model_copy(update={"cooldown_s": 1e6}), SimConfig())
    assert online.initial(trace) == expected
    closed = control.static(MODEL, GPU, config, SETTINGS.model_copy(update={"rank": "closed_form"}), SimConfig())
    assert closed.initial(trace) == search(MODEL, GPU, trace.pairs(0), config).best != expected
    result = Simulator(MODEL, GPU, trace, control.static(MODEL, GPU, config, SETTINGS, SimConfig()), config).run()
    assert result.first_plan == result.last_plan and not result.plan_changes


def test_a_batch_no_plan_can_run_is_refused_with_the_reason():
    """A batch no layout can train: the search refuses it before any replay, naming memory."""
    config = SearchConfig(total_gpus=8, group_size=4, exact_multiset_limit=64)
    trace = synthetic.drifting(2, 4, 4, seed=0, drift=0.0)
    ranker = SimRanker(MODEL, GPU, config, SimConfig(), 5, 2)
    window = ranker.repeated(trace.steps[0])
    plan = search(MODEL, GPU, trace.pairs(0), config).best
    assert math.isfinite(ranker.play(window, plan, config.rollout, config.train).per_step_s)
    huge = [dataclasses.replace(spec, prompt_tokens=2_000_000) for spec in trace.steps[0]]
    with pytest.raises(InvalidArgument, match="training memory: the least any training layout tried needs"):
        first_plan(MODEL, GPU, config, SimConfig(), huge, SETTINGS)


def test_the_splits_around_the_searchs_choice_are_ranked_too():
    """split_neighbours: the best plan's TP and PP at other data-parallel degrees, each a valid
    split (whole GRPO groups per replica, GPUs left to roll out) with the fleet scaled in its TP
    proportions; first_plan replays them with the rest."""
    from libra.services.planner.shortlist import _scaled, split_neighbours

    config = SearchConfig(total_gpus=32, group_size=4, exact_multiset_limit=64, whole_nodes="off")
    trace = synthetic.drifting(10, 32, 4, seed=0, drift=0.0)
    best = search(MODEL, GPU, trace.pairs(0), config).best
    around = split_neighbours(MODEL, GPU, trace.pairs(0), config, best, whole=False)
    assert around and {c.layout.dp for c in around} != {best.layout.dp}
    for candidate in around:
        assert (candidate.layout.tp, candidate.layout.pp) == (best.layout.tp, best.layout.pp)
        assert candidate.layout.dp != best.layout.dp and candidate.layout.dp <= 128 // 4  # a group or more each
        assert 0 < candidate.rollout_gpus <= 32 - candidate.layout.gpus
        assert math.isfinite(candidate.step_s)
    assert _scaled(((1, 4), (4, 3)), 32, {1: 0, 4: 0}) == ((1, 8), (4, 6))  # shares kept
    assert _scaled(((8, 3),), 20, {4: 0, 8: 0}) == ((4, 1), (8, 2))  # the rest to the widest that fits
    chosen = first_plan(MODEL, GPU, config, SimConfig(), trace.steps[0], SETTINGS)
    assert any(c.layout.gpus != best.layout.gpus for c, _ in chosen.ranked)


def test_the_choice_reports_its_progress_a_line_per_replay():
    """At cluster scale the choice takes a minute of CPU: `notes` hears the search, each replay
    as it ends (its seconds per step, its plan) and the choice, in that order."""
    config = SearchConfig(total_gpus=8, group_size=4, exact_multiset_limit=64)
    trace = synthetic.drifting(4, 8, 4, seed=0, drift=0.0)
    lines: list[str] = []
    chosen = first_plan(MODEL, GPU, config, SimConfig(), trace.steps[0], SETTINGS, notes=lines.append)
    replays = [line for line in lines if line.startswith("  replay ")]
    assert lines[0].startswith("first plan: the closed-form search on step 0's batch of 32 trajectories")
    assert len(replays) == len(chosen.ranked) and replays[0].startswith(f"  replay 1/{len(chosen.ranked)}:")
    assert {line.rsplit("per step  ", 1)[1] for line in replays} == {c.describe() for c, _ in chosen.ranked}
    assert lines[-1].startswith(f"first plan: {chosen.chosen.describe()} ({chosen.ranked[0][1]:.1f}s per step; ")


def test_a_tie_in_pace_goes_to_the_plan_whose_rollout_finishes_its_batches_soonest():
    """Replays within `TIE` of the fastest per step tie (a training-bound pipeline steps at the
    trainer's pace whatever the fleet); among them the shortest mean rollout span after the warm-up
    comes first, then the search's order; the others follow by pace. A plan no replay could run
    (infinite) stays last, and with nothing finite the order is the search's."""
    from libra.services.planner.evaluate import Played
    from libra.services.planner.sim.rank import TIE, ranking

    def played(per_step: float, span: float, warm: int = 1) -> Played:
        ends = tuple(per_step * k for k in range(5))
        return Played(ends, (999.0,) * (warm + 1) + (span,) * (4 - warm), warm)  # the warm-up's spans not counted

    replays = [played(100.0, 80.0), played(100.0 * (1 + TIE / 2), 60.0), played(100.0, 70.0),
               played(100.0 * (1 + 2 * TIE), 10.0), played(math.inf, 1.0)]
    assert ranking(replays) == [1, 2, 0, 3, 4]
    assert ranking([played(100.0, 80.0), played(100.0, 80.0)]) == [0, 1]  # a full tie: the search's order
    assert ranking([played(math.inf, 5.0), played(math.inf, 1.0)]) == [0, 1]
