"""The planner's cost model: specs and loaders, the rollout instance model, training steps, and
mixture-of-experts models (active parameters for compute, total for memory)."""

from __future__ import annotations

import math
import random

import pytest

from libra.errors import ConfigError
from libra.services.planner import cost_rollout as cr
from libra.services.planner import cost_train as ct
from libra.services.planner.cost_rollout import Infeasible, RolloutEfficiency
from libra.services.planner.cost_train import Layout, TrainEfficiency
from libra.services.planner.hardware import gpu_named, load_gpu, load_model, model_named

EFF = RolloutEfficiency()
TRAIN = TrainEfficiency()
MODELS = ["qwen2.5-3b", "qwen2.5-7b", "qwen3-4b", "qwen3-14b", "qwen3-30b-a3b"]
GPUS = ["a100-80g", "a800-80g", "h100-80g", "h200-141g"]


@pytest.mark.parametrize("name,total,active", [
    ("qwen2.5-3b", 3.09e9, 3.09e9), ("qwen2.5-7b", 7.61e9, 7.61e9), ("qwen3-4b", 4.0e9, 4.0e9),
    ("qwen3-14b", 14.8e9, 14.8e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9)])
def test_parameter_counts_match_the_published_sizes(name, total, active):
    model = model_named(name)
    assert model.total_params == pytest.approx(total, rel=0.02)
    assert model.active_params == pytest.approx(active, rel=0.03)
    assert model.source


def test_every_hardware_file_loads_and_cites_a_source():
    for name in GPUS:
        gpu = gpu_named(name)
        assert gpu.source and gpu.gpus_per_node == 8 and gpu.memory_gib >= 79


def test_loader_names_the_bad_field(tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text("name: x\nmemory_gib: -1\nhbm_gbps: 1\nbf16_tflops: 1\nnvlink_gbps: 1\ninternode_gbps: 1\n")
    with pytest.raises(ConfigError, match="memory_gib"):
        load_gpu(path)
    path.write_text((tmp_path / "gpu.yaml").read_text().replace("-1", "80") + "colour: green\n")
    with pytest.raises(ConfigError, match="colour"):
        load_gpu(path)
    path.write_text("name: m\nhidden_size: 64\nlayers: 2\nheads: 6\nkv_heads: 4\nhead_dim: 16\n"
                    "intermediate_size: 128\nvocab_size: 100\n")
    with pytest.raises(ConfigError, match="kv_heads"):
        load_model(path)


@pytest.mark.parametrize("model_name", MODELS)
def test_doubling_tp_at_most_halves_kv_bytes_per_token_per_gpu(model_name):
    """Tokens per byte of cache at most double with TP; past kv_heads, heads replicate (no gain)."""
    model = model_named(model_name)
    gpu = gpu_named("h200-141g")
    sizes = {tp: cr.instance(model, gpu, tp, EFF) for tp in (1, 2, 4, 8) if model.heads % tp == 0}
    for tp, inst in sizes.items():
        if 2 * tp in sizes:
            wider = sizes[2 * tp]
            assert wider.kv_bytes_per_token_per_gpu >= inst.kv_bytes_per_token_per_gpu / 2
            if 2 * tp > model.kv_heads:
                assert wider.kv_bytes_per_token_per_gpu == inst.kv_bytes_per_token_per_gpu
            free = lambda i: i.kv_capacity_tokens * i.kv_bytes_per_token_per_gpu * i.tp  # cache bytes
            assert wider.kv_capacity_tokens / free(wider) <= 2 * inst.kv_capacity_tokens / free(inst) + 1e-12


def test_raw_capacity_can_more_than_double_because_weights_shrink_too():
    """Why the test above normalises by cache bytes: TP also frees the weights' memory."""
    model, gpu = model_named("qwen3-14b"), gpu_named("a100-80g")
    one, two = cr.instance(model, gpu, 1, EFF), cr.instance(model, gpu, 2, EFF)
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens
    assert two.weight_bytes_per_gpu == pytest.approx(one.weight_bytes_per_gpu / 2)


def test_tp_degrees_the_heads_or_node_cannot_take_are_infeasible():
    gpu = gpu_named("h100-80g")
    with pytest.raises(Infeasible, match="attention heads"):
        cr.instance(model_named("qwen2.5-7b"), gpu, 8, EFF)  # 28 heads
    with pytest.raises(Infeasible, match="node"):
        cr.instance(model_named("qwen3-14b"), gpu, 16, EFF)


def test_prefill_scales_with_tp_and_decode_gets_faster():
    model, gpu = model_named("qwen3-14b"), gpu_named("h100-80g")
    one, four = cr.instance(model, gpu, 1, EFF), cr.instance(model, gpu, 4, EFF)
    assert four.prefill_seconds(2000) == pytest.approx(one.prefill_seconds(2000) / 4)
    assert four.decode_step_seconds(32, 32 * 2000) < one.decode_step_seconds(32, 32 * 2000)
    assert one.decode_step_seconds(64, 64 * 2000) > one.decode_step_seconds(8, 8 * 2000)


def _trace(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(rng.randint(16, 4000), int(rng.lognormvariate(6.0, 1.2)) + 1) for _ in range(n)]


@pytest.mark.parametrize("model_name,gpu_name", [("qwen3-14b", "h200-141g"), ("qwen3-30b-a3b", "h100-80g")])
def test_more_instances_never_increase_makespan(model_name, gpu_name):
    model, gpu = model_named(model_name), gpu_named(gpu_name)
    kinds = {tp: cr.instance(model, gpu, tp, EFF) for tp in (1, 2, 4, 8)}
    for seed in range(40):
        rng = random.Random(seed)
        trace = _trace(rng, rng.randint(1, 120))
        fleet = [kinds[rng.choice((1, 2, 4, 8))] for _ in range(rng.randint(1, 5))]
        before = cr.rollout_time(trace, fleet, allow_idle=True)
        after = cr.rollout_time(trace, fleet + [kinds[rng.choice((1, 2, 4, 8))]], allow_idle=True)
        assert after <= before * (1 + 1e-12), (seed, before, after)
        assert cr.rollout_time(trace, fleet) >= before  # the plain greedy is one of the sub-fleets


def test_an_oversize_request_is_infeasible_and_goes_where_it_fits():
    model, gpu = model_named("qwen3-14b"), gpu_named("a100-80g")
    one, eight = cr.instance(model, gpu, 1, EFF), cr.instance(model, gpu, 8, EFF)
    huge = (1000, one.kv_capacity_tokens)  # fits a TP8 instance, not a TP1 one
    with pytest.raises(Infeasible, match="fits the KV cache of no instance"):
        cr.rollout_time([huge], [one, one])
    assert cr.rollout_time([huge, (100, 100)], [one, eight]) > 0
    with pytest.raises(Infeasible):
        cr.rollout_time([(10, eight.kv_capacity_tokens)], [one, eight])


def test_rollout_cutoff_aborts_and_weights_that_do_not_fit_are_infeasible():
    model, gpu = model_named("qwen3-14b"), gpu_named("h100-80g")
    inst = cr.instance(model, gpu, 1, EFF)
    full = cr.rollout_time([(500, 2000)] * 10, [inst])
    assert cr.rollout_time([(500, 2000)] * 10, [inst], cutoff=full / 2) == math.inf
    with pytest.raises(Infeasible, match="no room"):
        cr.instance(model_named("qwen3-30b-a3b"), gpu_named("a100-80g"), 1, RolloutEfficiency(memory_fraction=0.7))


def test_training_step_time_falls_with_more_replicas_and_micro_batches():
    model, gpu = model_named("qwen3-14b"), gpu_named("h200-141g")
    times = [ct.step_time(model, gpu, Layout(4, 2, dp, 1), 512, 4000, TRAIN).seconds for dp in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    few = ct.step_time(model, gpu, Layout(4, 4, 2, 16), 512, 4000, TRAIN)
    many = ct.step_time(model, gpu, Layout(4, 4, 2, 1), 512, 4000, TRAIN)
    assert many.bubble < few.bubble and many.micro_batches == 256
    assert many.bubble == pytest.approx(3 / (256 + 3))


def test_training_memory_check():
    model, gpu = model_named("qwen3-14b"), gpu_named("a100-80g")
    with pytest.raises(Infeasible, match="GiB per GPU"):
        ct.step_time(model, gpu, Layout(1, 1, 1, 1), 64, 2000, TRAIN)  # 16 bytes/param unsharded
    fits = ct.step_time(model, gpu, Layout(4, 2, 4, 1), 64, 2000, TRAIN)
    assert fits.memory_gib < gpu.memory_gib
    base = ct.memory_bytes(model, Layout(2, 2, 2, 2), 4000, TRAIN)
    assert ct.memory_bytes(model, Layout(2, 2, 4, 2), 4000, TRAIN) < base  # optimizer shards over DP
    assert ct.memory_bytes(model, Layout(2, 2, 2, 4), 4000, TRAIN) > base  # activations and logits
    assert ct.memory_bytes(model, Layout(4, 2, 2, 2), 4000, TRAIN) < base


def test_an_uneven_data_parallel_split_costs_its_busiest_replica():
    """Whole GRPO groups, as even as their count allows (the trainer's data_parallel_shard): 8 groups
    of 8 on 3 replicas train 3, 3 and 2 groups, so the step takes as long as 9 groups' would."""
    model, gpu = model_named("qwen3-4b"), gpu_named("h100-80g")
    assert ct.busiest_replica(64, 3, 8) == 24 and ct.busiest_replica(64, 4, 8) == 16 and ct.busiest_replica(64, 3) == 22
    uneven = ct.step_time(model, gpu, Layout(1, 1, 3, 1), 64, 1000, TRAIN, group_size=8)
    padded = ct.step_time(model, gpu, Layout(1, 1, 3, 1), 72, 1000, TRAIN, group_size=8)
    assert uneven.seconds == pytest.approx(padded.seconds, rel=1e-12) and uneven.micro_batches == 24
    even = ct.step_time(model, gpu, Layout(1, 1, 4, 1), 64, 1000, TRAIN, group_size=8)
    assert even.seconds < uneven.seconds
    three = ct.step_time(model, gpu, Layout(1, 1, 4, 3), 64, 1000, TRAIN, group_size=8)  # 16 a replica: 6 micro
    assert three.micro_batches == 6
    with pytest.raises(Infeasible, match="dp 9 exceeds the batch's 8 GRPO groups of 8"):
        ct.step_time(model, gpu, Layout(1, 1, 9, 1), 64, 1000, TRAIN, group_size=8)
    with pytest.raises(Infeasible, match="not whole GRPO groups of 8"):
        ct.step_time(model, gpu, Layout(1, 1, 2, 1), 60, 1000, TRAIN, group_size=8)
    with pytest.raises(Infeasible, match="micro_batch 32 exceeds a replica's 16 sequences"):
        ct.step_time(model, gpu, Layout(1, 1, 4, 32), 64, 1000, TRAIN, group_size=8)


@pytest.mark.parametrize("model_name,tp,overheads", [("qwen3-14b", 1, False), ("qwen3-14b", 4, False),
                                                      ("qwen3-30b-a3b", 2, False), ("qwen3-14b", 4, True)])
def test_finish_estimate_uses_the_documented_step_time(model_name, tp, overheads):
    eff = EFF.model_copy(update={"step_overhead_s": 0.003, "step_per_seq_s": 0.0002}) if overheads else EFF
    inst = cr.instance(model_named(model_name), gpu_named("h100-80g"), tp, eff)
    alone = cr.rollout_time([(800, 1000)], [inst])  # one request: the finish estimate itself
    expected = inst.prefill_seconds(800) + 1000 * inst.decode_step_seconds(1, 1300)
    assert alone == pytest.approx(expected, rel=1e-12)
    if overheads:  # the calibrated overheads are in every step, the closed form's and the instance's
        plain = cr.instance(model_named(model_name), gpu_named("h100-80g"), tp, EFF)
        assert expected - plain.prefill_seconds(800) - 1000 * plain.decode_step_seconds(1, 1300) == \
            pytest.approx(1000 * 0.0032, rel=1e-9)


def test_planner_costs_moe_compute_by_active_and_memory_by_total_parameters():
    """Qwen3-30B-A3B against a dense model of its active size (each layer's routed MLP as one MLP of
    width k · moe_intermediate, no router): training and prefill compute scale with the active
    parameters; weights, gradients, optimizer states and the rollout's weight reads with the total."""
    moe = model_named("qwen3-30b-a3b")
    dense = moe.model_copy(update={"name": "dense-a3b", "experts": 0, "active_experts": 0,
                                   "intermediate_size": moe.active_experts * moe.intermediate_size})
    router = moe.layers * moe.hidden_size * moe.experts
    assert moe.active_params == dense.active_params + router == pytest.approx(3.3e9, rel=0.03)
    assert moe.total_params == pytest.approx(30.5e9, rel=0.02) and dense.total_params == dense.active_params
    gpu, eff = gpu_named("h200-141g"), ct.TrainEfficiency()
    layout = ct.Layout(tp=2, pp=2, dp=2, micro_batch=1)
    a, b = (ct.step_time(m, gpu, layout, 16, 2048, eff) for m in (moe, dense))
    assert a.compute_s / b.compute_s == pytest.approx(moe.active_params / dense.active_params, rel=1e-12)
    per_param = (moe.bytes_per_param + 4.0 + 12.0 / layout.dp) / (layout.tp * layout.pp)  # weights, grads, Adam
    grown = ct.memory_bytes(moe, layout, 2048, eff) - ct.memory_bytes(dense, layout, 2048, eff)
    assert grown == pytest.approx((moe.total_params - dense.total_params) * per_param, rel=1e-12)
    rollout = cr.RolloutEfficiency()
    one, other = cr.instance(moe, gpu, 2, rollout), cr.instance(dense, gpu, 2, rollout)
    assert one.weight_bytes_per_gpu == pytest.approx(moe.total_params * moe.bytes_per_param / 2)
    assert one.prefill_seconds(4096) / other.prefill_seconds(4096) == pytest.approx(
        moe.active_params / dense.active_params, rel=1e-12)
    # A decode step of one sequence reads the dense weights and its k experts; a large batch, all of them.
    assert one.decode_step_seconds(1, 0) < one.decode_step_seconds(4096, 0)
    assert cr._expert_read_fraction(moe, 100_000) == pytest.approx(1.0)
