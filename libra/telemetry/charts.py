"""The report's charts: matplotlib figures from a `RunRecord`, each returned as inline SVG text.

Each function returns `Chart` (title, SVG, caption) or None when the run has no data for it (the
report then says why). SVG keeps the page self-contained and sharp at any zoom; text stays text
(svg.fonttype none) so the page is small, and every id in a chart is prefixed with the chart's key
so that the ids of two charts never collide in one page.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

from libra.telemetry.record import RunRecord

PHASES = (("time/wait_s", "wait for rollout", "#b8b8b8"), ("time/train_s", "train", "#4c72b0"),
          ("time/publish_s", "publish weights", "#dd8452"))


@dataclass(frozen=True)
class Chart:
    key: str
    title: str
    svg: str
    caption: str


def _figure(rows: int = 1, height: float = 3.2, **options):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, 1, figsize=(8.4, height), **options)


def _svg(fig, key: str) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "libra"}):
        fig.tight_layout()
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    # matplotlib numbers its ids per figure (figure_1, patch_1, ...): prefix them with the chart's
    # key, and every reference to them, so that the ids of one page stay unique
    text = re.sub(r'\bid="([^"]+)"', rf'id="{key}-\1"', text)
    return re.sub(r'(url\(#|href="#)([^")]+)', rf"\g<1>{key}-\2", text)


def _minutes(seconds: list[float]) -> list[float]:
    return [s / 60 for s in seconds]


def _timeline(ax, record: RunRecord) -> None:
    """The x axis of every chart over time: the whole run, in minutes, so that they line up."""
    ax.set_xlim(0, max(record.ended_at - record.started_at, 1.0) / 60 * 1.02)
    ax.set_xlabel("minutes since the run started")


def _moving_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def reward(record: RunRecord) -> list[Chart]:
    if not record.steps:
        return []
    steps = [row["step"] for row in record.steps]
    means = [row["scalars"].get("reward/mean") or 0.0 for row in record.steps]
    window = max(1, min(10, len(steps) // 5))
    charts = []
    for key, xs, label in (("reward-step", steps, "training step"),
                           ("reward-time", _minutes([record.elapsed(r) for r in record.steps]), "")):
        fig, ax = _figure()
        if not label:
            _timeline(ax, record)
        lows = [row["scalars"].get("reward/min") for row in record.steps]
        highs = [row["scalars"].get("reward/max") for row in record.steps]
        if all(v is not None for v in lows + highs):
            ax.fill_between(xs, lows, highs, color="#4c72b0", alpha=0.12, lw=0, label="min to max of the batch")
        ax.plot(xs, means, marker="o", ms=2.5, lw=1, color="#4c72b0", label="mean reward of the batch")
        if window > 1:
            ax.plot(xs, _moving_mean(means, window), lw=2.2, color="#c44e52", label=f"moving mean ({window} steps)")
        if label:
            ax.set_xlabel(label)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        title = "Reward by training step" if key == "reward-step" else "Reward by wall-clock time"
        charts.append(Chart(key, title, _svg(fig, key), "Mean reward of each step's batch (GRPO groups), "
                            f"its spread, and a {window}-step moving mean."))
    return charts


def step_time(record: RunRecord) -> Chart | None:
    if not record.steps:
        return None
    fig, ax = _figure()
    steps = [row["step"] for row in record.steps]
    bottom = [0.0] * len(steps)
    for tag, label, color in PHASES:
        values = [row["scalars"].get(tag) or 0.0 for row in record.steps]
        ax.bar(steps, values, bottom=bottom, width=0.85, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("training step")
    ax.set_ylabel("seconds")
    ax.set_ylim(0, max(bottom) * 1.3 or 1.0)  # room for the legend above the bars
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", fontsize=8, ncol=3)
    return Chart("step-time", "Where each step's time went", _svg(fig, "step-time"),
                 "Waiting for whole groups from rollout, the optimizer step, and publishing the new policy "
                 "version to the workers (the trainer's time/* tags).")


def buckets(record: RunRecord) -> Chart | None:
    if not record.scheduler:
        return None
    fig, (top, bottom) = _figure(2, 4.6, sharex=True, height_ratios=[3, 1.6])
    names = sorted({name for row in record.scheduler for name in row.get("buckets", {})})
    times = _minutes([record.elapsed(row) for row in record.scheduler])
    for name in names:
        top.step(times, [row.get("buckets", {}).get(name, {}).get("requests", 0) for row in record.scheduler],
                 where="post", lw=1.6, label=f"{name}: requests in flight")
    top.set_ylabel("requests")
    top.grid(alpha=0.3)
    top.legend(loc="upper right", fontsize=8)
    if record.moves:
        reasons = sorted({move["reason"] for move in record.moves})
        span = max(times[-1] if times else 0.0, max(record.elapsed(m) / 60 for m in record.moves))
        bins = [span * i / 40 for i in range(41)] if span > 0 else 10
        bottom.hist([[record.elapsed(m) / 60 for m in record.moves if m["reason"] == r] for r in reasons],
                    bins=bins, stacked=True, label=reasons)
        bottom.legend(loc="upper right", fontsize=7, ncol=2)
    else:
        bottom.text(0.5, 0.5, "no C-MLFQ moves in this run", ha="center", va="center", transform=bottom.transAxes)
    bottom.set_ylabel("moves")
    _timeline(bottom, record)
    bottom.grid(alpha=0.3)
    return Chart("buckets", "Bucket occupancy and C-MLFQ moves", _svg(fig, "buckets"),
                 f"Requests in flight per bucket (scheduler samples), and the {len(record.moves)} moves between "
                 "buckets by reason (move:WHY:DIRECTION:TO).")


def planner(record: RunRecord) -> Chart | None:
    if not record.ticks and len(record.decisions) < 2:  # one decision, the configured plan: the table says it
        return None
    fig, ax = _figure()
    for tag, label, color in (("planner/predicted_step_s", "predicted step time", "#4c72b0"),
                              ("planner/measured_step_s", "measured step time", "#c44e52")):
        xs, ys = record.scalar(record.ticks, tag)
        if xs:
            ax.plot(_minutes(xs), ys, lw=1.6, color=color, label=label)
    for index, decision in enumerate(record.decisions, start=1):
        x = record.elapsed(decision) / 60
        color = "#55a868" if decision.get("applied") else "#999999"
        ax.axvline(x, color=color, lw=1.2, ls="-" if decision.get("applied") else "--")
        ax.annotate(f"#{index}", (x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                    textcoords="offset points", fontsize=8, color=color)
    ax.plot([], [], color="#55a868", label="decision applied")
    ax.plot([], [], color="#999999", ls="--", label="decision not applied")
    _timeline(ax, record)
    if record.ticks:
        ax.set_ylabel("seconds")
    else:
        ax.set_yticks([])
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return Chart("planner", "The planner's decisions", _svg(fig, "planner"),
                 "Each decision (numbered as in the table below) on the run's timeline; in online mode also the "
                 "step time the calibrated cost model predicts against the one measured.")


def staleness(record: RunRecord) -> Chart | None:
    counts = record.staleness_counts()
    if not counts:
        return None
    fig, ax = _figure(height=2.8)
    ax.bar([str(lag) for lag in counts], list(counts.values()), color="#8172b3")
    rejected = sum(row["scalars"].get("staleness/rejected_trajectories") or 0 for row in record.steps)
    ax.set_xlabel("staleness (policy versions between a trajectory's oldest token and the trainer)")
    ax.set_ylabel("trajectories trained")
    ax.grid(alpha=0.3, axis="y")
    return Chart("staleness", "Staleness of the trained data", _svg(fig, "staleness"),
                 f"{sum(counts.values())} trajectories trained; {int(rejected)} more were rejected as too stale.")


def worker_lag(record: RunRecord) -> Chart | None:
    lags = record.worker_lags()
    if not lags:
        return None
    fig, ax = _figure(height=2.8)
    from matplotlib.ticker import MaxNLocator

    highest = 0
    for offset, (worker, (times, values)) in enumerate(sorted(lags.items())):
        ax.step(_minutes(times), [v + 0.04 * offset for v in values], where="post", lw=1.5, label=worker)
        highest = max(highest, *values)
    _timeline(ax, record)
    ax.set_ylim(-0.3, highest + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("versions behind")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return Chart("worker-lag", "Policy-version lag of each rollout worker", _svg(fig, "worker-lag"),
                 "The trainer's latest published version minus the version each worker serves, at each rollout "
                 "sample (lines are offset slightly so that equal ones stay visible).")


def rollout(record: RunRecord) -> Chart | None:
    xs, rates = record.scalar(record.rollout, "rollout/trajectories_per_s")
    if not xs:
        return None
    fig, ax = _figure(height=2.8)
    ax.plot(_minutes(xs), rates, lw=1.6, color="#4c72b0", label="trajectories / s")
    ax.set_ylabel("trajectories / s")
    _timeline(ax, record)
    ax.grid(alpha=0.3)
    right = ax.twinx()
    for tag, label, style in (("turn_latency/p50_s", "turn latency p50", "-"),
                              ("turn_latency/p90_s", "turn latency p90", ":")):
        lx, ly = record.scalar(record.rollout, tag)
        right.plot(_minutes(lx), ly, color="#c44e52", ls=style, lw=1.3, label=label)
    right.set_ylabel("seconds")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    return Chart("rollout", "Rollout throughput and turn latency", _svg(fig, "rollout"),
                 "Finished trajectories per second and the latency of a model turn, per sampling interval.")
