"""A Libra job on a Slurm allocation: layout, steps, restarts of a crashed step, the ordered stop.

```
 sbatch deploy/slurm/libra.sbatch ─▶ python -m libra.slurm.job   (the batch step; its signals land here)
   ├─ layout.plan: roles → nodes, addresses, ports, GPUs; the run config resolved once, with the layout
   ├─ check: every node sees the config, the venv and the run directory (a shared filesystem)
   ├─ Redis step (redis_step.py: password, the node's address, AOF) ─▶ PING
   ├─ steps: planner, scheduler, elastic, trainer (its ranks: one srun step over its nodes), rollout
   │    (its workers: an srun step each, started by the gateway: rollout.worker.launch: srun)
   ├─ watch: trainer exits 0 ─▶ done │ a step dies ─▶ restarted (backoff, LIBRA_RESTARTS times) or fail
   └─ stop, in order: trainer (drains, checkpoints), rollout, scheduler, elastic, planner
        (scancel --signal=TERM JOB.STEP, LIBRA_STOP_GRACE_S each, then killed), then Redis (SHUTDOWN)
```
What starts the stop: the trainer finishing; a step that died too often; SIGTERM or SIGINT to the
batch step — `#SBATCH --signal=B:TERM@180` before the time limit, `scancel -b -s TERM JOBID`, or a
plain `scancel`/a node failure, which also signal every step at once (the services drain on it; the
Redis step outlives them). The job's end says what happened: exit 0 finished, 1 failed, 143
stopped by a signal (or requeued after a time-limit stop with LIBRA_REQUEUE=1), and the job's
Comment (`scontrol show job`) holds the reason. A resubmitted or requeued job resumes: the
trainer from its last checkpoint, Redis from its AOF, both under the run directory.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

from libra.slurm import layout as layouts
from libra.slurm import slurmctl
from libra.slurm.redis_step import write_config
from libra.slurm.steps import Step, serving

DEFAULT_CONFIG = "configs/quickstart.yaml"  # relative to LIBRA_HOME
STOP_ORDER = ("trainer", "rollout", "scheduler", "elastic", "planner")
START_ORDER = ("planner", "scheduler", "elastic", "trainer", "rollout")
TIME_LIMIT_NEAR_S = 600  # a SIGTERM with this little time left is the time-limit signal
CANCELLED = "cancelled"  # the reason's first word when Slurm itself is ending the job


def say(message: str) -> None:
    print(f"[libra.slurm {time.strftime('%H:%M:%S')}] {message}", flush=True)


class JobError(RuntimeError):
    """The job cannot start (setup, config, layout, Redis); nothing is left running."""


class Job:
    """One Libra job on its allocation, driven from the batch step (module docstring)."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.job_id = env.get("SLURM_JOB_ID") or ""
        if not self.job_id:
            raise JobError("run this with sbatch (or inside salloc): SLURM_JOB_ID is not set")
        self.home = pathlib.Path(env.get("LIBRA_HOME") or env.get("SLURM_SUBMIT_DIR") or os.getcwd())
        self.config_path = pathlib.Path(env.get("LIBRA_CONFIG") or self.home / DEFAULT_CONFIG)
        self.extra = shlex.split(env.get("LIBRA_EXTRA_ARGS", ""))
        self.max_restarts = int(env.get("LIBRA_RESTARTS", "3"))
        self.grace_s = float(env.get("LIBRA_STOP_GRACE_S", "45"))
        self.steps: dict[str, Step] = {}
        self.signals: list[int] = []
        self.redis_url = ""
        self.pending: set[str] = set()  # services not yet seen SERVING (since their last start)

    # ---- setup ----------------------------------------------------------------------------------
    def prepare(self) -> None:
        import yaml

        from libra.cli import build_parser
        from libra.cli_config import overrides
        from libra.config import load_run_config
        from libra.errors import ConfigError
        from libra.security import prepare_run_token

        if not self.config_path.is_file():
            raise JobError(f"no config {self.config_path}: set LIBRA_CONFIG")
        try:
            user = overrides(build_parser().parse_args(["check-config", "--config", str(self.config_path),
                                                        *self.extra]))
            first = load_run_config(self.config_path, user)
            facts = layouts.RunFacts(first.trainer.ranks, first.weights.type, first.metrics.base_port != 0,
                                     first.rollout.worker.base_port != 0)
            self.layout = layouts.plan(slurmctl.job_nodes(self.env["SLURM_JOB_NODELIST"]),
                                       layouts.Settings.from_env(self.env), facts)
            config = load_run_config(self.config_path, {**self.layout.overrides, **user})
        except (ConfigError, layouts.LayoutError, slurmctl.SlurmError, SystemExit) as error:
            raise JobError(f"invalid config or layout: {error}") from None
        try:
            config = prepare_run_token(config, self.env)  # RUN_DIR/token, as `libra up` makes it
        except ConfigError as error:
            raise JobError(str(error)) from None
        self.config = config
        self.run_dir = config.run_path
        restart = int(self.env.get("SLURM_RESTART_COUNT") or 0)  # a requeued job: its earlier runs' logs stay
        self.logs = self.run_dir / "logs" / (f"slurm-{self.job_id}" + (f".{restart}" if restart else ""))
        self.logs.mkdir(parents=True, exist_ok=True)
        written = config.model_dump(mode="json")
        written["redis"]["url"] = ""  # the URL carries the password: it travels in LIBRA_REDIS_URL only
        self.resolved = self.logs / "config.yaml"
        self.resolved.write_text(f"# the run config of Slurm job {self.job_id}, layout applied (libra.slurm.job)\n"
                                 + yaml.safe_dump(written, sort_keys=False))
        say(f"job {self.job_id}: config {self.config_path} {' '.join(self.extra)}; run dir {self.run_dir}; "
            f"logs {self.logs}")
        for line in self.layout.describe():
            say(f"  {line}")

    def step_env(self) -> dict[str, str]:
        env = dict(self.env)
        env.update({f"LIBRA_{s.upper()}_ADDRESS": a for s, a in self.layout.addresses.items()})
        env.update({"PYTHONUNBUFFERED": "1", "LIBRA_LOG_FORMAT": env.get("LIBRA_LOG_FORMAT", "json"),
                    "LIBRA_RUN_DIR": str(self.run_dir), "LIBRA_RUN_ID": self.config.run_id,
                    "PATH": f"{pathlib.Path(sys.executable).parent}:{env.get('PATH', '')}"})
        if self.redis_url:
            env["LIBRA_REDIS_URL"] = self.redis_url
        return env

    def srun(self, role: str, command: list[str], env: dict[str, str] | None = None) -> Step:
        argv = ["srun", *self.layout.srun[role], f"--job-name=libra-{role}", f"--output={self.logs / role}.log",
                "--open-mode=append", *command]
        return Step(role, argv, env or self.step_env())

    def check_shared(self) -> None:
        """Every node must see the venv, the resolved config and the run directory at the same paths."""
        names = [n.name for n in self.layout.nodes]
        probe = ("import os, pathlib, socket, sys; r = pathlib.Path(sys.argv[1]); c = pathlib.Path(sys.argv[2]); "
                 "n = os.environ.get('SLURMD_NODENAME', socket.gethostname()); "
                 "ok = c.is_file() and os.access(r, os.W_OK); "
                 "print(n, 'ok' if ok else 'MISSING ' + (str(c) if not c.is_file() else str(r)))")
        argv = ["srun", f"--nodes={len(names)}", "--ntasks-per-node=1", "--overlap",
                *(("--gres=none",) if self.layout.gpu else ()), f"--nodelist={','.join(names)}",
                "--job-name=libra-check", sys.executable, "-c", probe, str(self.run_dir), str(self.resolved)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        seen = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
        bad = {name: seen.get(name, f"cannot run {sys.executable}") for name in names if seen.get(name) != "ok"}
        if bad or done.returncode:
            details = "; ".join(f"{n}: {why}" for n, why in bad.items()) or done.stderr.strip()[:300]
            raise JobError(f"not every node sees the same files ({details}): the repository, the venv and the "
                           f"run directory must be on a filesystem shared by all nodes, at the same paths")

    def start_redis(self) -> None:
        given = self.config.redis.url  # LIBRA_REDIS_URL, --redis-url or the config's redis.url
        if given:
            self.redis_url = given
            say("redis: a Redis URL is given (LIBRA_REDIS_URL or redis.url); no Redis step")
            return
        address, port = self.layout.redis
        password = secrets.token_urlsafe(24)
        conf = self.logs / "redis.conf"
        write_config(conf, address, port, password, self.run_dir / "redis", self.config.redis.appendfsync)
        self.redis_stop = self.logs / "redis.stop"
        self.redis_stop.unlink(missing_ok=True)
        server = self.env.get("LIBRA_REDIS_SERVER", "redis-server")
        step = self.srun("redis", [sys.executable, "-m", "libra.slurm.redis_step", "--config", str(conf),
                                   "--stop-file", str(self.redis_stop), "--server", server])
        self.steps["redis"] = step
        step.start()
        self.redis_url = f"redis://:{password}@{address}:{port}/0"
        import redis

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if step.poll() is not None:
                raise JobError(f"the Redis step exited ({step.status}); see {self.logs}/redis.log")
            try:
                redis.Redis.from_url(self.redis_url, socket_timeout=1).ping()
                say(f"redis at {address}:{port} (password, AOF) on {self.layout.node_of['redis']}")
                return
            except redis.RedisError:
                time.sleep(0.3)
        raise JobError(f"Redis at {address}:{port} did not answer in 60 s; see {self.logs}/redis.log")

    def start_services(self) -> None:
        config = ["--config", str(self.resolved)]
        for role in START_ORDER:
            env = self.step_env()
            if role == "trainer":
                env.update({"MASTER_ADDR": self.layout.rendezvous[0], "MASTER_PORT": str(self.layout.rendezvous[1])})
            self.steps[role] = self.srun(role, [sys.executable, "-m", "libra.cli", "serve", role, *config], env)
            self.steps[role].start()
            where = ",".join(self.layout.trainer_nodes) if role == "trainer" else self.layout.node_of[role]
            say(f"started {role} on {where} at {self.layout.addresses[role]} (log {self.logs}/{role}.log)")

    # ---- running --------------------------------------------------------------------------------
    def watch(self) -> tuple[int, str]:
        """Until the trainer finishes, a step fails for good, or a signal comes: (exit status, reason)."""
        pending = self.pending = set(START_ORDER)
        last_probe = 0.0
        while not self.signals:
            trainer = self.steps["trainer"]
            if trainer.poll() == 0:
                return 0, f"finished: the trainer ran its {self.config.trainer.steps} steps"
            for step in self.steps.values():
                if step.poll() is None or (step.role == "trainer" and step.status == 0):
                    continue
                failure = self._restart(step)
                if failure:
                    return 1, failure
            if pending and time.monotonic() - last_probe > 5:
                last_probe = time.monotonic()
                for role in serving([r for r in pending if self.steps[r].running], self.layout.addresses):
                    say(f"{role} is SERVING at {self.layout.addresses[role]}")
                    pending.discard(role)
            time.sleep(1.0)
        return 143, self._signal_reason()

    def _restart(self, step: Step) -> str:
        """Start a dead step again after a backoff; the failure when it has died too often."""
        now = time.monotonic()
        if step.next_start == 0.0:
            step.history.append(step.status)
            if step.restarts >= self.max_restarts:
                return f"failed: {step.role} exited with status {step.status} after {step.restarts} restart(s)"
            step.next_start = now + min(60.0, 5.0 * 2 ** step.restarts)
            say(f"{step.role} exited with status {step.status}; restarting it in {step.next_start - now:.0f}s "
                f"({step.restarts + 1}/{self.max_restarts}; log {self.logs}/{step.role}.log)")
        elif now >= step.next_start:
            step.restarts += 1
            step.next_start = 0.0
            step.start()
            if step.role in START_ORDER:
                self.pending.add(step.role)  # say when it serves again
        return ""

    def _signal_reason(self) -> str:
        name = signal.Signals(self.signals[0]).name
        state, left = slurmctl.job_state(self.job_id)
        if state and state not in ("RUNNING", "CONFIGURING"):
            down = slurmctl.down_nodes([n.name for n in self.layout.nodes])
            cause = f"node failure: {', '.join(down)}" if down else "scancel"
            return f"{CANCELLED}: the job is {state.lower()} ({name}; {cause})"
        if left <= TIME_LIMIT_NEAR_S:
            return f"stopped: time limit near ({left:.0f}s left, {name})"
        return f"stopped: {name} (scancel -b or a signal to the batch step)"

    # ---- stopping -------------------------------------------------------------------------------
    def stop(self, cancelled: bool = False) -> None:
        """Services one at a time (each drains while the ones it talks to are up), Redis last.

        `cancelled`: Slurm is ending the job (scancel, a node failure) and has signalled every step
        already; they drain at once, and what is still running after KillWait is killed by Slurm.
        Then wait for the services until shortly before that, and stop Redis (its AOF complete)."""
        if cancelled:
            budget = max(5.0, slurmctl.kill_wait() - 5.0)
            deadline = time.monotonic() + budget
            say(f"Slurm signalled every step; waiting up to {budget:.0f}s (KillWait - 5s) for the services")
            for role in STOP_ORDER:
                if role in self.steps:
                    self.steps[role].wait(max(0.0, deadline - time.monotonic()))
        for role in STOP_ORDER if not cancelled else ():
            step = self.steps.get(role)
            if step is not None and step.running:
                self._stop_step(step, self.grace_s)
        if "redis" in self.steps and self.steps["redis"].running:
            self.redis_stop.touch()
            import redis

            try:
                redis.Redis.from_url(self.redis_url, socket_timeout=5).shutdown()
            except redis.RedisError:
                pass  # it closes the connection as it goes (or is gone already)
            self.steps["redis"].wait(30) or self._stop_step(self.steps["redis"], 10)
        for role, step in self.steps.items():
            if step.proc is not None:
                say(f"step libra-{role} exited with status {step.poll()}"
                    + (f" (earlier runs: {step.history})" if step.history else ""))

    def _stop_step(self, step: Step, grace_s: float) -> None:
        """SIGTERM to the step's tasks; cancelled (SIGKILL) when still running after `grace_s`."""
        for step_id in slurmctl.step_ids(self.job_id, f"libra-{step.role}"):
            slurmctl.signal_step(step_id, "TERM")
        if not step.wait(grace_s):
            say(f"{step.role} did not stop within {grace_s:.0f}s; cancelling its step")
            for step_id in slurmctl.step_ids(self.job_id, f"libra-{step.role}"):
                slurmctl.signal_step(step_id, None)
            if not step.wait(15) and step.proc is not None:
                step.proc.kill()
                step.proc.wait()

    def finish(self, status: int, reason: str) -> int:
        cancelled = reason.startswith(CANCELLED)
        say(f"{reason}; stopping the services" + ("" if cancelled else " in order"))
        self.stop(cancelled)
        requeue = status == 143 and "time limit" in reason and self.env.get("LIBRA_REQUEUE") == "1"
        comment = f"libra: {reason}" + ("; requeued" if requeue else "")
        slurmctl.set_comment(self.job_id, comment)
        say(f"done: exit {status}; {comment}")
        if requeue:
            slurmctl.requeue(self.job_id)
        elif status == 143 and "time limit" not in reason and not cancelled:
            slurmctl.cancel(self.job_id)  # a user's stop: the job ends CANCELLED, as for scancel
        return status


def main(env: dict[str, Any] | None = None) -> int:
    try:
        job = Job(dict(os.environ if env is None else env))
    except JobError as error:
        say(f"error: {error}")
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, frame: job.signals.append(number))
    try:
        job.prepare()
        job.check_shared()
        job.start_redis()
        job.start_services()
    except JobError as error:
        say(f"error: {error}")
        if job.steps:
            job.stop()
        return 1
    status, reason = job.watch()
    return job.finish(status, reason)


if __name__ == "__main__":
    sys.exit(main())
