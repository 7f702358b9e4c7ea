"""Plans made by hand (`Planner.SetPlan`): checked, stored as the next generation, recorded.

The planner is the only writer of the plan record (docs/state.md); a plan an operator wants in
force comes through here, never straight to the elastic coordinator, which applies only the
stored plan:

```
 SetPlan(buckets, training, reason)
   ─▶ requested_plan: the bounds of libra.plans.check_plan (the ones ApplyPlan checks), a reason
   ─▶ store_next: put_plan(stored generation + 1)   compare-and-set; lost to a replan: read, try again
   ─▶ plan:decisions: trigger "manual", "set by hand: <reason>"  (Explain)
   ─▶ reply: the stored plan
 then, in the background (server.py): ElasticCoordinator.ApplyPlan, as an applied replan is sent
```

What happens next is the service's (server.py): in mode online the replanner takes the plan as
the plan in force and may replace it at its next decision. This module knows neither gRPC nor the
replanner.
"""

from __future__ import annotations

from libra.errors import Conflict, InvalidArgument
from libra.plans import check_plan, from_proto, to_proto
from libra.v1 import common_pb2, planner_pb2

SOURCE = TRIGGER = "manual"
MAX_REASON = 1000
"""Characters a hand-made plan's reason may have."""
STORE_ATTEMPTS = 3
"""Times SetPlan reads the stored generation again after another writer (a replan) took the next one."""


def requested_plan(request: planner_pb2.SetPlanRequest, max_gpus: int, now: float) -> common_pb2.Plan:
    """The plan a SetPlan asks for (generation 0: not stored yet), within the bounds a plan on the
    wire has (raises InvalidArgument naming the field); a training field left 0 reads 1, as in
    every plan (libra.plans.from_proto), and is stored so."""
    reason = request.reason.strip()
    if not reason:
        raise InvalidArgument("reason is required: say why this plan is set by hand (Explain shows it)")
    if len(reason) > MAX_REASON:
        raise InvalidArgument(f"reason must be at most {MAX_REASON} characters, got {len(reason)}")
    plan = common_pb2.Plan(training=request.training, buckets=request.buckets, source=SOURCE, reason=reason,
                           created_at=now)
    check_plan(plan, max_gpus)
    return to_proto(from_proto(plan))


async def store_next(store, requested: common_pb2.Plan) -> tuple[common_pb2.Plan, common_pb2.Plan | None]:
    """Store `requested` as the generation after the stored one; returns (stored plan, the plan it
    replaced). A replan that stores the same generation first wins it: read again and take the next."""
    for _ in range(STORE_ATTEMPTS):
        previous = await store.get_plan()
        plan = common_pb2.Plan()
        plan.CopyFrom(requested)
        plan.generation = (previous.generation if previous is not None else 0) + 1
        try:
            await store.put_plan(plan)
        except Conflict:
            continue
        return plan, previous
    raise Conflict(f"other plans were stored {STORE_ATTEMPTS} times while this one was being stored; "
                   f"send SetPlan again")


def decision(plan: common_pb2.Plan, previous: common_pb2.Plan | None, now: float) -> planner_pb2.PlanDecision:
    """The record of a hand-made plan in plan:decisions (Explain shows it, marked as set by hand)."""
    record = planner_pb2.PlanDecision(
        timestamp=now, chosen=plan, applied=True, reason=f"set by hand: {plan.reason}", trigger=TRIGGER,
        candidates=[planner_pb2.Candidate(plan=plan, feasible=True, note="set by hand (Planner.SetPlan)")])
    if previous is not None:
        record.current.CopyFrom(previous)
    return record
