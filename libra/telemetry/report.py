"""`libra report RUN_DIR`: one self-contained HTML page about a run, from its run record.

```
 RUN_DIR/telemetry/*.jsonl ─▶ record.load ─▶ charts (matplotlib → inline SVG) ─▶ RUN_DIR/report.html
 RUN_DIR/config.yaml (run id, steps asked for; optional)  ┘
```
The page needs nothing else: no network, no script, no file beside it; it can be mailed or
attached to an issue. `libra up` writes it at the end of every run; for a run under compose or
Slurm (or one that was stopped), run `libra report RUN_DIR` on any machine that sees the directory.
"""

from __future__ import annotations

import datetime
import html
import os
import pathlib
from typing import Any, Callable

from libra.errors import ConfigError
from libra.telemetry import charts
from libra.telemetry.record import RunRecord, load

STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2330;
       background: #f6f7f9; }
main { max-width: 920px; margin: 0 auto; padding: 24px 20px 48px; }
h1 { font-size: 24px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 32px 0 8px; }
.meta { color: #5b6475; font-size: 13px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 18px 0 4px; }
.card { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
.card b { display: block; font-size: 19px; } .card span { color: #5b6475; font-size: 12px; }
figure { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; margin: 10px 0; padding: 10px; }
figure svg { width: 100%; height: auto; display: block; }
figcaption { color: #5b6475; font-size: 13px; margin-top: 6px; }
.empty { color: #5b6475; font-style: italic; }
table { border-collapse: collapse; width: 100%; background: #fff; font-size: 13px; }
th, td { border: 1px solid #dde1e8; padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: #eef0f4; } td.yes { color: #2f7d43; font-weight: 600; } td.no { color: #777; }
footer { margin-top: 36px; color: #5b6475; font-size: 12px; }
"""


def _run_config(run_dir: pathlib.Path) -> dict[str, Any]:
    import yaml

    path = run_dir / "config.yaml"
    try:
        tree = yaml.safe_load(path.read_text()) if path.exists() else {}
    except yaml.YAMLError:
        tree = {}
    return tree if isinstance(tree, dict) else {}


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s"


def _cards(record: RunRecord, config: dict[str, Any]) -> list[tuple[str, str]]:
    cards = [("duration", _duration(record.ended_at - record.started_at))]
    wanted = config.get("trainer", {}).get("steps")
    if record.steps:
        last = record.steps[-1]
        cards.append(("steps", f"{last['step']}" + (f" / {wanted}" if wanted else "")))
        rewards = [row["scalars"].get("reward/mean") or 0.0 for row in record.steps]
        window = 10 if len(rewards) >= 20 else max(1, len(rewards) // 2)
        cards.append((f"reward, first {window} steps", f"{sum(rewards[:window]) / window:.3f}"))
        cards.append((f"reward, last {window} steps", f"{sum(rewards[-window:]) / window:.3f}"))
        trained = sum(row["scalars"].get("batch/trajectories") or 0 for row in record.steps)
        cards.append(("trajectories trained", f"{int(trained):,}"))
        cards.append(("policy version", f"v{last['policy_version']}"))
    cards.append(("C-MLFQ moves", f"{len(record.moves):,}"))
    cards.append(("plan decisions", f"{len(record.decisions)}"))
    return cards


def _figure(chart: charts.Chart) -> str:
    return (f'<figure class="chart" id="{chart.key}" data-chart="{chart.key}">{chart.svg}'
            f"<figcaption>{html.escape(chart.caption)}</figcaption></figure>")


def _section(title: str, found: list[charts.Chart | None], empty: str, extra: str = "") -> str:
    shown = [chart for chart in found if chart is not None]
    body = "".join(_figure(chart) for chart in shown) or (f'<p class="empty">{html.escape(empty)}</p>' if empty else "")
    return f"<section><h2>{html.escape(title)}</h2>{body}{extra}</section>"


def _decisions_table(record: RunRecord) -> str:
    if not record.decisions:
        return ""
    rows = []
    for index, decision in enumerate(record.decisions, start=1):
        applied = bool(decision.get("applied"))
        rows.append(
            f"<tr><td>#{index}</td><td>{_duration(record.elapsed(decision))}</td>"
            f"<td>{html.escape(decision.get('trigger') or 'config')}</td>"
            f"<td class=\"{'yes' if applied else 'no'}\">{'applied' if applied else 'not applied'}</td>"
            f"<td>{html.escape(decision.get('reason') or '')}</td>"
            f"<td>{html.escape(decision.get('plan') or '')}</td></tr>")
    return ("<table class=\"decisions\"><thead><tr><th></th><th>at</th><th>trigger</th><th>outcome</th><th>why</th>"
            f"<th>plan</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def render(record: RunRecord, config: dict[str, Any] | None = None) -> str:
    """The whole page as one string."""
    config = config if config is not None else _run_config(record.run_dir)
    run_id = config.get("run_id") or record.run_dir.name
    started = datetime.datetime.fromtimestamp(record.started_at, datetime.timezone.utc)
    cards = "".join(f"<div class=\"card\"><b>{html.escape(value)}</b><span>{html.escape(label)}</span></div>"
                    for label, value in _cards(record, config))
    planner_mode = config.get("planner", {}).get("mode", "")
    sections = [
        _section("Reward", [*charts.reward(record)], "No training step was recorded yet."),
        _section("Step time", [charts.step_time(record)], "No training step was recorded yet."),
        _section("Rollout", [charts.rollout(record)], "No rollout sample was recorded (the gateway samples every "
                 "telemetry.sample_s once its workers serve)."),
        _section("Buckets and moves", [charts.buckets(record)], "No scheduler sample was recorded (the scheduler "
                 "samples as it routes turns)."),
        _section("Planner", [charts.planner(record)], "" if record.decisions else "No plan decision was recorded.",
                 _decisions_table(record) + ('<p class="meta">The planner ran in static mode: the configured plan '
                                             'held for the whole run, with no calibration to show.</p>'
                                             if planner_mode == "static" else "")),
        _section("Staleness", [charts.staleness(record)], "No trained trajectory was recorded yet."),
        _section("Rollout workers", [charts.worker_lag(record)], "No worker versions were recorded."),
    ]
    skipped = f"; {record.skipped} unreadable lines skipped" if record.skipped else ""
    written = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>Libra run {html.escape(run_id)}</title><style>{STYLE}</style></head><body><main>"
        f"<h1>Libra run {html.escape(run_id)}</h1>"
        f"<div class=\"meta\">{html.escape(str(record.run_dir))} · started "
        f"{started.strftime('%Y-%m-%d %H:%M:%S UTC')}</div><div class=\"cards\">{cards}</div>"
        + "".join(sections)
        + f"<footer>Written by <code>libra report</code> at {written} from {html.escape(str(record.run_dir))}"
        f"/telemetry{skipped}. The same values, live: <code>tensorboard --logdir "
        f"{html.escape(str(record.run_dir))}/tensorboard</code>.</footer></main></body></html>\n")


def write_report(run_dir: str | pathlib.Path, out: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write the page (default RUN_DIR/report.html, replaced atomically); returns its path."""
    record = load(run_dir)
    path = pathlib.Path(out) if out is not None else record.run_dir / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f".{path.name}.{os.getpid()}")
    draft.write_text(render(record), encoding="utf-8")
    os.replace(draft, path)
    return path


def write_at_end(run_dir: str | pathlib.Path, say: Callable[[str], None]) -> pathlib.Path | None:
    """`libra up`'s last act: the report of the run that just stopped, however it stopped; says where
    it is, or why there is none (no service recorded anything; matplotlib missing). Never raises
    for those: the run's exit code is the run's."""
    try:
        path = write_report(run_dir)
    except ConfigError as error:
        say(f"no run report: {error}")
        return None
    except ImportError as error:
        say(f"no run report: {error.name or error} is not installed (pip install matplotlib; then libra report "
            f"{run_dir})")
        return None
    say(f"run report: {path} (again at any time: libra report {run_dir})")
    return path
