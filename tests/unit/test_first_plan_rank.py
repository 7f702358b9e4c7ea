"""benchmarks/first_plan_rank.py: the run holds the replay's K-th plan (the one it marks), the ranking it
prints is the ranking the run's own first-plan step makes, and a rank past the ranking is refused."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIM = ["--", "--config", "configs/headline/c-libra-static.yaml", "--set", "planner.cluster.gpus=16", "--trace", "r2e",
       "--steps", "2", "--prompts", "16", "--seed", "0"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_plan_rank.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def _ranked(stdout: str) -> list[tuple[float, str]]:
    return [(float(m.group(1)), m.group(2)) for m in re.finditer(r"^replay #\d+: +([\d.]+)s per step  (.+?)(?:  <- held)?$",
                                                                stdout, re.M)]


def _start(stdout: str) -> str:
    return re.search(r"^plan at start: (.+)$", stdout, re.M).group(1)


def test_holds_the_kth_plan_of_the_ranking():
    second, first = _run("--rank", "2", "--show", "3", *SIM), _run("--rank", "1", "--show", "3", *SIM)
    assert second.returncode == 0 and first.returncode == 0, second.stderr + first.stderr
    ranked = _ranked(second.stdout)
    assert len(ranked) == 3 and ranked == _ranked(first.stdout)  # the same ranking either way
    assert [s for s, _ in ranked] == sorted(s for s, _ in ranked)
    assert ranked[0][1] != ranked[1][1]
    assert _start(second.stdout) == ranked[1][1] and _start(first.stdout) == ranked[0][1]
    held = [line for line in second.stdout.splitlines() if line.endswith("<- held")]
    assert held == [line for line in second.stdout.splitlines() if line.startswith("replay #2:")]


def test_a_rank_past_the_ranking_is_refused():
    done = _run("--rank", "999", *SIM)
    assert done.returncode != 0
    assert re.search(r"the replay ranked \d+ plans; --rank 999 is not among them", done.stderr), done.stderr
    done = _run("--rank", "0", *SIM)
    assert done.returncode == 2 and "--rank must be >= 1, got 0" in done.stderr
