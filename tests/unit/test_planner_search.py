"""The planner's allocation search: same optimum as brute force on small clusters, and its filters."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from libra.services.planner import cost_rollout as cr
from libra.services.planner import placement
from libra.services.planner import cost_train as ct
from libra.services.planner.cost_rollout import Infeasible
from libra.services.planner.hardware import GpuSpec, gpu_named, model_named
from libra.services.planner.search import SearchConfig, multisets, search


def _trace(seed: int, prompts: int, group: int, output_mu: float = 6.5) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(p, int(rng.lognormvariate(output_mu, 1.0)) + 1)
            for p in (rng.randint(50, 3000) for _ in range(prompts)) for _ in range(group)]


def _small_node(gpus_per_node: int) -> GpuSpec:
    return GpuSpec(**{**gpu_named("h100-80g").model_dump(), "gpus_per_node": gpus_per_node, "name": "h100-small"})


def brute_force(model, gpu, trace, config: SearchConfig) -> list[float]:
    """Every (layout, rollout multiset) pair, written independently of `search`: sorted objectives,
    one per training layout (with its best rollout multiset of at most the remaining GPUs)."""
    batch = len(trace)
    seq_len = max(1, round(sum(p + o for p, o in trace) / batch))
    total = config.total_gpus
    node = gpu.gpus_per_node if config.whole_nodes == "on" else 1  # these cases' TP groups always pack
    kinds = {}
    for tp in config.tp_choices:
        try:
            if gpu.gpus_per_node % tp == 0:
                kinds[tp] = cr.instance(model, gpu, tp, config.rollout)
        except Infeasible:
            pass

    def best_rollout(gpus: int) -> float:
        best = math.inf
        for counts in itertools.product(*(range(gpus // tp + 1) for tp in kinds)):
            used = sum(n * tp for n, tp in zip(counts, kinds))
            if max(1, config.min_rollout_gpus) <= used <= gpus:  # idle GPUs are not rollout's
                fleet = [kinds[tp] for n, tp in zip(counts, kinds) for _ in range(n)]
                try:
                    best = min(best, cr.rollout_time(trace, fleet))
                except Infeasible:
                    pass
        return best

    objectives = []
    for tp, pp, dp, mb in itertools.product(config.tp_choices, config.pp_choices, range(1, total + 1),
                                            config.micro_batches):
        train_gpus = tp * pp * dp
        rollout_gpus = total - train_gpus
        if train_gpus < config.min_train_gpus or rollout_gpus < config.min_rollout_gpus:
            continue
        if train_gpus % node or rollout_gpus % node:
            continue
        groups = batch // config.group_size
        if groups < dp or (groups % dp and total > config.uneven_splits_up_to):
            continue
        try:  # (a replica trains whole groups, as even as their count allows: the busiest one's time)
            train = ct.step_time(model, gpu, ct.Layout(tp, pp, dp, mb), batch, seq_len, config.train,
                                 config.group_size).seconds
        except Infeasible:
            continue
        rollout = best_rollout(rollout_gpus)
        if rollout < math.inf:
            objectives.append(max(train, rollout))
    return sorted(objectives)


CASES = [  # (model, gpu, total GPUs, prompts, group, seed[, output_mu]); short outputs: training-bound
    ("qwen2.5-3b", "a100-80g", 2, 4, 4, 0),
    ("qwen2.5-3b", "a100-80g", 4, 8, 4, 1),
    ("qwen3-4b", "h100-80g", 6, 8, 4, 2),
    ("qwen2.5-3b", "h200-141g", 7, 16, 2, 3),
    ("qwen3-14b", "h200-141g", 6, 8, 8, 4),
    ("qwen2.5-7b", "h100-80g", 7, 8, 4, 5),  # (Qwen3-30B-A3B cannot train on <= 8 GPUs)
    ("qwen2.5-7b", "small-node-4", 8, 8, 4, 6),
    ("qwen3-4b", "small-node-2", 8, 16, 4, 7),
    ("qwen3-4b", "h100-80g", 6, 32, 4, 8, 2.5),
    ("qwen2.5-3b", "small-node-2", 8, 64, 2, 9, 3.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_search_matches_brute_force_on_small_clusters(case):
    model_name, gpu_name, total, prompts, group, seed, *mu = case
    model = model_named(model_name)
    gpu = _small_node(int(gpu_name[-1])) if gpu_name.startswith("small-node") else gpu_named(gpu_name)
    trace = _trace(seed, prompts, group, *mu)
    whole = "on" if total >= 2 * gpu.gpus_per_node else "off"
    config = SearchConfig(total_gpus=total, group_size=group, top_k=3, whole_nodes=whole)
    expected = brute_force(model, gpu, trace, config)
    assert expected, "a case with no feasible allocation tests nothing"
    result = search(model, gpu, trace, config)
    assert result.best.step_s == pytest.approx(expected[0], rel=1e-9)
    assert [c.step_s for c in result.alternatives] == pytest.approx(expected[:3], rel=1e-9)
    assert result.best.describe().startswith("train tp")
    assert result.sequences_per_s == pytest.approx(len(trace) / expected[0])


def test_plans_respect_groups_min_gpus_and_nodes():
    model, gpu = model_named("qwen3-4b"), _small_node(4)
    trace = _trace(11, 4, 16)
    config = SearchConfig(total_gpus=16, group_size=16, min_rollout_gpus=8, top_k=10, whole_nodes="on")
    result = search(model, gpu, trace, config)
    for cand in result.alternatives:
        layout = cand.layout
        assert layout.dp <= len(trace) // 16  # whole groups of 16, at least one per replica
        assert layout.gpus % 4 == 0 and 16 - layout.gpus >= 8 and layout.tp <= 4
        assert 8 <= cand.rollout_gpus <= 16 - layout.gpus and all(tp <= 4 for tp, _ in cand.rollout)
    assert result.rejected["a DP replica would get no GRPO group of 16 in a batch of 64"] > 0
    assert result.rejected["rollout tp8 would straddle nodes of 4 GPUs"] == 1
    assert result.placement == "whole nodes on (asked)"


@pytest.mark.parametrize("tps", [(4,), (2, 4)])
def test_min_rollout_gpus_counts_the_gpus_the_fleet_uses(tps):
    """A fleet that leaves some of rollout's GPUs idle below min_rollout_gpus is not a plan (nor
    costed: the even split of a 4,096-GPU design used to cost its 255 sub-fleets); the search still
    matches the brute force, which applies the same floor."""
    model, gpu = model_named("qwen2.5-3b"), gpu_named("a100-80g")
    trace = _trace(5, 8, 4)
    config = SearchConfig(total_gpus=16, group_size=4, tp_choices=tps, min_train_gpus=8, min_rollout_gpus=8,
                          top_k=3, whole_nodes="off")
    result = search(model, gpu, trace, config)
    expected = brute_force(model, gpu, trace, config)
    assert result.best.step_s == pytest.approx(expected[0], rel=1e-9)
    assert [c.step_s for c in result.alternatives] == pytest.approx(expected[:3], rel=1e-9)
    assert all(c.rollout_gpus == 8 and c.layout.gpus == 8 for c in result.alternatives)
    assert result.rejected["a rollout fleet of fewer than min_rollout_gpus=8 GPUs (the rest idle)"] >= 1
    free = search(model, gpu, trace, config.model_copy(update={"min_rollout_gpus": 1}))  # sub-fleets allowed
    assert free.best.step_s <= result.best.step_s


def test_a_floor_no_fleet_can_reach_is_refused_naming_it():
    """Rollout's 10 GPUs hold at most one TP-8 or two TP-4 engines (8 GPUs): no plan, and the reason says why."""
    config = SearchConfig(total_gpus=14, group_size=4, tp_choices=(4, 8), min_train_gpus=4, min_rollout_gpus=10,
                          whole_nodes="off")
    with pytest.raises(Infeasible, match=r"x a rollout fleet of fewer than min_rollout_gpus=10 GPUs \(the rest idle\)"):
        search(model_named("qwen2.5-3b"), gpu_named("a100-80g"), _trace(5, 8, 4), config)


def test_whole_nodes_asked_on_one_node_is_refused_with_the_reason():
    model, gpu = model_named("qwen2.5-3b"), gpu_named("a100-80g")
    with pytest.raises(Infeasible, match="less than two nodes .*whole_nodes off"):  # 8 GPUs = one node
        search(model, gpu, _trace(0, 4, 4), SearchConfig(total_gpus=8, group_size=4, whole_nodes="on"))


@pytest.mark.parametrize("total", [8, 12, 4])
def test_one_node_and_partial_nodes_get_a_plan(total):
    """`auto` (the default) lets the sides share a node: a single node and 1.5 nodes plan."""
    model, gpu = model_named("qwen2.5-3b"), gpu_named("a100-80g")
    result = search(model, gpu, _trace(0, 4, 4), SearchConfig(total_gpus=total, group_size=4))
    best = result.best
    assert best.layout.gpus + best.rollout_gpus <= total and best.rollout_gpus >= 1
    assert result.placement.startswith("whole nodes off (auto:")


def test_a_partial_node_packs_tp_groups_without_straddling():
    """12 GPUs = a node of 8 + one of 4: TP groups of 8 and 4 fit once each, never 8 + 4 + 4."""
    packing = placement.Packing(12, 8, (1, 2, 4, 8))
    assert packing.needed
    assert packing.fits(8, 1, ((4, 1),)) and packing.fits(4, 1, ((8, 1),))
    assert not packing.fits(4, 2, ((8, 1),))  # 4 + 4 + 8 = 16 > 12
    assert not packing.fits(8, 1, ((2, 1), (4, 1)))  # 8 + 4 + 2 = 14 > 12
    assert packing.fits(2, 2, ((4, 1), (1, 4)))
    assert not placement.Packing(16, 8, (1, 2, 4, 8)).needed  # whole nodes, sizes dividing: the sum decides


def test_auto_keeps_whole_nodes_only_within_the_slack():
    model, gpu = model_named("qwen2.5-3b"), _small_node(4)
    trace = _trace(1, 8, 8)
    packed = search(model, gpu, trace, SearchConfig(total_gpus=16, group_size=8, whole_nodes="off"))
    whole = search(model, gpu, trace, SearchConfig(total_gpus=16, group_size=8, whole_nodes="on"))
    ratio = whole.best.step_s / packed.best.step_s - 1
    assert 0 < ratio < 0.05  # whole nodes cost a little here (2.5%): the default slack keeps them
    kept = search(model, gpu, trace, SearchConfig(total_gpus=16, group_size=8))
    assert kept.best == whole.best and kept.placement.startswith("whole nodes on (auto: 16 GPUs = 4 nodes of 4")
    dropped = search(model, gpu, trace, SearchConfig(total_gpus=16, group_size=8, whole_node_slack=ratio / 2))
    assert dropped.best == packed.best and "cost too much" in dropped.placement


def test_a_model_that_cannot_fit_is_refused_naming_memory_in_numbers():
    model, gpu = model_named("qwen3-14b"), gpu_named("a100-80g")
    with pytest.raises(Infeasible) as caught:
        search(model, gpu, _trace(0, 4, 4), SearchConfig(total_gpus=2, group_size=4, tp_choices=(1,)))
    text = str(caught.value)
    assert "training memory: the least any training layout tried needs is" in text
    assert "GiB per GPU (tp1 pp" in text and "a100-80g allows 73.6 GiB" in text
    assert " x training over memory" in text  # every reason, with its count, in whole


def test_large_gpu_counts_use_a_grid_that_fills_the_rollout_side():
    config = SearchConfig(total_gpus=1024, exact_multiset_limit=64, mix_steps=4)
    mixes = multisets(256, [1, 2, 4, 8], config)
    assert ((1, 256),) in mixes and ((8, 32),) in mixes and ((1, 128), (8, 16)) in mixes
    assert all(sum(tp * n for tp, n in mix) == 256 for mix in mixes)
    assert len(mixes) < 64


def test_search_is_fast_at_cluster_scale():
    trace = _trace(3, 64, 16)
    result = search(model_named("qwen3-14b"), gpu_named("h200-141g"), trace,
                    SearchConfig(total_gpus=512, group_size=16))
    assert result.best.layout.gpus % 8 == 0 and result.pruned + result.evaluated > 0


def test_neighbours_trade_the_fewest_engines_that_exchange_evenly():
    from libra.services.planner.cost_train import Layout
    from libra.services.planner.search import Candidate
    from libra.services.planner.shortlist import neighbours

    model, gpu = model_named("qwen2.5-7b"), gpu_named("h200-141g")
    plan = Candidate(Layout(1, 4, 4, 1), ((1, 8), (4, 6)), math.nan, math.nan)
    near = neighbours(model, gpu, _trace(2, 16, 8), SearchConfig(total_gpus=48), plan, keep=10, whole=False)
    mixes = {c.rollout for c in near}
    assert ((1, 4), (4, 7)) in mixes  # four TP1 engines -> one TP4
    assert ((1, 12), (4, 5)) in mixes  # one TP4 -> four TP1
    assert ((1, 8), (2, 2), (4, 5)) in mixes and ((1, 6), (2, 1), (4, 6)) in mixes
    assert not any(tp == 8 for c in near for tp, _ in c.rollout)  # 28 heads: no TP8 engine for this model
    assert all(c.layout == plan.layout and c.rollout_gpus == 32 for c in near)
    steps = [c.step_s for c in near]
    assert steps == sorted(steps) and len(neighbours(model, gpu, _trace(2, 16, 8), SearchConfig(total_gpus=48),
                                                     plan, keep=2, whole=False)) == 2
    # whole exchanges: every engine of one degree turned into another's, after the `keep` ranked ones
    far = neighbours(model, gpu, _trace(2, 16, 8), SearchConfig(total_gpus=48), plan, keep=2)
    assert far[:2] == near[:2]
    assert {c.rollout for c in far[2:]} == {((4, 8),), ((1, 32),), ((2, 4), (4, 6)), ((1, 8), (2, 12))}
    assert all(c.layout == plan.layout and c.rollout_gpus == 32 for c in far)


def _finish(c, load) -> float:
    """The finish estimate stated plainly (cost_rollout._Costs' docstring) for one instance's load
    [prefill seconds, decode tokens, sum of mean contexts, longest output, requests]."""
    prefill_s, decode_tokens, context_sum, longest, requests = load
    mean_context = context_sum / requests
    batch = max(1, min(requests, c.max_seqs, int(c.capacity // max(mean_context, 1.0))))
    steps = max(longest, -(-decode_tokens // batch))
    fraction = 1.0 if c.moe is None else cr._expert_read_fraction(c.moe, batch)
    step = c.weight_s * fraction + c.kv_s * batch * mean_context + c.step_fixed + c.step_per_seq * batch
    return prefill_s + steps * step


def _reference_greedy(trace, fleet):
    """The greedy written plainly: longest first; of each TP degree, the instance whose load
    finishes first (the lowest index on ties) is offered the request; it goes to the offer that
    finishes earliest with it (the degree met first in the fleet on ties); the makespan is the
    latest finish any instance was given on the way (one more request can shorten a load: a larger
    decode batch)."""
    costs = {inst.tp: cr._Costs(inst) for inst in reversed(fleet)}
    order = list(dict.fromkeys(inst.tp for inst in fleet))
    loads = [[0.0, 0, 0.0, 0, 0] for _ in fleet]
    finishes = [0.0] * len(fleet)
    makespan = 0.0
    for prompt, output in sorted(trace, key=lambda r: r[0] + r[1], reverse=True):
        offers = []
        for tp in order:
            c = costs[tp]
            if prompt + output > c.capacity:
                continue
            index = min((i for i, inst in enumerate(fleet) if inst.tp == tp), key=lambda i: (finishes[i], i))
            p, d, ctx, longest, n = loads[index]
            load = [p + c.prefill_per_token * prompt, d + output, ctx + prompt + output / 2.0, max(longest, output),
                    n + 1]
            offers.append((_finish(c, load), index, load))
        finish, index, load = min(offers, key=lambda offer: offer[0])  # min keeps the first of equals
        loads[index], finishes[index] = load, finish
        makespan = max(makespan, finish)
    return makespan


@pytest.mark.parametrize("seed", range(4))
def test_the_greedy_assigns_as_the_rule_says(seed):
    """The greedy's flat hot loop against the rule written plainly: fleets of one degree and of several, a dense model and an MoE one (whose decode reads depend on the batch); the
    same makespan to the last bit; a cutoff below it returns inf, above it the makespan."""
    gpu = gpu_named("h200-141g")
    trace = _trace(seed, 12, 4)
    for name in ("qwen2.5-7b", "qwen3-30b-a3b"):
        model = model_named(name)
        eff = cr.RolloutEfficiency()
        kinds = {tp: cr.instance(model, gpu, tp, eff) for tp in (1, 2, 4) if not (name != "qwen2.5-7b" and tp == 1)}
        fleets = [[kinds[tp]] * n for tp, n in ((1, 3), (2, 5), (4, 1)) if tp in kinds]
        fleets.append([kinds[4], kinds[2], kinds[4], kinds[2], kinds[2]])
        for fleet in fleets:
            exact = cr.rollout_time(trace, fleet)
            assert exact == _reference_greedy(trace, fleet), (name, [i.tp for i in fleet])
            assert cr.rollout_time(trace, fleet, cutoff=exact * 0.99) == math.inf
            assert cr.rollout_time(trace, fleet, cutoff=exact * 1.01) == exact


def test_the_fleet_memo_answers_as_costing_again_would():
    """`_FleetCosts` remembers each fleet's makespan across the searches of one call: every answer,
    under any cutoff and in any order (an infeasible fleet included), is what the greedy says afresh."""
    from libra.services.planner.search import _FleetCosts

    model, gpu = model_named("qwen2.5-7b"), gpu_named("h200-141g")
    eff = cr.RolloutEfficiency()
    instances = {tp: cr.instance(model, gpu, tp, eff) for tp in (1, 2, 4)}
    tp1 = instances[1].kv_capacity_tokens
    trace = _trace(5, 8, 4) + [(tp1, 10)]  # one request only TP2 or more can hold
    rng = random.Random(0)
    fleets = [((1, 2),), ((1, 4),), ((2, 1),), ((1, 2), (2, 1)), ((4, 1),)]
    fresh_of = {}
    for mix in fleets:
        try:
            fresh_of[mix] = cr.rollout_time(trace, [instances[tp] for tp, n in mix for _ in range(n)])
        except Infeasible:
            fresh_of[mix] = None
    memo = _FleetCosts(trace)
    for _ in range(200):
        mix = rng.choice(fleets)
        fresh = fresh_of[mix]
        cutoff = rng.choice([math.inf, 1.0, 1e9]) if fresh is None else fresh * rng.choice([0.5, 0.999, 1.0, 1.001, 2])
        fleet = [instances[tp] for tp, n in mix for _ in range(n)]
        try:
            expected = cr.rollout_time(trace, fleet, cutoff=cutoff)
        except Infeasible:
            expected = "infeasible"
        try:
            got = memo.seconds(mix, cutoff, instances)
        except Infeasible:
            got = "infeasible"
        assert got == expected, (mix, cutoff)


@pytest.mark.parametrize("whole", ["auto", "off"])
def test_sharing_fleet_costs_changes_no_result(monkeypatch, whole):
    """The packed and the whole-node search (and the tables per training TP) share fleet costs: the
    result, its alternatives and its rejection counts are those of costing every fleet afresh."""
    from libra.services.planner import search as search_mod

    model, gpu = model_named("qwen3-4b"), _small_node(4)
    trace = _trace(3, 8, 8)
    configs = [SearchConfig(total_gpus=16, group_size=8, whole_nodes=whole, top_k=6),
               SearchConfig(total_gpus=14, group_size=8, whole_nodes=whole, top_k=6, distinct_splits=True,
                            fleets_per_split=2)]
    shared = [search(model, gpu, trace, config) for config in configs]
    monkeypatch.setattr(search_mod._FleetCosts, "seconds", search_mod._FleetCosts.afresh)
    for config, got in zip(configs, shared):
        expected = search(model, gpu, trace, config)
        assert got.alternatives == expected.alternatives and got.best == expected.best
        assert got.rejected == expected.rejected and got.placement == expected.placement


def test_uneven_data_parallel_splits_only_where_asked():
    """A DP degree need not divide the groups on clusters of at most uneven_splits_up_to GPUs (the
    busiest replica is charged); by default, and on larger clusters, only the even splits."""
    model, gpu = model_named("qwen3-4b"), gpu_named("h100-80g")
    trace = _trace(7, 24, 8)  # 24 groups of 8
    base = dict(total_gpus=24, group_size=8, whole_nodes="off", top_k=50)
    uneven = search(model, gpu, trace, SearchConfig(**base, uneven_splits_up_to=24))
    assert any(24 % c.layout.dp for c in uneven.alternatives)  # e.g. 5 replicas: 5, 5, 5, 5 and 4 groups
    assert not any("uneven_splits_up_to" in reason for reason in uneven.rejected)
    for config in (SearchConfig(**base), SearchConfig(**base, uneven_splits_up_to=16)):
        even = search(model, gpu, trace, config)
        assert even.rejected[f"a DP replica would train more groups of 8 than another "
                             f"(uneven_splits_up_to={config.uneven_splits_up_to})"] > 0
        assert all(24 % candidate.layout.dp == 0 for candidate in even.alternatives)
