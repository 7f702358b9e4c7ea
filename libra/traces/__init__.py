"""Rollout traces: the one trajectory type every simulation and evaluation plays, its readers and
its generators. What a real run records is written by `libra.trace_record` (RUN_DIR/trace.jsonl).

    spec.py       TurnSpec, TrajectorySpec, Trace (one batch per training step) and their checks
    files.py      read(path): every trace format the project writes or ships, into TrajectorySpecs;
                  load(path, steps, batch): the same cut into training steps; dump(trace)
    synthetic.py  generated traces: the drifting long-tailed agentic trace (`libra sim`) and the
                  signal / no-signal traces of the scheduler evaluation
    r2e.py        a generated R2E-Gym-like SWE-agent trace (up to 30k new tokens, 12 turns, drifting):
                  the headline's (`libra sim --trace r2e`)

A trajectory is a prompt and its model turns; every turn but the last ends in a tool call (its
structured outcome, payload tokens and latency), as the rollout gateway reports them to the
scheduler. This package knows nothing of instances, policies or plans.
"""
