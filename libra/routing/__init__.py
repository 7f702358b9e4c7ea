"""Per-turn routing policies: pure logic shared by the scheduler service and the planner's simulator.

The scheduler service (services/scheduler/) wraps one `Policy` object in gRPC and Redis; the
cluster simulator (services/planner/sim/) and the benchmarks route every simulated turn through
the very same classes, so a policy measured offline is the policy that runs.

    policy.py       Worker, Turn, Decision, the Policy interface (membership, load, affinity)
    baselines.py    LoadBalance, LengthAware, LA-MLFQ, Clairvoyant (evaluation only)
    cmlfq.py        C-MLFQ: bucket levels from prompt history, work done and tool-outcome prefixes
    prefix_tree.py  C-MLFQ's causal prefix forest (and its compact persistence)
    signatures.py   tool returns as `tool:size:status`
    names.py        the policies' names (no pydantic: the CLI's choices)
    config.py       RoutingConfig: which policy and its limits (the scheduler's config extends it)
    registry.py     make_policy(config, buckets): the configured policy

Modules import downwards only (policy <- baselines, cmlfq <- registry). No network, no Redis, no
clock, no randomness: state in, decision out.
"""
