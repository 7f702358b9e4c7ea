"""benchmarks/quickstart_race.py's contenders: a --variant is the quickstart with its own overrides,
run beside the others; the overrides reach that contender's `libra up` and no other's, and a
malformed --variant stops the script before anything runs."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import quickstart_race as race  # noqa: E402

ONE_WORKER = "planner.buckets=[{name: long, tp: 1, max_tokens: 512, replicas: 1}]"


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]


def test_a_variant_is_the_quickstart_with_its_own_overrides(tmp_path):
    variants = {"quickstart/one-worker": [ONE_WORKER]}
    shipped = race.command("quickstart", tmp_path, 20, 1, ("trainer.max_staleness=2",), variants)
    variant = race.command("quickstart/one-worker", tmp_path, 20, 1, ("trainer.max_staleness=2",), variants)
    baseline = race.command("sync-colocated", tmp_path, 20, 1, ("trainer.max_staleness=2",), variants)
    assert variant[variant.index("--config") + 1] == str(race.ROOT / "configs" / "quickstart.yaml")
    assert ONE_WORKER in _sets(variant) and "trainer.max_staleness=2" in _sets(variant)
    assert _sets(variant).index("trainer.max_staleness=2") < _sets(variant).index(ONE_WORKER)  # the variant's last
    assert ONE_WORKER not in _sets(shipped) and "trainer.max_staleness=2" in _sets(shipped)
    assert ONE_WORKER not in _sets(baseline) and "trainer.max_staleness=2" not in _sets(baseline)
    assert "/" not in variant[variant.index("--run-id") + 1]  # a run id, not a path
    assert "seed=1" in _sets(variant) and "trainer.steps=20" in _sets(variant)


@pytest.mark.parametrize("variant", [["one-worker"], ["a=b", ONE_WORKER], ["a/b", ONE_WORKER],
                                     ["one-worker", "no-equals-sign"]])
def test_a_malformed_variant_stops_before_anything_runs(variant, capsys, monkeypatch):
    def ran(*_args, **_kwargs):
        raise AssertionError("the race started")

    monkeypatch.setattr(race, "warm_cache", ran)
    monkeypatch.setattr(race, "run_once", ran)
    with pytest.raises(SystemExit) as stopped:
        race.main(["--variant", *variant])
    assert stopped.value.code == 2
    assert "--variant takes a NAME" in capsys.readouterr().err


def test_the_table_lists_the_contenders_in_the_order_they_ran():
    def result(contender: str, step: int) -> race.Result:
        return race.Result(contender, 1, 0, 0, 40.0, 12.0, step, 30.0, 18.0, 1.2, 1.5, 1.4, 1.4, 20, 0.7)

    text = race.table([result("quickstart", 13), result("quickstart/one-worker", 12), result("sync-loop", 14)], 0.65)
    header = text.splitlines()[0].split()
    assert header == ["quickstart", "quickstart/one-worker", "sync-loop"]
    assert text.splitlines()[2].split()[-3:] == ["13", "12", "14"]


def test_the_plain_loop_gets_the_threads_asked_for(tmp_path):
    loop = race.command("sync-loop", tmp_path, 20, 1, loop_threads=4)
    assert loop[loop.index("--threads") + 1] == "4"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sync_grpo_loop

    assert sync_grpo_loop.parse_args(loop[2:]).threads == 4  # the loop reads what the race passes


def test_cores_pin_a_contender_and_every_process_it_starts(tmp_path):
    allowed = sorted(race.os.sched_getaffinity(0))
    cpus = {allowed[-1]}
    code = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)), flush=True); "
            "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])")
    with open(tmp_path / "log", "w") as log:
        assert race.start([sys.executable, "-c", code], dict(race.os.environ), log, cpus).wait(timeout=60) == 0
    assert (tmp_path / "log").read_text().split("\n")[:2] == [str([allowed[-1]])] * 2
    with open(tmp_path / "log", "w") as log:
        assert race.start([sys.executable, "-c", code], dict(race.os.environ), log, None).wait(timeout=60) == 0
    assert (tmp_path / "log").read_text().split("\n")[:2] == [str(allowed)] * 2


@pytest.mark.parametrize("argv, message", [(["--cores", "-1"], "--cores must be between"),
                                            (["--cores", "100000"], "--cores must be between"),
                                            (["--loop-threads", "0"], "--loop-threads must be >= 1")])
def test_bad_cores_or_threads_stop_before_anything_runs(argv, message, capsys, monkeypatch):
    def ran(*_args, **_kwargs):
        raise AssertionError("the race started")

    monkeypatch.setattr(race, "warm_cache", ran)
    monkeypatch.setattr(race, "run_once", ran)
    with pytest.raises(SystemExit) as stopped:
        race.main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
