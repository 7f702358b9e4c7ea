"""Seeing a run: what the services record as they go, and what is made of it afterwards.

- `config`: the run config's `telemetry:` section.
- `recorder`, `sinks`: one service's records to the run record (RUN_DIR/telemetry/<service>.jsonl),
  TensorBoard (RUN_DIR/tensorboard/<service>/) and optionally Weights & Biases. Each service's
  probe (services/<name>/telemetry.py) decides what it records; this package knows no service.
- `record`, `charts`, `report`: `libra report RUN_DIR`, one self-contained HTML page from the run record.
- `targets`: Prometheus scrape targets of a run (Slurm: where each service's metrics port is).

Kept import-light: `libra.config` imports `telemetry.config`, and the control plane never needs
matplotlib or tensorboard to start.
"""
