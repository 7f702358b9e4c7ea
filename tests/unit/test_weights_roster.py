"""The weights group's roster and generation decisions (libra/weights/roster.py)."""

from __future__ import annotations

from libra.weights.roster import GroupRecord, Roster, delivery, reform_reason


def test_roster_orders_workers_and_gives_each_tp_rank_its_own_rank():
    roster = Roster.of([("short-1", 1), ("long-0", 2), ("short-3", 0)])  # tp 0 (unset) counts as 1
    assert roster.ids == ["long-0", "short-1", "short-3"]
    assert roster.first_ranks() == {"long-0": 1, "short-1": 3, "short-3": 4}
    assert roster.world_size == 5 and roster and not Roster.of([])
    record = GroupRecord(7, 12, roster)
    assert GroupRecord.from_blob(7, GroupRecord.payload(12, roster)) == record
    wire = record.to_proto()  # what UpdateWeights carries: the gateway rebuilds the very same record
    assert [(m.worker_id, m.tp) for m in wire.members] == [("long-0", 2), ("short-1", 1), ("short-3", 1)]
    assert GroupRecord.from_proto(type(wire).FromString(wire.SerializeToString())) == record
    assert Roster.from_proto(roster.to_proto()) == roster


def test_a_new_generation_when_there_is_none_or_the_workers_changed():
    two = Roster.of([("a", 1), ("b", 1)])
    assert reform_reason(None, two).startswith("no usable generation")
    assert reform_reason(two, Roster.of([("b", 1), ("a", 1)])) is None  # same workers, any order
    assert reform_reason(two, Roster.of([("a", 1), ("c", 1)])) == "workers added ['c'], removed ['b']"
    assert reform_reason(two, Roster.of([("a", 1), ("b", 2)])) == "workers added ['b'], removed ['b']"  # new TP


def test_the_gateway_receives_joins_or_loads_from_disk():
    record = GroupRecord(3, 10, Roster.of([("a", 1), ("b", 1)]))
    assert delivery(record, 3, {"a", "b", "c"}, 11).how == "group"  # c (not a member) loads from disk
    assert delivery(record, 2, {"a", "b"}, 10).how == "join"  # formed for this version: join it now
    late = delivery(record, None, {"a", "b"}, 11)  # formed earlier without us (a gateway restart)
    assert late.how == "disk" and "not ranks of generation 3" in late.why
    gone = delivery(record, 3, {"a"}, 11)  # a member died: nobody waits for it
    assert gone.how == "disk" and "['b']" in gone.why
    assert delivery(None, None, {"a"}, 1).how == "disk"
