"""The planner's discrete-event simulator: the one model of rollout (and of the whole asynchronous
GRPO loop) that `libra sim`, the scheduler evaluation and the GRP evaluation all run on.

    instance.py  the seam: Unit (a trajectory in flight), the Instance and InstanceModel protocols
    simple.py    SimpleModel: per-token speed by TP, batch cap, no memory (scheduler evaluation)
    engines.py   CostModelEngines: engines at the cost model's decode/prefill speeds and KV limits,
                 pooled at cluster scale (`libra sim`)
    rollout.py   Rollout: turns routed through a real `libra.routing` policy onto instances;
                 Window: one window of trajectories played to its end on a fixed layout
    cluster.py   Simulator: releases, training steps, weight syncs and plan changes around Rollout,
                 asynchronous and disaggregated or synchronous colocated
    batching.py  which trajectories each step trains (in order, or the trainer's first complete groups)
    trainer.py   the training side: layout in force, elastic hybrid moves, step and sync costs
    usage.py     busy GPU fraction per pool, staleness of trained trajectories
    control.py   plan controllers (static, homogeneous TP-2, the online Replanner, scripted)
    colocated.py the colocated plan (every GPU trains and rolls out)
    design.py    a run config's design at cluster scale (`libra sim --config`, the headline)
    result.py    what runs report (StepRecord, PlanChangeRecord, SimResult, RolloutResult)
    bound.py     a true lower bound on one window's makespan on a layout (the scheduler evaluation)
    ceiling.py   the most trajectories/s any design could train a trace's batches at (the headline)
    run.py       one run from command-line choices (`simulate`), one plan over a window
                 (`run_plan`), summary lines, JSON and plot

It lives in the planner because it plays traces through the planner's cost model (cost_rollout,
cost_train, search, transition costs) and the planner is the service that will run it online, to
rank its candidate plans on the recent trace window. It imports no other service: routing comes
from `libra.routing` and traces from `libra.traces`; the scheduler evaluation (benchmarks, tests)
uses it from here.
"""
