"""Prometheus scrape targets of a run: where each service's /metrics is, as a file-based service
discovery file (JSON) that deploy/monitoring/prometheus-slurm.yml reads.

    python -m libra.telemetry.targets --config RUN_DIR/logs/slurm-JOBID/config.yaml \
        --out deploy/monitoring/targets/slurm-JOBID.json

Service i serves /metrics on metrics.base_port + i (planner, scheduler, trainer, rollout,
elastic), on the host of its address (or security.listen_host when that names one interface).
On Slurm the resolved config of the job (libra.slurm.job writes it) has every address and the
base port of the job's layout. Labels: service, run, and slurm_job when SLURM_JOB_ID is set.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

from libra.config import SERVICES, RunConfig, load_run_config
from libra.errors import ConfigError

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def scrape_targets(config: RunConfig, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One file_sd entry per service with a metrics port."""
    if not config.metrics.base_port:
        raise ConfigError("metrics.base_port is 0: the services serve no metrics; set metrics.base_port (e.g. 9400)")
    entries = []
    for service in SERVICES:
        listen = config.security.listen_host
        host = config.address_of(service).rsplit(":", 1)[0] if listen in WILDCARDS else listen
        entries.append({"targets": [f"{host}:{config.metrics_port_of(service)}"],
                        "labels": {"service": service, "run": config.run_id, **(labels or {})}})
    return entries


def write_targets(config: RunConfig, out: pathlib.Path, labels: dict[str, str] | None = None) -> pathlib.Path:
    """Write the targets to `out` (replaced atomically: Prometheus may read it at any moment)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    draft = out.with_name(f".{out.name}.{os.getpid()}")
    draft.write_text(json.dumps(scrape_targets(config, labels), indent=2) + "\n")
    os.replace(draft, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libra.telemetry.targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run config (on Slurm: the job's resolved config)")
    parser.add_argument("--out", help="file to write (default: print to stdout)")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="an extra target label")
    args = parser.parse_args(argv)
    try:
        labels = {}
        for item in args.label:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"--label expects KEY=VALUE, got {item!r}")
            labels[key] = value
        if os.environ.get("SLURM_JOB_ID"):
            labels.setdefault("slurm_job", os.environ["SLURM_JOB_ID"])
        config = load_run_config(args.config)
        if args.out:
            print(f"targets: {write_targets(config, pathlib.Path(args.out), labels)}")
        else:
            print(json.dumps(scrape_targets(config, labels), indent=2))
    except ConfigError as error:
        print(f"libra.telemetry.targets: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
