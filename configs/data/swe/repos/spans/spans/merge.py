def merge(intervals):
    """Merge overlapping or touching closed intervals [start, end]; returns them sorted."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(span) for span in merged]


def total_length(intervals):
    """Number of integers covered by the closed intervals."""
    return sum(end - start + 1 for start, end in merge(intervals))
