"""The `weights:` section and `rollout.worker.engine`: unions on `type`, with a short form, where a
setting the chosen variant ignores cannot be written (the error names the variant it belongs to)."""

from __future__ import annotations

import pytest

from libra.config import build_run_config
from libra.errors import ConfigError


def error_of(tree, overrides=None) -> str:
    with pytest.raises(ConfigError) as caught:
        build_run_config(tree, overrides, env={})
    return str(caught.value)


def test_weights_default_to_disk_and_take_the_short_form():
    assert build_run_config({}, env={}).weights.type == "disk"
    group = build_run_config({"weights": "group"}, env={}).weights
    assert (group.type, group.backend, group.bucket_mb, group.disk_every) == ("group", "gloo", 256, 1)
    assert build_run_config({"weights": "disk"}, {"weights": "group"}, env={}).weights.type == "group"  # --set
    tuned = build_run_config({"weights": "disk"}, {"weights.type": "group", "weights.bucket_mb": 8}, env={}).weights
    assert (tuned.type, tuned.bucket_mb) == ("group", 8)  # --set into a section written in the short form
    full = build_run_config({"weights": {"type": "group", "address": "10.0.0.2:29700", "backend": "nccl",
                                         "bucket_mb": 64, "sync_timeout_s": 30, "disk_every": 4}}, env={}).weights
    assert (full.address, full.backend, full.bucket_mb, full.sync_timeout_s, full.disk_every) == (
        "10.0.0.2:29700", "nccl", 64, 30.0, 4)


def test_a_setting_of_another_weights_type_cannot_be_written():
    assert ("weights.bucket_mb applies to weights type group, not disk; remove it or set weights.type: group"
            in error_of({"weights": {"bucket_mb": 8}}))
    assert "weights.bucket_mb applies to weights type group, not disk" in error_of(
        {"weights": {"type": "disk", "bucket_mb": 8}})
    assert "weights.type must be one of ['colocated', 'disk', 'group'], got 'nfs'" in error_of({"weights": "nfs"})
    assert "weights.group.colour: unknown key" in error_of({"weights": {"type": "group", "colour": 1}})
    assert "weights.address must be HOST:PORT" in error_of({"weights": {"type": "group", "address": "nowhere"}})
    assert "weights.backend nccl needs GPU workers" in error_of(
        {"weights": {"type": "group", "backend": "nccl"}, "rollout": {"worker": {"engine": "hf"}}})
    assert build_run_config({"weights": {"type": "group", "backend": "nccl"},
                             "rollout": {"worker": {"engine": {"type": "hf", "device": "cuda:1"}}}}, env={})


def test_engine_is_a_union_and_hf_settings_cannot_be_written_for_vllm():
    worker = build_run_config({}, env={}).rollout.worker
    assert (worker.engine.type, worker.engine.kv_cache_gib) == ("vllm", 0.25)
    hf = build_run_config({"rollout": {"worker": {"engine": "hf"}}}, env={}).rollout.worker.engine
    assert (hf.type, hf.device) == ("hf", "cpu")
    assert build_run_config({}, {"rollout.worker.engine": "hf"}, env={}).rollout.worker.engine.type == "hf"
    assert "rollout.worker.engine.device applies to rollout.worker.engine type hf, not vllm" in error_of(
        {"rollout": {"worker": {"engine": {"type": "vllm", "device": "cuda"}}}})
    assert "rollout.worker.engine.kv_cache_gib applies to rollout.worker.engine type vllm, not hf" in error_of(
        {"rollout": {"worker": {"engine": {"type": "hf", "kv_cache_gib": 1}}}})
    assert "rollout.worker.engine.hf.device" in error_of(
        {"rollout": {"worker": {"engine": {"type": "hf", "device": "tpu"}}}})


def test_the_keys_that_moved_say_where_to():
    assert "rollout.worker.weight_sync moved: write weights: disk | group" in error_of(
        {"rollout": {"worker": {"weight_sync": "group"}}})
    assert "rollout.worker.weights_bucket_mb moved: write weights.bucket_mb" in error_of(
        {"rollout": {"worker": {"weights_bucket_mb": 8}}})
    assert "rollout.worker.device moved: write rollout.worker.engine: {type: hf, device: ...}" in error_of(
        {"rollout": {"worker": {"engine": "hf", "device": "cuda"}}})
