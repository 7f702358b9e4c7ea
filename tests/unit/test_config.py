"""Run config validation: every error names the field and the fix; nothing starts half-way."""

from __future__ import annotations

import subprocess
import sys

import pytest

from libra.config import build_run_config, load_run_config
from libra.errors import ConfigError


def error_of(tree, env=None) -> str:
    with pytest.raises(ConfigError) as caught:
        build_run_config(tree, env=env or {})
    return str(caught.value)


def test_defaults_and_quickstart_are_valid():
    config = build_run_config({}, env={})
    assert config.planner.buckets[0].max_tokens < config.planner.buckets[-1].max_tokens
    quick = load_run_config("configs/quickstart.yaml", env={})
    assert len(quick.planner.buckets) >= 2


def test_unknown_key_wrong_type_and_range_name_the_field():
    message = error_of({"trainer": {"lrr": 1, "steps": "many", "group_size": 1}})
    assert "trainer.lrr: unknown key" in message
    assert "trainer.steps" in message and "trainer.group_size" in message


def test_buckets_must_be_sorted_and_unique():
    buckets = [{"name": "long", "max_tokens": 900}, {"name": "short", "max_tokens": 100}]
    assert "sorted by strictly increasing max_tokens" in error_of({"planner": {"buckets": buckets}})
    twins = [{"name": "a", "max_tokens": 1}, {"name": "a", "max_tokens": 2}]
    assert "names must be unique" in error_of({"planner": {"buckets": twins}})


def test_addresses_and_redis_url_are_checked():
    assert "addresses.scheduler must be HOST:PORT" in error_of({"addresses": {"scheduler": "nowhere"}})
    assert "redis.url must start with redis://" in error_of({"redis": {"url": "http://x"}})
    assert "redis.appendfsync: Input should be 'always', 'everysec' or 'no'" in \
        error_of({"redis": {"appendfsync": "sometimes"}})


def test_environment_overrides_apply():
    config = build_run_config({}, env={"LIBRA_REDIS_URL": "redis://r:1/0", "LIBRA_PLANNER_ADDRESS": "planner:7000"})
    assert config.redis.url == "redis://r:1/0" and config.port_of("planner") == 7000


def test_model_shape_is_checked():
    assert "divisible by model.heads" in error_of({"model": {"hidden_size": 30, "heads": 4}})


def test_cli_exits_2_on_an_invalid_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  steps: -3\n")
    result = subprocess.run([sys.executable, "-m", "libra.cli", "check-config", str(bad)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "trainer.steps" in result.stderr
    missing = subprocess.run([sys.executable, "-m", "libra.cli", "up", "--config", str(tmp_path / "none.yaml")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "cannot read config" in missing.stderr


def test_control_plane_imports_without_torch_or_vllm():
    code = ("import sys; import libra.cli, libra.config, libra.services.planner.server, "
            "libra.services.scheduler.server, libra.services.elastic.server, libra.services.rollout.server, "
            "libra.services.trainer.config, libra.up, libra.status; "
            "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; print(heavy); "
            "sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_configuration_reference_is_up_to_date():
    result = subprocess.run([sys.executable, "scripts/config_docs.py", "--check"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_scheduler_policy_is_a_union_with_a_short_form():
    assert build_run_config({}, env={}).scheduler.policy.type == "load_balance"
    short = build_run_config({"scheduler": {"policy": "cmlfq"}}, {"scheduler.per_worker_cap_tokens": 9}, env={})
    assert short.scheduler.policy.type == "cmlfq" and short.scheduler.policy.min_visits == 3
    assert short.scheduler.per_worker_cap_tokens == 9
    full = build_run_config({"scheduler": {"policy": {"type": "cmlfq", "min_visits": 5}}},
                            {"scheduler.policy.max_moves": 1}, env={})
    assert (full.scheduler.policy.min_visits, full.scheduler.policy.max_moves) == (5, 1)
    assert build_run_config({}, {"scheduler.policy": "la_mlfq"}, env={}).scheduler.policy.max_history == 10_000


def test_a_setting_of_another_policy_names_its_policy_and_the_fix():
    message = error_of({"scheduler": {"policy": {"type": "load_balance", "min_visits": 5}}})
    assert "scheduler.policy.min_visits applies to scheduler.policy type cmlfq, not load_balance" in message
    assert "set scheduler.policy.type: cmlfq" in message
    message = error_of({"scheduler": {"policy": "length_aware", "max_moves": 2}})
    assert "scheduler.max_moves is a setting of policy cmlfq" in message and "scheduler.policy: {type: cmlfq" in message
    assert "scheduler.policy.type must be one of" in error_of({"scheduler": {"policy": "fifo"}})
    assert "scheduler.policy.type is required" in error_of({"scheduler": {"policy": {"min_visits": 5}}})
    assert "start_spill_factor must be 0 (off) or >= 1" in error_of(
        {"scheduler": {"policy": {"type": "cmlfq", "start_spill_factor": 0.5}}})


def test_trainer_backend_is_a_union_with_a_short_form():
    assert build_run_config({}, env={}).trainer.backend.type == "torch"
    short = build_run_config({}, {"trainer.backend": "megatron"}, env={}).trainer.backend
    assert short.type == "megatron" and short.tensor_parallel == 1 and short.distributed_optimizer
    full = build_run_config({"trainer": {"ranks": 4, "backend": {"type": "megatron", "tensor_parallel": 2}}},
                            {"trainer.backend.layer_spec": "local"}, env={}).trainer
    assert (full.backend.tensor_parallel, full.backend.layer_spec, full.ranks) == (2, "local", 4)


def test_a_megatron_setting_for_the_torch_backend_names_the_fix():
    message = error_of({"trainer": {"backend": {"type": "torch", "tensor_parallel": 2}}})
    assert "trainer.backend.tensor_parallel applies to trainer.backend type megatron, not torch" in message
    assert "trainer.megatron moved into the backend" in error_of({"trainer": {"megatron": {"tensor_parallel": 2}}})
    assert "trainer.ranks=2 needs trainer.backend: megatron" in error_of({"trainer": {"ranks": 2}})
    assert "trainer.ranks=3 is not a multiple of trainer.backend.tensor_parallel" in error_of(
        {"trainer": {"ranks": 3, "backend": {"type": "megatron", "tensor_parallel": 2}}})
