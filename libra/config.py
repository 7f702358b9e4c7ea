"""The run config: one YAML file composing the five services' typed configs.

Load it with `load_run_config(path, overrides)`; any error raises `ConfigError` whose message names
the field and the fix (the CLI turns it into exit code 2). Environment overrides:
`LIBRA_REDIS_URL`, `LIBRA_RUN_ID`, `LIBRA_RUN_DIR`, `LIBRA_LISTEN_HOST` (security.listen_host), and
`LIBRA_<SERVICE>_ADDRESS` for peers. The run's token comes from `LIBRA_TOKEN` (libra.security).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Literal, Mapping

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from libra.configbase import Section, check_address
from libra.errors import ConfigError
from libra.model_config import ModelConfig
from libra.security.config import SecurityConfig
from libra.services.elastic.config import ElasticConfig
from libra.services.planner.config import PlannerConfig
from libra.services.rollout.config import RolloutConfig
from libra.services.scheduler.config import SchedulerConfig
from libra.services.trainer.config import TrainerConfig
from libra.telemetry.config import TelemetryConfig
from libra.weights.config import DiskWeights, WeightsConfig
from libra.workloads.config import CalculatorConfig, WorkloadConfig

SERVICES = ("planner", "scheduler", "trainer", "rollout", "elastic")


class RedisConfig(Section):
    """Where state lives. Empty url: `libra up` starts a private redis-server."""

    url: str = Field("", description="redis://HOST:PORT/DB; empty lets `libra up` start its own")
    appendfsync: Literal["always", "everysec", "no"] = Field(
        "always", description="the append-only file's fsync policy of the Redis that Libra starts (`libra up`, "
        "the Slurm job): always (every acknowledged write is on disk before the reply), everysec (a machine "
        "crash, or a killed redis-server while the disk is slow, can lose up to 2 s), no (the kernel writes back)")

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis.url must start with redis://, rediss:// or unix://, got {value!r}")
        return value


class Addresses(Section):
    """gRPC address (HOST:PORT) of every service; each service listens on its own port."""

    planner: str = Field("127.0.0.1:50051", description="planner address")
    scheduler: str = Field("127.0.0.1:50052", description="scheduler address")
    rollout: str = Field("127.0.0.1:50053", description="rollout gateway address")
    trainer: str = Field("127.0.0.1:50054", description="trainer address")
    elastic: str = Field("127.0.0.1:50055", description="elastic coordinator address")

    @field_validator(*SERVICES)
    @classmethod
    def _address(cls, value: str, info: Any) -> str:
        return check_address(value, f"addresses.{info.field_name}")


class MetricsConfig(Section):
    """Prometheus endpoints: service i serves /metrics on base_port + i (0 disables)."""

    base_port: int = Field(9400, ge=0, le=65000, description="first metrics port (0: no metrics servers)")


class UpConfig(Section):
    """How `libra up` starts the services on one machine (libra/up.py)."""

    zygote: bool = Field(True, description="fork the five services from one process that imported their modules "
                                           "once (libra/zygote.py: ~0.6 CPU-s less start-up each, pages shared); "
                                           "false: each service a fresh interpreter")


class RunConfig(Section):
    """Everything one run needs; every service reads the same file."""

    run_id: str = Field("quickstart", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                        description="names the run; Redis keys are libra:{run_id}:...")
    run_dir: str = Field("runs/quickstart", min_length=1, description="directory for weights, checkpoints, logs, plots")
    seed: int = Field(0, ge=0, description="global seed")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="the asyncio event loop of every service and hf engine (libra/event_loop.py): auto "
        "(uvloop where installed, else asyncio's own), uvloop (its absence fails the start), asyncio")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="state store")
    addresses: Addresses = Field(default_factory=Addresses, description="service addresses")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Prometheus metrics")
    up: UpConfig = Field(default_factory=UpConfig, description="how libra up starts the services")
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig,
                                       description="run record, TensorBoard and W&B (docs/observability.md)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="policy model")
    workload: WorkloadConfig = Field(default_factory=CalculatorConfig, description="agentic workload")
    planner: PlannerConfig = Field(default_factory=PlannerConfig, description="planner service")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="scheduler service")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout service")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="trainer service")
    elastic: ElasticConfig = Field(default_factory=ElasticConfig, description="elastic coordinator")
    weights: WeightsConfig = Field(default_factory=DiskWeights,
                                   description="how policy versions reach the rollout workers: disk, group or "
                                               "colocated")
    security: SecurityConfig = Field(default_factory=SecurityConfig,
                                     description="token, TLS, listen interface and request bounds")

    @field_validator("event_loop")
    @classmethod
    def _event_loop(cls, value: str) -> str:
        from libra import event_loop

        if value == "uvloop" and not event_loop.available():
            raise ValueError("event_loop: uvloop, but uvloop is not installed here; pip install uvloop, or set "
                             "event_loop: auto (asyncio's own loop where uvloop is missing)")
        return value

    @model_validator(mode="after")
    def _packing_budget(self) -> "RunConfig":
        tokens, longest = self.trainer.micro_batch_tokens, self.rollout.max_total_tokens
        if tokens and tokens < longest:
            raise ValueError(f"trainer.micro_batch_tokens={tokens} cannot hold a trajectory of "
                             f"rollout.max_total_tokens={longest}; raise micro_batch_tokens to at least {longest} "
                             "(or 0: padded micro-batches)")
        return self

    @model_validator(mode="after")
    def _weights_backend(self) -> "RunConfig":
        engine = self.rollout.worker.engine
        if self.weights.type == "group" and self.weights.backend == "nccl" and engine.type == "hf" \
                and engine.device == "cpu":
            raise ValueError("weights.backend nccl needs GPU workers; set rollout.worker.engine.device: cuda "
                             "or weights.backend: gloo")
        if self.weights.type == "colocated":
            self._check_colocated()
        return self

    def _check_colocated(self) -> None:
        """weights: colocated — the Megatron trainer (rank 0 on GPU 0) and hf engines on that GPU, one dtype."""
        from libra.weights.ipc import NEEDS

        engine, backend = self.rollout.worker.engine, self.trainer.backend
        if engine.type != "hf" or engine.device not in ("cuda", "cuda:0"):
            raise ValueError(f"{NEEDS}: set rollout.worker.engine: {{type: hf, device: cuda:0}} (the trainer's "
                             "rank 0 runs on GPU 0)")
        if backend.type != "megatron":
            raise ValueError(f"{NEEDS}: set trainer.backend: megatron (the torch backend trains on the CPU in the "
                             "trainer service)")
        dtype = "bfloat16" if backend.bf16 else "float32"
        if self.rollout.worker.dtype != dtype:
            raise ValueError(f"weights: colocated hands the engines the trainer's {dtype} tensors as they are: set "
                             f"rollout.worker.dtype: {dtype}")

    @property
    def run_path(self) -> pathlib.Path:
        return pathlib.Path(self.run_dir).resolve()

    def address_of(self, service: str) -> str:
        return getattr(self.addresses, service)

    def port_of(self, service: str) -> int:
        return int(self.address_of(service).rsplit(":", 1)[1])

    def listen_host_of(self, service: str) -> str:
        """The interface `service` (and its metrics) listens on: security.listen_host, else the host
        of its own address."""
        return self.security.listen_host or self.address_of(service).rsplit(":", 1)[0]

    def metrics_port_of(self, service: str) -> int:
        return self.metrics.base_port + SERVICES.index(service) if self.metrics.base_port else 0


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        if isinstance(node.get(key), str):  # a union's short form (`weights: group`): {type: group}
            node[key] = {"type": node[key]}
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted}: {key} is not a section")
    node[keys[-1]] = value


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if env.get("LIBRA_REDIS_URL"):
        found["redis.url"] = env["LIBRA_REDIS_URL"]
    if env.get("LIBRA_RUN_ID"):
        found["run_id"] = env["LIBRA_RUN_ID"]
    if env.get("LIBRA_RUN_DIR"):
        found["run_dir"] = env["LIBRA_RUN_DIR"]
    if env.get("LIBRA_LISTEN_HOST"):
        found["security.listen_host"] = env["LIBRA_LISTEN_HOST"]
    for service in SERVICES:
        value = env.get(f"LIBRA_{service.upper()}_ADDRESS")
        if value:
            found[f"addresses.{service}"] = value
    return found


def format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "(top level)"
        kind = item["type"]
        if kind == "extra_forbidden":
            fix = "remove it or check its spelling (see docs/configuration.md)"
            lines.append(f"  {field}: unknown key; {fix}")
            continue
        got = item.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        lines.append(f"  {field}: {item['msg']}{shown}")
    return "\n".join(lines)


def build_run_config(tree: Mapping[str, Any], overrides: Mapping[str, Any] | None = None,
                     env: Mapping[str, str] | None = None, source: str = "<dict>") -> RunConfig:
    """Validate a config tree with overrides applied (env first, then explicit overrides)."""
    data = yaml.safe_load(yaml.safe_dump(dict(tree)))  # deep copy of plain data
    for dotted, value in {**_env_overrides(os.environ if env is None else env), **(overrides or {})}.items():
        _set_path(data, dotted, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source)) from None


def load_run_config(path: str | os.PathLike[str] | None, overrides: Mapping[str, Any] | None = None,
                    env: Mapping[str, str] | None = None) -> RunConfig:
    """Read a YAML run config (None: all defaults) and validate it."""
    tree: Any = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = pathlib.Path(path).read_text()
        except OSError as error:
            raise ConfigError(f"cannot read config {path}: {error.strerror}; pass an existing YAML file") from None
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"config {path} is not valid YAML: {error}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level, got {type(tree).__name__}")
    return build_run_config(tree, overrides, env, source)
