"""The load-balance policy as a deterministic step function."""

from __future__ import annotations

import pytest

from libra.errors import FailedPrecondition, NotFound
from libra.routing.baselines import LoadBalance
from libra.routing.policy import Turn, Worker


def policy(cap: int = 10_000, workers: int = 3) -> LoadBalance:
    lb = LoadBalance(cap)
    for i in range(workers):
        lb.register(Worker(f"w{i}", "short", f"http://w{i}"))
    return lb


def turn(tid: str, tokens: int = 10, exclude=()) -> Turn:
    return Turn(tid, "p", 0, tokens, 10, frozenset(exclude))


def test_ties_rotate_and_load_spreads():
    lb = policy()
    chosen = [lb.route(turn(f"t{i}")).worker_id for i in range(3)]
    assert sorted(chosen) == ["w0", "w1", "w2"]


def test_least_outstanding_wins_and_release_frees_load():
    lb = policy(workers=2)
    big = lb.route(turn("big", tokens=1000))
    small = lb.route(turn("small"))
    assert small.worker_id != big.worker_id
    lb.turn_done("big", big.worker_id)
    assert lb.state.workers[big.worker_id].outstanding_tokens == 0


def test_affinity_until_cap_then_move():
    lb = policy(cap=100, workers=2)
    first = lb.route(turn("t", tokens=50))
    lb.turn_done("t", first.worker_id)
    assert lb.route(turn("t", tokens=50)).reason == "affinity"
    lb.turn_done("t", first.worker_id)
    lb.route(turn("hog", tokens=500, exclude=[w for w in ("w0", "w1") if w != first.worker_id]))
    moved = lb.route(turn("t"))
    assert moved.moved and moved.worker_id != first.worker_id


def test_excluded_workers_and_errors():
    lb = policy(workers=1)
    with pytest.raises(FailedPrecondition):
        lb.route(turn("t", exclude=["w0"]))
    with pytest.raises(NotFound):
        lb.finish("ghost", "p", 0)
    lb.deregister("w0")
    with pytest.raises(FailedPrecondition):
        lb.route(turn("t"))


def test_routing_is_shared_code_and_neither_scheduler_nor_planner_imports_another_service():
    """libra/routing and libra/traces import no service; services/scheduler and services/planner
    import no service but their own (what both need lives in libra/)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]

    def services_imported(folder: str) -> set[str]:
        found = set()
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):  # `from libra.services import planner` names it too
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                found |= {name.split(".")[2] for name in names if name.startswith("libra.services.")}
        return found

    assert services_imported("libra/routing") == set() and services_imported("libra/traces") == set()
    assert services_imported("services/scheduler") <= {"scheduler"}
    assert services_imported("services/planner") <= {"planner"}
