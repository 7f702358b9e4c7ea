from spans.merge import merge, total_length


def test_disjoint_stay_apart():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_overlapping_merge():
    assert merge([(1, 4), (3, 8)]) == [(1, 8)]


def test_touching_intervals_merge():
    assert merge([(1, 3), (3, 5)]) == [(1, 5)]


def test_total_length_counts_shared_points_once():
    assert total_length([(1, 3), (3, 5)]) == 5


def test_empty():
    assert merge([]) == []
