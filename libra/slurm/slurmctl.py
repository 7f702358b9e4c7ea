"""What a Libra job asks Slurm and tells it, through Slurm's own commands (scontrol, squeue, sinfo,
scancel), and the parsing of their output. Must not know: roles, services, layouts.
"""

from __future__ import annotations

import subprocess

from libra.slurm.layout import Node


class SlurmError(RuntimeError):
    """A Slurm command failed where the job cannot go on without its answer."""


def run(argv: list[str], check: bool = True) -> str:
    """A Slurm command's output; SlurmError when it fails and `check`."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and done.returncode:
        raise SlurmError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[:500]}")
    return done.stdout


def job_nodes(nodelist: str) -> tuple[Node, ...]:
    """The job's nodes with their NodeAddr, CPUs and GPUs."""
    names = run(["scontrol", "show", "hostnames", nodelist]).split()
    return parse_nodes(names, run(["scontrol", "show", "node", "-o", ",".join(names)]))


def parse_nodes(names: list[str], show_node: str) -> tuple[Node, ...]:
    """`scontrol show node -o` (one line per node) as Nodes, in the order of `names`."""
    records = {}
    for line in show_node.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        records[fields.get("NodeName", "")] = fields
    nodes = []
    for name in names:
        fields = records.get(name, {})
        gpus = 0
        for part in fields.get("Gres", "").split(","):  # gpu:8, gpu:h200:8, gpu:8(S:0-1)
            count = part.split("(")[0].rsplit(":", 1)[-1]
            gpus += int(count) if part.startswith("gpu") and count.isdigit() else 0
        nodes.append(Node(name, fields.get("NodeAddr", name), int(fields.get("CPUTot", "1")), gpus))
    return tuple(nodes)


def kill_wait() -> float:
    """Slurm's KillWait: seconds between the SIGTERM and the SIGKILL of a job's processes."""
    for line in run(["scontrol", "show", "config"], check=False).splitlines():
        if line.split("=")[0].strip() == "KillWait":
            digits = "".join(ch for ch in line.split("=", 1)[1] if ch.isdigit())
            return float(digits or 30)
    return 30.0


def job_state(job_id: str) -> tuple[str, float]:
    """The job's state (RUNNING, COMPLETING, …; "" when unknown) and its seconds left."""
    fields = run(["squeue", "-h", "-j", job_id, "-o", "%T %L"], check=False).split()
    return (fields[0] if fields else "", seconds(fields[1]) if len(fields) > 1 else float("inf"))


def seconds(left: str) -> float:
    """squeue's %L ("1-02:03:04", "2:03:04", "3:04", "UNLIMITED") in seconds."""
    if not left or not left[0].isdigit():
        return float("inf")
    days, _, clock = left.rpartition("-")
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return total + int(days or 0) * 86400


def down_nodes(names: list[str]) -> list[str]:
    """Those of `names` that Slurm holds down or failing."""
    listing = run(["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N %T"], check=False)
    return sorted({line.split()[0] for line in listing.splitlines() if len(line.split()) == 2
                   and line.split()[1].rstrip("*~#!%$@^-").lower() in ("down", "fail", "failing")})


def step_ids(job_id: str, name: str) -> list[str]:
    """The running steps (JOB.STEP) of the job named `name`."""
    listing = run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], check=False)
    return [line.split()[0] for line in listing.splitlines() if line.split()[1:] == [name]]


def signal_step(step_id: str, signal_name: str | None) -> None:
    """Send a signal to a step's tasks (None: cancel the step)."""
    run(["scancel", *([f"--signal={signal_name}"] if signal_name else []), step_id], check=False)


def set_comment(job_id: str, comment: str) -> None:
    run(["scontrol", "update", f"JobId={job_id}", f"Comment={comment[:250]}"], check=False)


def requeue(job_id: str) -> None:
    run(["scontrol", "requeue", job_id], check=False)


def cancel(job_id: str) -> None:
    run(["scancel", job_id], check=False)
