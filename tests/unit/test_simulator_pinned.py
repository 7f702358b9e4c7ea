"""The simulator's figures, pinned: small runs of each headline design's path give exactly the numbers
they gave before the simulator was made faster (issue 16 item 5), so a change that moves a figure,
however slightly, fails here and has to say why.

Each case plays a fixed plan (no search: the planner's search may change without moving these) on a
small R2E-like trace with Qwen3-14B on 40 GB A800s, where TP1 engines cannot hold the longest contexts
(the path that excludes engines per turn), engines are pooled (`max_workers`), cohorts stand for several
trajectories (`copies`), and one case changes its plan mid-run (engines drained, turns moved, the
policy rebuilt). What is pinned: every step's end and rollout span, the makespan, the routes and
their reasons, the tokens, the peak KV share, the busy fractions and the staleness of what trained.
"""

from __future__ import annotations

import pytest

from libra.routing.cmlfq import CMLFQ
from libra.services.planner.cost_train import Layout
from libra.services.planner.hardware import gpu_named, model_named
from libra.services.planner.search import Candidate, SearchConfig
from libra.services.planner.sim import control
from libra.services.planner.sim.cluster import SimConfig, Simulator
from libra.services.planner.sim.engines import CostModelEngines
from libra.services.planner.sim.instance import Group
from libra.services.planner.sim.rollout import Window
from libra.services.planner.sim.simple import SimpleModel
from libra.traces.r2e import r2e_like

MODEL = model_named("qwen3-14b")
GPU = gpu_named("a800-80g").model_copy(update={"memory_gib": 40.0, "name": "a800-40g"})  # TP1 holds < 64k tokens
SEARCH = SearchConfig(total_gpus=64, group_size=8, tp_choices=(1, 2, 8))


TRACE = r2e_like(8, 8, 8, seed=3, drift=1.0, copies=2)  # 64 trajectories per step as 32 cohorts


def plan(layout: tuple[int, int, int], rollout: tuple[tuple[int, int], ...]) -> Candidate:
    return Candidate(Layout(*layout, 1), rollout, 0.0, 0.0)


CASES = {  # name -> (first plan, plan change after step 2 or None, SimConfig settings)
    "c_libra_static": (plan((2, 4, 2), ((1, 6), (2, 6), (8, 2))), None,
                       dict(policy="cmlfq", staleness=1, batching="first_complete", max_workers=6)),
    "c_with_a_move": (plan((2, 4, 4), ((2, 4), (8, 2))),  # one TP8 engine kept, carrying its turns, and the
                      # four TP2 engines, unpooled before and pooled by two after (until 2026-12-03 restarted)
                      control.PlanChange(plan((2, 4, 4), ((2, 8), (8, 1))), 40.0, "test"),
                      dict(policy="cmlfq", staleness=1, batching="first_complete", max_workers=6)),
    "b_async_even": (plan((8, 1, 4), ((8, 4),)), None,
                     dict(policy="load_balance", staleness=1, batching="first_complete", max_workers=2)),
    "a_sync_colocated": (plan((8, 1, 8), ((8, 8),)), None,
                         dict(policy="load_balance", staleness=0, colocated=True, max_workers=4)),
}


def figures(name: str) -> dict:
    first, change, settings = CASES[name]
    controller = control.Scripted(first, {2: change} if change else {})
    simulator = Simulator(MODEL, GPU, TRACE, controller, SEARCH, SimConfig(steps=6, **settings))
    result = simulator.run()
    return {"time_s": [s.time_s for s in result.steps], "rollout_s": [s.rollout_s for s in result.steps],
            "makespan_s": result.makespan_s, "routes": result.routes, "reasons": dict(sorted(result.reasons.items())),
            "output_tokens": result.output_tokens, "peak_kv": result.peak_kv, "pooled": result.pooled,
            "moved": [c.moved_turns for c in result.plan_changes], "busy": simulator.usage.fractions(),
            "staleness": dict(simulator.usage.staleness), "rejected": simulator.usage.rejected}


def window_figures() -> dict:
    """The scheduler evaluation's experiment: one window on the simple instance model, C-MLFQ."""
    layout = [Group("short", 1, 3), Group("medium", 2, 2), Group("long", 4, 1)]
    trace = [spec for batch in r2e_like(3, 6, 4, seed=5, drift=0.5).steps for spec in batch]
    result = Window(layout, trace, SimpleModel()).run(
        CMLFQ(10**9, buckets=[("short", 4000), ("medium", 12000), ("long", 30000)]))
    return {"makespan_s": result.makespan_s, "routes": result.routes, "moves": result.moves,
            "reasons": dict(sorted(result.reasons.items())), "busy": result.busy}


# the figures the simulator gave before it was made faster (issue 16 item 5)
PINNED = {'a_sync_colocated': {'time_s': [201.76862256024702, 411.09454564908333, 682.8872546544626,
                                          951.4375799853433, 1162.9208682048018, 1394.758651655478],
                               'rollout_s': [183.58723491290343, 185.41973125622093, 239.74229459717412,
                                             225.06595672195078, 184.1453141653867, 188.6354056351547],
                               'makespan_s': 1394.758651655478,
                               'routes': 1373,
                               'reasons': {'affinity': 1149, 'new:least_loaded': 224},
                               'output_tokens': 4934170,
                               'peak_kv': 0.0970018289772952,
                               'pooled': 2,
                               'moved': [],
                               'busy': {'colocated': 0.7710225811193958},
                               'staleness': {0: 384},
                               'rejected': 0},
          'b_async_even': {'time_s': [151.22255586991528, 290.5727459289582, 500.538611759931, 689.1720246235849,
                                      808.3028861497698, 1052.922332504153],
                           'rollout_s': [121.91839249315338, 240.97360916470913, 275.03356695674097,
                                         316.52057370829215, 256.5362931104719, 276.5294178379602],
                           'makespan_s': 1052.922332504153,
                           'routes': 1693,
                           'reasons': {'affinity': 1437, 'new:least_loaded': 256},
                           'output_tokens': 4871376,
                           'peak_kv': 0.31073079853484137,
                           'pooled': 2,
                           'moved': [],
                           'busy': {'rollout': 0.9909740295190592, 'train': 0.35492965990549097},
                           'staleness': {0: 96, 1: 288},
                           'rejected': 8},
          'c_libra_static': {'time_s': [565.9331072537178, 737.2135649819905, 1063.472297285599, 1261.057495215828,
                                        1463.9260286779856, 1787.851963527188],
                             'rollout_s': [494.8055084810487, 621.9882636736634, 352.0731980586846, 365.8182508863407,
                                           285.4946931903255, 369.18234655444667],
                             'makespan_s': 1787.851963527188,
                             'routes': 1663,
                             'reasons': {'affinity': 1271,
                                         'fallback:spill': 53,
                                         'least_loaded': 35,
                                         'move:signal:up:tp8': 70,
                                         'move:work:up:tp2': 16,
                                         'move:work:up:tp8': 15,
                                         'new:history:tp2': 4,
                                         'new:history:tp8': 124,
                                         'new:shortest': 75},
                             'output_tokens': 4872184,
                             'peak_kv': 0.9545945945945952,
                             'pooled': 3,
                             'moved': [],
                             'busy': {'rollout': 0.5885816696562696, 'train': 0.42644231564705276},
                             'staleness': {0: 80, 1: 304},
                             'rejected': 8},
          'c_with_a_move': {'time_s': [283.8680586377088, 453.96254166360524, 741.1573517827588, 994.5268799606255,
                                       1229.9431553137847, 1733.0342224636624],
                            'rollout_s': [243.9476425107403, 392.51362937187776, 381.69676660650055,
                                          457.037514269748, 422.9446360337423, 652.3838392976373],
                            'makespan_s': 1733.0342224636624,
                            'routes': 1648,
                            'reasons': {'affinity': 1256,
                                        'fallback:spill': 18,
                                        'least_loaded': 13,
                                        'move:signal:down:tp2': 13,
                                        'move:signal:up:tp8': 72,
                                        'move:work:up:tp8': 31,
                                        'new:history:tp2': 32,
                                        'new:history:tp8': 103,
                                        'new:shortest': 110},
                            'output_tokens': 4827650,
                            'peak_kv': 0.9246449799172949,
                            'pooled': 2,
                            'moved': [5],
                            'busy': {'rollout': 0.6733616557234618, 'train': 0.2379949249362553},
                            'staleness': {0: 96, 1: 288},
                            'rejected': 8}}

WINDOW = {'makespan_s': 421.3235154746315,
          'routes': 512,
          'moves': 102,
          'reasons': {'affinity': 337,
                      'fallback:spill': 24,
                      'least_loaded': 23,
                      'move:signal:up:long': 1,
                      'move:signal:up:medium': 10,
                      'move:work:up:long': 26,
                      'move:work:up:medium': 43,
                      'new:shortest': 48},
          'busy': {'short': 0.5696075414709607, 'medium': 0.7729444134425146, 'long': 0.5265775081282772}}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_design_gives_the_pinned_figures(name):
    got, want = figures(name), PINNED[name]
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_a_window_on_the_simple_model_gives_the_pinned_figures():
    got = window_figures()
    assert got.keys() == WINDOW.keys()
    for key, value in WINDOW.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_the_cases_cover_what_they_claim():
    longest = max(spec.total_tokens for batch in TRACE.steps for spec in batch)
    assert longest > CostModelEngines(MODEL, GPU, (1,), SEARCH.rollout).max_context_tokens()  # TP1 excluded
    static, moved = PINNED["c_libra_static"], PINNED["c_with_a_move"]
    assert static["pooled"] > 1 and moved["moved"] and moved["moved"][0] > 0
    assert any(reason.startswith("move:signal") for reason in static["reasons"])
    assert set(PINNED["a_sync_colocated"]["staleness"]) == {0} and set(static["staleness"]) <= {0, 1}
