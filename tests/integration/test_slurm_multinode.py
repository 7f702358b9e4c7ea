"""deploy/slurm/libra.sbatch on a real multi-node Slurm: three nodes on this machine, each in its own
network namespace with its own address (scripts/slurm_netns_cluster.sh: 127.x addresses, a
private bridge, one slurmd per namespace, two fake GPUs per node that Slurm binds like real ones).

1. The quickstart's parts on their nodes: Redis and the control services on node0, the trainer's
   two ranks (Megatron, data-parallel) one on node0 and one on node1, meeting through Slurm's
   tasks and MASTER_ADDR; the rollout gateway on node2, its two workers each an srun step there
   with a GPU of its own; every policy version after the first over the weights group, whose
   store the trainer hosts on node0. The job finishes, every step exits 0, Redis stops last.
2. A service that crashes (the scheduler, SIGKILL) is started again as a new step and training
   goes on. `scancel -b -s TERM` in the middle of training (what the time limit's --signal does):
   the services stop one at a time in order (trainer first: it checkpoints), Redis last; the job
   ends CANCELLED with the reason in its Comment. Submitted again, it resumes from that checkpoint
   (and Redis from its AOF) and finishes.

Skips with the reason where it cannot run: not root, no `ip`, no Slurm or munge binaries
(apt-get install slurm-wlm slurmctld slurmd slurm-client munge), namespaces not allowed.
By hand: docs/deploy.md ("Several nodes on one machine").
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm_netns_cluster.sh"
SMALL = ("--set rollout.worker.engine=hf --set trainer.warmup.steps=4 --set trainer.groups_per_step=2 "
         "--set trainer.group_size=4")


def why_not() -> str:
    """Why the cluster cannot be made here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd, munged)"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "needs iproute2 (ip) and util-linux (nsenter)"
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(b) is None
               and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"no {', '.join(missing)}: apt-get install slurm-wlm slurmctld slurmd slurm-client munge"
    probe = f"libra-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"network namespaces cannot be created here: ip netns add: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


class Cluster:
    def __init__(self, directory: pathlib.Path):
        self.env = {**os.environ, "LIBRA_NETNS_DIR": str(directory), "LIBRA_NETNS_NODES": "3",
                    "LIBRA_NETNS_GPUS": "2", "LIBRA_NETNS_PREFIX": f"lt{os.getpid() % 10000}",
                    "LIBRA_NETNS_SUBNET": "127.101.0"}
        self.prefix = self.env["LIBRA_NETNS_PREFIX"]

    def script(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
        done = subprocess.run(["bash", str(SCRIPT), *args], env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)
        assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
        return done.stdout

    def submit(self, run_dir: pathlib.Path, extra: str, *sbatch: str, **env: str) -> str:
        job_env = {"LIBRA_RUN_DIR": str(run_dir), "LIBRA_EXTRA_ARGS": extra, "GLOO_SOCKET_IFNAME": "libra0",
                   "LIBRA_PORT_BASE": "43000", **env}
        out = self.script("exec", "sbatch", "--parsable", f"--output={run_dir.parent}/job-%j.out", *sbatch,
                          str(ROOT / "deploy" / "slurm" / "libra.sbatch"), env=job_env)
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        text = self.script("exec", "scontrol", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text)) | {"Comment": _comment(text)}

    def wait(self, job_id: str, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while self.job(job_id)["JobState"] in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            assert time.monotonic() < deadline, f"job {job_id} still {self.job(job_id)['JobState']}"
            time.sleep(2)
        return self.job(job_id)


def _comment(text: str) -> str:
    match = re.search(r"Comment=(.*)", text)
    return match.group(1).strip() if match else ""


class Sampler(threading.Thread):
    """Which Libra processes run in which node's namespace, with their CUDA_VISIBLE_DEVICES."""

    def __init__(self, prefix: str, nodes: int):
        super().__init__(daemon=True)
        self.prefix, self.nodes, self.seen, self.done = prefix, nodes, set(), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for node in range(self.nodes):
                pids = subprocess.run(["ip", "netns", "pids", f"{self.prefix}-n{node}"], capture_output=True,
                                      text=True).stdout.split()
                for pid in pids:
                    found = _what(pid)
                    if found:
                        self.seen.add((f"node{node}", *found))
            self.done.wait(1.0)


def _what(pid: str) -> tuple[str, str] | None:
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = dict(item.split(b"=", 1) for item in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                       if b"=" in item)
    except OSError:
        return None
    text = b" ".join(argv).decode(errors="replace")
    program = os.path.basename(argv[0].decode(errors="replace"))
    if program == "srun":  # the step's client (on the batch node), not the step
        return None
    gpus = environ.get(b"CUDA_VISIBLE_DEVICES", b"-").decode()
    if "engines.hf_server" in text:
        return "worker", gpus
    match = re.search(r"libra\.cli serve (\w+)", text)
    if match:
        return match.group(1), gpus if match.group(1) == "trainer" else "-"
    if program.startswith("redis-server"):  # its title: "redis-server ADDRESS:PORT"
        return "redis", "-"
    return None


def _pid_of(prefix: str, node: int, role: str) -> int:
    pids = subprocess.run(["ip", "netns", "pids", f"{prefix}-n{node}"], capture_output=True, text=True).stdout.split()
    return next(int(pid) for pid in pids if (_what(pid) or ("", ""))[0] == role)


def _events(log: pathlib.Path, name: str) -> list[dict]:
    lines = (line for line in log.read_text(errors="replace").splitlines() if line.startswith("{"))
    return [e for e in map(json.loads, lines) if e.get("event") == name]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    made = Cluster(tmp_path_factory.mktemp("netns"))
    try:
        made.script("start", timeout=180)
        yield made
    finally:
        made.script("stop", timeout=180)


def test_the_quickstart_runs_over_three_nodes_each_part_on_its_node(cluster, tmp_path):
    run_dir = tmp_path / "run"
    extra = (f"{SMALL} --set trainer.steps=2 --set trainer.ranks=2 --set weights.type=group "
             "--set 'trainer.backend={type: megatron, distributed_optimizer: false}'")
    sampler = Sampler(cluster.prefix, 3)
    sampler.start()
    started = time.monotonic()
    job_id = cluster.submit(run_dir, extra, "--nodes=3", LIBRA_TRAINER_NODES="0,1")
    info = cluster.wait(job_id, 600)
    sampler.done.set()
    print(f"job {job_id}: {info['JobState']} in {time.monotonic() - started:.0f}s")
    output = (tmp_path / f"job-{job_id}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
    assert info["Comment"] == "libra: finished: the trainer ran its 2 steps"
    for role in ("redis", "planner", "scheduler", "elastic", "trainer", "rollout"):
        assert f"step libra-{role} exited with status 0" in output
    seen = sampler.seen
    assert {("node0", "redis", "-"), ("node0", "planner", "-"), ("node0", "scheduler", "-"),
            ("node0", "elastic", "-"), ("node2", "rollout", "-")} <= seen, seen
    trainer = {(node, gpus) for node, role, gpus in seen if role == "trainer"}
    assert {node for node, _ in trainer} == {"node0", "node1"} and all(g != "-" for _, g in trainer), seen
    workers = {(node, gpus) for node, role, gpus in seen if role == "worker"}
    assert workers == {("node2", "0"), ("node2", "1")}, seen  # an srun step each, a GPU each
    logs = run_dir / "logs" / f"slurm-{job_id}"
    trainer_log = (logs / "trainer.log").read_text()
    assert '"event": "following rank 0"' in trainer_log and '"event": "released by the leader"' in trainer_log
    over_group = [e for e in _events(logs / "rollout.log", "version delivered") if e["version"] >= 2]
    assert over_group and all(sorted(e["over_group"]) == ["long-1", "short-0"] for e in over_group)
    conf = (logs / "redis.conf").read_text()
    assert "bind 127.101.0.10" in conf and "requirepass " in conf and "appendfsync always" in conf
    assert oct((logs / "redis.conf").stat().st_mode & 0o777) == "0o600"
    assert "User requested shutdown" in (logs / "redis.log").read_text()  # stopped by the job, last


def test_a_stop_runs_in_order_and_the_job_submitted_again_resumes(cluster, tmp_path):
    run_dir = tmp_path / "run"
    extra = f"{SMALL} --set trainer.checkpoint_every=100"
    first = cluster.submit(run_dir, f"{extra} --set trainer.steps=40", "--nodes=2")
    trainer_log = run_dir / "logs" / f"slurm-{first}" / "trainer.log"
    deadline = time.monotonic() + 400
    while not (trainer_log.exists() and _events(trainer_log, "step")):
        assert time.monotonic() < deadline and cluster.job(first)["JobState"] in ("PENDING", "RUNNING"), \
            (tmp_path / f"job-{first}.out").read_text()[-3000:]
        time.sleep(2)
    scheduler = _pid_of(cluster.prefix, 0, "scheduler")
    os.kill(scheduler, signal.SIGKILL)  # a crash: its step is started again, the job goes on
    job_out = tmp_path / f"job-{first}.out"
    while job_out.read_text().count("scheduler is SERVING") < 2:  # the restarted one serves; a stop in its
        assert time.monotonic() < deadline, job_out.read_text()[-3000:]  # 5 s backoff would leave its log
        time.sleep(1)                                                    # (started anew) no "stopping"
    steps_before = len(_events(trainer_log, "step"))
    while len(_events(trainer_log, "step")) < steps_before + 2:  # training goes on with the new scheduler
        assert time.monotonic() < deadline, (tmp_path / f"job-{first}.out").read_text()[-3000:]
        time.sleep(2)
    cluster.script("exec", "scancel", "-b", "-s", "TERM", first)
    info = cluster.wait(first, 300)
    output = (tmp_path / f"job-{first}.out").read_text()
    assert "scheduler exited with status 137; restarting it in 5s (1/3" in output, output[-3000:]
    assert info["JobState"] == "CANCELLED", output[-3000:]
    assert info["Comment"].startswith("libra: stopped: SIGTERM"), info["Comment"]
    for role in ("redis", "planner", "scheduler", "elastic", "trainer", "rollout"):
        assert f"step libra-{role} exited with status 0" in output, output[-3000:]
    logs = trainer_log.parent
    stopping = {role: _events(logs / f"{role}.log", "stopping")[0]["timestamp"]
                for role in ("trainer", "rollout", "scheduler", "elastic", "planner")}
    assert list(stopping) == sorted(stopping, key=stopping.get), stopping  # one at a time, in order
    checkpoints = sorted(int(p.stem[4:]) for p in (run_dir / "checkpoints").glob("step*.pt"))
    assert checkpoints and checkpoints[-1] >= 1  # checkpoint_every=100: written by the trainer's drain
    saved = checkpoints[-1]

    second = cluster.submit(run_dir, f"{extra} --set trainer.steps={saved + 1}", "--nodes=2")
    info = cluster.wait(second, 600)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), \
        (tmp_path / f"job-{second}.out").read_text()[-3000:]
    again = run_dir / "logs" / f"slurm-{second}" / "trainer.log"
    assert [e["step"] for e in _events(again, "resumed")] == [saved]
    assert [e["step"] for e in _events(again, "step")] == [saved + 1]
