"""What can be checked before a run starts, so a bad config fails at once (exit 2, the field named)
instead of once the services start: `libra check-config` runs every check, `libra up` all but the
service ports (it holds those itself, libra/up.py).

- `model.path` (model.source: path): a directory with a config.json;
- the workload's data: readable, with at least one valid row (building the workload reads it);
- ports on this machine: each service's (`addresses.<service>`), the engine workers'
  (`rollout.worker.base_port` + i for the plan's replicas) and the metrics ports
  (`metrics.base_port` + i) are free. An address on another host (compose, Slurm) is not checked.

Must not know how a service uses what it checks.
"""

from __future__ import annotations

import errno
import pathlib
import socket

from libra.config import SERVICES, RunConfig
from libra.errors import ConfigError, LibraError


def check_model(config: RunConfig) -> None:
    if config.model.source != "path":
        return
    path = pathlib.Path(config.model.path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json (not a Hugging Face model directory)"
        raise ConfigError(f"model.path: {path} {what} (relative to {pathlib.Path.cwd()}); point model.path at a "
                          f"model directory, or use model.source: tiny")


def check_workload(config: RunConfig) -> None:
    from libra.workloads.base import build_workload

    try:
        workload = build_workload(config.workload)
        count = workload.num_prompts
    except ConfigError:
        raise  # names its field already (workload.data, workload.tasks, ...)
    except (LibraError, ValueError, OSError) as error:
        raise ConfigError(f"workload ({config.workload.name}): {error}") from None
    if count < 1:
        raise ConfigError(f"workload ({config.workload.name}): no prompts; check its data file")


def port_in_use(host: str, port: int) -> bool:
    """True when `host:port` is taken on this machine; False when free or `host` is not this machine's."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle
        try:
            sock.bind((host or "0.0.0.0", port))
        except socket.gaierror:
            return False  # a name this machine cannot resolve: another host's
        except OSError as error:
            return error.errno == errno.EADDRINUSE  # EADDRNOTAVAIL: not an address of this machine
    return False


def wanted_ports(config: RunConfig, services: bool = True) -> list[tuple[str, str, int]]:
    """(field, host, port) of every port the run will listen on here."""
    wanted = []
    if services:
        wanted += [(f"addresses.{s}", config.listen_host_of(s), config.port_of(s)) for s in SERVICES]
    if config.metrics.base_port:
        wanted += [("metrics.base_port", config.listen_host_of(s), config.metrics_port_of(s)) for s in SERVICES]
    worker = config.rollout.worker
    if worker.base_port:
        replicas = sum(bucket.replicas for bucket in config.planner.buckets)
        wanted += [("rollout.worker.base_port", worker.host, worker.base_port + i) for i in range(replicas)]
    return wanted


def check_ports(config: RunConfig, services: bool = True) -> None:
    for field, host, port in wanted_ports(config, services):
        if port_in_use(host, port):
            raise ConfigError(f"{field}: port {port} on {host or '0.0.0.0'} is in use (a running job? another "
                              f"program?); stop what holds it or choose another port in {field}")


def check_weights(config: RunConfig) -> None:
    """weights: colocated needs a CUDA device on this machine (the trainer's, shared with the engines)."""
    if config.weights.type == "colocated":
        from libra.weights.ipc import check_cuda

        try:
            check_cuda()
        except LibraError as error:
            raise ConfigError(str(error)) from None


def check_before_start(config: RunConfig, ports: bool = True) -> None:
    """Every check above; `ports=False` leaves out the services' own ports (libra up holds them)."""
    check_model(config)
    check_workload(config)
    check_weights(config)
    check_ports(config, services=ports)
