"""The report of a comparison: JSON, a Markdown table, goal checks and PNG plots.

matplotlib is imported only by :func:`write_plots`, so the simulator runs
(and writes JSON and Markdown) where it is not installed: ``pip install
'slicebroker[sim]'`` adds it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .engine import Result
from .metrics import LARGE_GANG_GPUS
from .workloads import Workload

OURS = "fairshare"
LABELS = {
    "fairshare": "fair share + contracts (ours)",
    "priority": "strict priority + quotas",
    "slurm": "Slurm-like multifactor",
    "fifo": "FIFO",
}


def fmt_duration(seconds: float | None) -> str:
    """A wait or a drain, short: ``0 s``, ``42 s``, ``3.5 min``, ``2.1 h``, ``4.2 d``."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "–"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def comparison(workload: Workload, results: Sequence[Result]) -> dict[str, Any]:
    """Everything the report shows, JSON-able."""
    return {
        "workload": {
            "name": workload.name,
            "jobs": len(workload.jobs),
            "nodes": len(workload.nodes),
            "gpus": workload.capacity,
            "days": workload.end / 86400,
            "offered_load": workload.offered_load(),
            "node_events": len(workload.node_events),
            "notes": list(workload.notes),
        },
        "policies": {r.policy: {"summary": r.summary, "stats": r.stats} for r in results},
    }


def _wait(summary: Mapping[str, Any], cls: str, q: str) -> float | None:
    """A wait figure of a class (``debug``, ``batch 1``…) or of a group (``debug
    within cap``, ``batch ≥ 32 GPUs``); None where the run had no such request."""
    entry = summary["waits"].get(cls) or summary.get("wait_groups", {}).get(cls)
    return None if entry is None else entry[q]


def _count(summary: Mapping[str, Any], cls: str) -> str:
    if cls not in summary["waits"] and "wait_groups" not in summary:
        return "–"  # a report written before such groups were measured
    entry = summary["waits"].get(cls) or summary["wait_groups"].get(cls)
    return "0" if entry is None else f"{entry['count']:,}"


def _maybe(summary: Mapping[str, Any], key: str, fmt) -> str:
    """``fmt`` of a figure that reports written before it was measured lack."""
    value = summary.get(key)
    return "–" if value is None else fmt(value)


def table(data: Mapping[str, Any]) -> str:
    """The Markdown table: one column per policy, one row per figure."""
    policies = list(data["policies"])
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, fn) -> None:
        rows.append(
            (label, [fn(data["policies"][p]["summary"], data["policies"][p]) for p in policies])
        )

    for q in ("p50", "p90", "p99"):
        row(f"debug wait {q}", lambda s, _, q=q: fmt_duration(_wait(s, "debug", q)))
    for group in ("debug within cap", "debug beyond cap"):
        row(
            f"{group} wait p90 / p99 (sessions)",
            lambda s, _, g=group: (
                f"{fmt_duration(_wait(s, g, 'p90'))} / {fmt_duration(_wait(s, g, 'p99'))}"
                f" ({_count(s, g)})"
            ),
        )
    row("interactive wait p90", lambda s, _: fmt_duration(_wait(s, "interactive", "p90")))
    classes = [c for c in _all_classes(data) if c.startswith("batch")]
    groups = {g for p in data["policies"].values() for g in p["summary"].get("wait_groups", {})}
    classes += sorted(g for g in groups if g.startswith("batch"))
    for cls in classes:
        row(f"{cls} wait p50", lambda s, _, c=cls: fmt_duration(_wait(s, c, "p50")))
        row(f"{cls} wait p90", lambda s, _, c=cls: fmt_duration(_wait(s, c, "p90")))
    row(
        "requests never started",
        lambda s, _: str(sum(v["not_started"] for v in s["waits"].values())),
    )
    row("occupancy", lambda s, _: _pct(s["occupancy"]))
    row(
        "occupancy while demand > capacity (hours)",
        lambda s, _: (
            f"{_pct(s.get('occupancy_oversubscribed'))} "
            f"({s.get('oversubscribed_hours', '–')} of {s.get('measured_hours', '–')} h)"
        ),
    )
    row(
        "goodput (of occupancy)",
        lambda s, _: f"{_maybe(s, 'goodput', _pct)} ({_maybe(s, 'goodput_of_occupancy', _pct)})",
    )
    row("owed GPU-h delivered", lambda s, _: _pct(s["owed_delivered"]))
    row(
        "projects ≥ 95% of owed",
        lambda s, _: f"{s['projects_at_95']}/{s['projects_owed']}",
    )
    row("worst project", lambda s, _: _pct(s["worst_project_delivered"]))
    row("owed delivered hour by hour", lambda s, _: _pct(s["owed_delivered_hourly"]))
    row(
        "worst project hour by hour",
        lambda s, _: _pct(s.get("worst_project_delivered_hourly")),
    )
    row("squatter idle GPU-h", lambda s, _: f"{s['squatter_idle_gpu_hours']:,.0f}")
    row("preemptions", lambda s, _: f"{s['preemptions_total']:,}")
    row(
        "preemptions per 1,000 GPU-h",
        lambda s, _: _maybe(s, "preemptions_per_1000_gpu_hours", lambda v: f"{v:,.1f}"),
    )
    row(
        "preemptions per completed job",
        lambda s, _: _maybe(s, "preemptions_per_completed_job", lambda v: f"{v:.2f}"),
    )
    row(
        "jobs preempted (≥ 3 times)",
        lambda s, _: (
            f"{_maybe(s, 'preempted_jobs', lambda v: f'{v:,}')} "
            f"({_maybe(s, 'jobs_preempted_3_or_more', lambda v: f'{v:,}')})"
        ),
    )
    row(
        "jobs that spent their preemption budget (budget)",
        lambda s, _: (
            f"{_maybe(s, 'jobs_at_budget', lambda v: f'{v:,}')} "
            f"({_maybe(s, 'preemption_budget', str)})"
        ),
    )
    row(
        "GPU-h held by jobs past their budget (of all held)",
        lambda s, _: (
            f"{_maybe(s, 'held_past_budget_gpu_hours', lambda v: f'{v:,.0f}')} "
            f"({_maybe(s, 'held_past_budget_share', lambda v: f'{v:.1%}')})"
        ),
    )
    row(
        "preemptions of multi-node jobs (their GPUs)",
        lambda s, _: (
            f"{_maybe(s, 'multi_node_preemptions', lambda v: f'{v:,}')} "
            f"({_maybe(s, 'multi_node_preempted_gpus', lambda v: f'{v:,}')})"
        ),
    )
    row(
        "preemptions of one job p99 / max",
        lambda s, _: (
            f"{_maybe(s, 'preemptions_per_job_p99', lambda v: f'{v:g}')} / "
            f"{_maybe(s, 'preemptions_per_job_max', str)}"
        ),
    )
    row(
        "fair-share preemptions matched by one the other way (of all fair-share)",
        lambda s, _: (
            f"{_maybe(s, 'fair_share_back_and_forth', lambda v: f'{v:,}')} "
            f"({(s.get('preemptions') or {}).get('fair_share', 0):,})"
        ),
    )
    row(
        "musical chairs: victims granted again within 1 h (GPU-h they cost)",
        lambda s, _: (
            f"{_maybe(s, 'musical_chairs', lambda v: f'{v:,}')} "
            f"({_maybe(s, 'musical_chairs_share', _pct)} of preemptions, "
            f"{_maybe(s, 'musical_chairs_gpu_hours', lambda v: f'{v:,.1f}')})"
        ),
    )
    row(
        "… of them, by the reason of the preemption",
        lambda s, _: (
            ", ".join(
                f"{reason} {count:,}"
                for reason, count in s.get("musical_chairs_by_reason", {}).items()
            )
            or "–"
        ),
    )
    row(
        "preemptions by what they served (musical chairs; the requester's wait p50)",
        lambda s, _: (
            ", ".join(
                f"{need} {figures['preemptions']:,} ({figures['musical_chairs']:,}"
                + (
                    f"; {fmt_duration(figures['requester_wait_p50'])})"
                    if figures["requester_wait_p50"] is not None
                    else ")"
                )
                for need, figures in s.get("preemptions_by_need", {}).items()
            )
            or "–"
        ),
    )
    row(
        "preemptions avoided by waiting (their wait p50 / p90)",
        lambda s, _: (
            f"{_maybe(s, 'avoided_preemptions', lambda v: f'{v:,}')} "
            f"({_maybe(s, 'avoided_wait_p50', fmt_duration)} / "
            f"{_maybe(s, 'avoided_wait_p90', fmt_duration)})"
        ),
    )
    row(
        "GPU-h lost to preemption (restarts)",
        lambda s, _: (
            f"{_maybe(s, 'preemption_lost_gpu_hours', lambda v: f'{v:,.1f}')} "
            f"({_gpu_hours(s.get('wasted_by_cause', {}).get('preemption', {}).get('restart'))})"
        ),
    )
    row("work lost (GPU-h)", lambda s, _: f"{s['lost_gpu_hours']:,.1f}")
    row(
        "drains (emptied)",
        lambda s, _: f"{s['drains']} ({s['drains_emptied']})",
    )
    row(
        "drain time to empty p50 / max",
        lambda s, _: (
            f"{fmt_duration(_h(s['drain_hours_p50']))} / {fmt_duration(_h(s['drain_hours_max']))}"
        ),
    )
    row("interventions", lambda s, _: str(s["interventions"]))
    row("completed jobs", lambda s, _: f"{s['completed']:,}")
    row("simulated in", lambda _, r: f"{r['stats']['wall_seconds']:.1f} s")
    header = "| | " + " | ".join(LABELS.get(p, p) for p in policies) + " |"
    lines = [header, "|---" + "|---:" * len(policies) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)


def _gpu_hours(gpu_hours: float | None) -> str:
    return "–" if gpu_hours is None else f"{gpu_hours:,.1f}"


def _size_label(cls: str) -> str:
    size = cls.removeprefix("batch ")
    labels = {"1": "1 GPU", "multi-node": "multi-node", "large": "large (> 1/4 cluster)"}
    return labels.get(size, size if size.endswith("GPUs") else f"{size} GPUs")


def _daily(hourly: Sequence[float]) -> list[float]:
    return [sum(hourly[i : i + 24]) for i in range(0, len(hourly), 24)]


def _h(hours: float | None) -> float | None:
    return None if hours is None else hours * 3600


def _all_classes(data: Mapping[str, Any]) -> list[str]:
    from .metrics import _class_order

    seen = {c for p in data["policies"].values() for c in p["summary"]["waits"]}
    return sorted(seen, key=_class_order)


# ---- goals (issues #5 and #10) ------------------------------------------------------------

Goal = tuple[str, bool | None, str]


def _at_most(value: float | None, limit: float | None) -> bool | None:
    return None if value is None or limit is None else value <= limit


def _best_baseline(
    data: Mapping[str, Any], figure, *, lowest: bool
) -> tuple[float | None, str | None]:
    """The best value of ``figure(summary)`` among the baselines, and whose it is."""
    values = [
        (value, name)
        for name, entry in data["policies"].items()
        if name != OURS and (value := figure(entry["summary"])) is not None
    ]
    if not values:
        return None, None
    value, name = min(values) if lowest else max(values)
    return value, name


def goals(data: Mapping[str, Any]) -> list[Goal]:
    """``(goal, met, detail)`` for our policy; ``met`` is None when it cannot be judged."""
    policies = data["policies"]
    if OURS not in policies:
        return []
    ours = policies[OURS]["summary"]
    out: list[Goal] = []
    p90 = _wait(ours, "debug", "p90")
    out.append(("debug p90 wait ≤ 30 s", _at_most(p90, 30), fmt_duration(p90)))
    capped = _wait(ours, "debug within cap", "p90")
    out.append(
        (
            "debug p90 wait ≤ 30 s within the per-user cap",
            _at_most(capped, 30),
            f"{fmt_duration(capped)} ({_count(ours, 'debug within cap')} sessions)",
        )
    )
    out += _delivery_goals(data, ours)
    occ = ours["occupancy"]
    out.append(("occupancy ≥ 98%", occ >= 0.98, _pct(occ)))
    crowded = ours.get("occupancy_oversubscribed")
    out.append(
        (
            "occupancy ≥ 98% while demand exceeds capacity",
            None if crowded is None else crowded >= 0.98,
            f"{_pct(crowded)} over {ours.get('oversubscribed_hours', '–')} of "
            f"{ours.get('measured_hours', '–')} h after the warm-up",
        )
    )
    share = ours.get("goodput_of_occupancy")
    out.append(
        (
            "goodput ≥ 95% of occupancy",
            None if share is None else share >= 0.95,
            f"{_pct(share)} (goodput {_maybe(ours, 'goodput', _pct)}, occupancy {_pct(occ)})",
        )
    )
    out += _churn_goals(ours)
    out += _large_job_goals(data, ours)
    out.append(
        ("zero interventions for drains", ours["interventions"] == 0, str(ours["interventions"]))
    )
    return out


def _delivery_goals(data: Mapping[str, Any], ours: Mapping[str, Any]) -> list[Goal]:
    owed, worst = ours["owed_delivered"], ours["worst_project_delivered"]
    hourly = ours["owed_delivered_hourly"]
    best, whose = _best_baseline(data, lambda s: s["owed_delivered_hourly"], lowest=False)
    return [
        ("≥ 98% of owed GPU-hours overall", None if owed is None else owed >= 0.98, _pct(owed)),
        (
            "≥ 95% of owed GPU-hours for every project",
            None if worst is None else worst >= 0.95,
            f"worst {_pct(worst)}; {ours['projects_at_95']}/{ours['projects_owed']} at ≥ 95%",
        ),
        (
            "≥ 95% of owed GPU-hours hour by hour",
            None if hourly is None else hourly >= 0.95,
            _pct(hourly),
        ),
        (
            "owed GPU-hours hour by hour ≥ every baseline's",
            None if hourly is None or best is None else hourly >= best,
            f"{_pct(hourly)} vs {_pct(best)} ({LABELS.get(whose or '', whose or '–')})",
        ),
    ]


def _churn_goals(ours: Mapping[str, Any]) -> list[Goal]:
    most = ours.get("preemptions_per_job_max")
    over = ours.get("jobs_preempted_more_than_3")
    rate = ours.get("preemptions_per_completed_job")
    chairs = ours.get("musical_chairs_share")
    return [
        (
            "no job preempted more than 3 times",
            None if most is None else most <= 3,
            f"max {_maybe(ours, 'preemptions_per_job_max', str)}; "
            f"{'–' if over is None else f'{over:,}'} jobs more than 3 times",
        ),
        (
            "≤ 1 preemption per 10 completed jobs",
            None if rate is None else rate <= 0.1,
            f"{_maybe(ours, 'preemptions_per_completed_job', lambda v: f'{10 * v:.1f}')} per 10 "
            f"({ours['preemptions_total']:,} for {ours['completed']:,})",
        ),
        (
            "musical chairs ≤ 5% of preemptions",
            None if chairs is None else chairs <= 0.05,
            f"{_maybe(ours, 'musical_chairs_share', _pct)} "
            f"({_maybe(ours, 'musical_chairs', lambda v: f'{v:,}')} victims granted again "
            "within 1 h)",
        ),
    ]


def _large_job_goals(data: Mapping[str, Any], ours: Mapping[str, Any]) -> list[Goal]:
    policies = data["policies"]
    out: list[Goal] = []
    quarter = data["workload"]["gpus"] / 4
    has_large = any("batch large" in p["summary"]["waits"] for p in policies.values())
    if has_large:
        large, judged = _wait(ours, "batch large", "p90"), "large-job"
    else:
        # no job above a quarter of the cluster: judge the largest class the trace has
        judged = f"batch ≥ {LARGE_GANG_GPUS} GPUs"
        if _wait(ours, judged, "p90") is None:
            judged = "batch multi-node"
        large = _wait(ours, judged, "p90")
        out.append(
            (
                f"large jobs (> a quarter of the cluster, {quarter:g} GPUs)",
                None,
                f"none in the trace: judged on {judged.removeprefix('batch ')} below",
            )
        )
        judged = judged.removeprefix("batch ")
    if "priority" in policies:
        cls = "batch large" if has_large else f"batch {judged}"
        theirs = _wait(policies["priority"]["summary"], cls, "p90")
        detail = f"{fmt_duration(large)} vs {fmt_duration(theirs)}"
        out.append((f"{judged} p90 wait ≤ strict priority's", _at_most(large, theirs), detail))
    mine = _wait(ours, "batch multi-node", "p90")
    best, whose = _best_baseline(data, lambda s: _wait(s, "batch multi-node", "p90"), lowest=True)
    out.append(
        (
            "multi-node p90 wait ≤ best baseline's",
            _at_most(mine, best),
            f"{fmt_duration(mine)} vs {fmt_duration(best)} ({LABELS.get(whose or '', '–')})",
        )
    )
    return out


def goals_markdown(data: Mapping[str, Any]) -> str:
    lines = ["| goal | met | ours |", "|---|:---:|---:|"]
    for goal, met, detail in goals(data):
        mark = "–" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {goal} | {mark} | {detail} |")
    return "\n".join(lines)


#: The figures :func:`seeds_markdown` compares across seeds: (label, how to read it
#: from a policy's summary, how to show it).
SEED_FIGURES: tuple[tuple[str, Any, Any], ...] = (
    ("debug wait p90 within the cap", lambda s: _wait(s, "debug within cap", "p90"), fmt_duration),
    ("batch 1 wait p90", lambda s: _wait(s, "batch 1", "p90"), fmt_duration),
    ("owed GPU-h delivered", lambda s: s.get("owed_delivered"), _pct),
    ("worst project", lambda s: s.get("worst_project_delivered"), _pct),
    ("owed delivered hour by hour", lambda s: s.get("owed_delivered_hourly"), _pct),
    ("occupancy", lambda s: s.get("occupancy"), _pct),
    ("preemptions per completed job", lambda s: s.get("preemptions_per_completed_job"),
     lambda v: "–" if v is None else f"{v:.3f}"),
    ("most preemptions of one job", lambda s: s.get("preemptions_per_job_max"),
     lambda v: "–" if v is None else f"{v:.1f}".removesuffix(".0")),
    ("musical chairs", lambda s: s.get("musical_chairs_share"), _pct),
)  # fmt: skip


def seeds_markdown(runs: Mapping[int, Mapping[str, Any]]) -> str:
    """The headline figures of one comparison run under several seeds (``runs``: seed ->
    :func:`comparison`): per policy, each seed's value and their mean. The figures of
    one run move between seeds (the worst project by ten points and more): a change
    to the policy is judged on the means and the spread, not on one run."""
    seeds = list(runs)
    policies = list(next(iter(runs.values()))["policies"])
    header = " | ".join(f"seed {seed}" for seed in seeds)
    lines = [f"| figure | policy | {header} | mean |", "|---|---|" + "---:|" * (len(seeds) + 1)]
    for label, read, show in SEED_FIGURES:
        for policy in policies:
            values = [read(runs[seed]["policies"][policy]["summary"]) for seed in seeds]
            known = [v for v in values if v is not None]
            mean = sum(known) / len(known) if known else None
            cells = " | ".join(show(v) for v in [*values, mean])
            lines.append(f"| {label} | {LABELS.get(policy, policy)} | {cells} |")
    return "\n".join(lines)


# ---- files ---------------------------------------------------------------------------------


def write_report(
    directory: str | Path, workload: Workload, results: Sequence[Result], *, plots: bool = True
) -> list[Path]:
    """Write ``NAME.json``, ``NAME.md`` and (with matplotlib) ``NAME-*.png`` into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = comparison(workload, results)
    name = workload.name
    written = [directory / f"{name}.json"]
    written[0].write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    figures: list[Path] = []
    if plots:
        figures = write_plots(directory, data)
    md = directory / f"{name}.md"
    md.write_text(markdown(data, [f.name for f in figures]))
    return [*written, md, *figures]


def render(path: str | Path, *, plots: bool = True) -> list[Path]:
    """Write the Markdown and plots of a report again from its JSON (``NAME.json``)."""
    path = Path(path)
    data = json.loads(path.read_text())
    figures = write_plots(path.parent, data) if plots else []
    md = path.with_suffix(".md")
    md.write_text(markdown(data, [f.name for f in figures]))
    return [md, *figures]


def markdown(data: Mapping[str, Any], figures: Sequence[str] = ()) -> str:
    w = data["workload"]
    lines = [
        f"# Simulation: {w['name']}",
        "",
        f"{w['jobs']:,} jobs over {w['days']:.1f} days on {w['nodes']} nodes ({w['gpus']} GPUs); "
        f"the jobs ask {w['offered_load']:.2f}× the GPU-time the cluster has; "
        f"{w['node_events']} node events (drains and failures).",
        "",
        *[f"- {note}" for note in w["notes"]],
        "",
        table(data),
        "",
    ]
    if OURS in data["policies"]:
        lines += ["## Goals for our policy", "", goals_markdown(data), ""]
    for figure in figures:
        lines += [f"![{figure}]({figure})", ""]
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON-able: {value!r}")


def write_plots(directory: Path, data: Mapping[str, Any]) -> list[Path]:
    """Four figures: waits, owed GPU-hours per project, occupancy and preemptions over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = data["workload"]["name"]
    written = []
    for suffix, draw in (
        ("waits", _plot_waits),
        ("owed", _plot_owed),
        ("occupancy", _plot_occupancy),
        ("preemptions", _plot_preemptions),
    ):
        fig = draw(plt, data)
        path = directory / f"{name}-{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _plot_waits(plt, data: Mapping[str, Any]):
    """Debug CDF (log time axis) and batch p90 by size (linear axis, values written)."""
    policies = list(data["policies"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), width_ratios=(1, 1.6))
    for p in policies:
        sample = data["policies"][p]["summary"]["wait_samples"].get("debug", [])
        if sample:
            ys = [(i + 1) / len(sample) for i in range(len(sample))]
            left.step([max(v, 0.5) for v in sample], ys, where="post", label=LABELS.get(p, p))
    left.set_xscale("log")
    ticks = [1, 10, 60, 600, 3600, 6 * 3600, 86400, 7 * 86400]
    left.set_xticks(ticks, ["1 s", "10 s", "1 min", "10 min", "1 h", "6 h", "1 d", "7 d"])
    left.axvline(30, color="grey", linestyle=":", linewidth=1)
    left.set_xlabel("debug session wait (log scale; 0 s at the left edge; dotted: the 30 s goal)")
    left.set_ylabel("fraction of sessions")
    left.set_title("Debug sessions: time to a GPU")
    left.legend(fontsize=8, loc="center right")
    classes = [c for c in _all_classes(data) if c.startswith("batch")]
    width = 0.8 / max(1, len(policies))
    longest = max(
        (_wait(data["policies"][p]["summary"], c, "p90") or 0 for p in policies for c in classes),
        default=0,
    )
    unit, per = ("days", 86400) if longest > 48 * 3600 else ("hours", 3600)
    for i, p in enumerate(policies):
        s = data["policies"][p]["summary"]
        values = [(_wait(s, c, "p90") or 0) / per for c in classes]
        xs = [x + i * width for x in range(len(classes))]
        right.bar(xs, values, width, label=LABELS.get(p, p))
        for x, value, c in zip(xs, values, classes, strict=True):
            entry = s["waits"].get(c)
            if not entry:
                continue
            text = fmt_duration(value * per)
            if entry["not_started"]:
                never = 100 * entry["not_started"] / entry["count"]
                text += f"\n{never:.0f}% never started" if never >= 1 else "\n< 1% never started"
            right.annotate(
                text,
                (x, value),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7.5,
                rotation=90,
            )
    right.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(classes))])
    right.set_xticklabels([_size_label(c) for c in classes])  # colours as on the left
    right.set_ylim(0, longest / per * 1.6 if longest else 1)
    right.set_ylabel(f"p90 wait ({unit})")
    right.set_title("Batch jobs: p90 wait by size, and the share that never started")
    fig.tight_layout()
    return fig


def _plot_owed(plt, data: Mapping[str, Any]):
    """Per project: owed GPU-hours delivered over the run (bars) and hour by hour (ticks)."""
    policies = list(data["policies"])
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(12, 5.5))
    first = data["policies"][policies[0]]["summary"]["projects"]
    projects = sorted(first)
    for i, p in enumerate(policies):
        s = data["policies"][p]["summary"]
        per = s["projects"]
        xs = [k + i * width for k in range(len(projects))]
        label = (
            f"{LABELS.get(p, p)}: {_pct(s['owed_delivered'])} over the run, "
            f"{_pct(s['owed_delivered_hourly'])} hour by hour"
        )
        bars = ax.bar(xs, [100 * (per[x]["delivered_fraction"] or 0) for x in projects], width)
        bars.set_label(label)
        hourly = [100 * (per[x].get("hourly_delivered_fraction") or 0) for x in projects]
        ax.scatter(xs, hourly, marker="_", s=120, color="black", linewidth=1.5, zorder=3)
    ax.axhline(95, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks([k + width * (len(policies) - 1) / 2 for k in range(len(projects))])
    ax.set_xticklabels(
        [f"{x}\n{100 * first[x]['entitlement']:.1f}%" for x in projects],
        fontsize=8,
    )
    ax.set_ylabel("owed GPU-hours delivered (%)")
    ax.set_ylim(0, 105)
    ax.set_title(
        "Owed GPU-hours delivered per project: bars over the run, black ticks hour by hour\n"
        "(entitlement below the name; dotted: 95%)"
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def _plot_occupancy(plt, data: Mapping[str, Any]):
    """Day by day: GPUs held over usable GPUs, with what was held idle or wasted."""
    policies = list(data["policies"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    drawn = set()
    for p in policies:
        hourly = data["policies"][p]["summary"]["hourly"]
        held, cap, idle = (_daily(hourly[k]) for k in ("held_gpus", "capacity_gpus", "idle_gpus"))
        days = [d + 0.5 for d in range(len(held))]

        def share(values, cap=cap):
            return [100 * v / c if c else 0 for v, c in zip(values, cap, strict=True)]

        (line,) = top.plot(days, share(held), linewidth=1.2, marker=".", label=LABELS.get(p, p))
        colour = line.get_color()
        if any(idle):
            top.plot(days, share(idle), linewidth=0.8, linestyle="--", color=colour)
            drawn.add("dashed: held idle")
        if "busy_gpus" in hourly and any(hourly.get("wasted_gpus", ())):
            useful = [
                b - w
                for b, w in zip(
                    _daily(hourly["busy_gpus"]), _daily(hourly["wasted_gpus"]), strict=True
                )
            ]
            top.plot(days, share(useful), linewidth=0.8, linestyle=":", color=colour)
            drawn.add("dotted: goodput")
        hours = range(len(hourly["pending_gpus"]))
        bottom.plot([h / 24 for h in hours], hourly["pending_gpus"], linewidth=0.8, color=colour)
    key = f"\n({'; '.join(sorted(drawn))})" if drawn else ""
    top.set_ylabel(f"occupancy (%){key}")
    top.set_ylim(0, 102)
    top.legend(fontsize=8, loc="lower center")
    top.set_title("GPUs held over usable GPUs, day by day")
    bottom.set_ylabel("GPUs asked by\npending requests")
    bottom.set_yscale("symlog", linthresh=10)
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("day")
    fig.tight_layout()
    return fig


PREEMPTION_BIN_HOURS = 6


def _plot_preemptions(plt, data: Mapping[str, Any]):
    """Preemptions per 6 hours by reason, one panel per policy that preempts."""
    preempting = [
        p
        for p, entry in data["policies"].items()
        if any(sum(v) for v in entry["summary"]["hourly"].get("preemptions", {}).values())
    ]
    fig, axes = plt.subplots(
        max(1, len(preempting)), 1, figsize=(12, 2.5 + 2 * len(preempting)), squeeze=False
    )
    if not preempting:
        ax = axes[0][0]
        ax.text(0.5, 0.5, "no policy preempted", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    step = PREEMPTION_BIN_HOURS
    for ax, p in zip((row[0] for row in axes), preempting, strict=True):
        summary = data["policies"][p]["summary"]
        for reason, counts in summary["hourly"]["preemptions"].items():
            binned = [sum(counts[i : i + step]) for i in range(0, len(counts), step)]
            ax.plot(
                [(i + 0.5) * step / 24 for i in range(len(binned))],
                binned,
                linewidth=1.2,
                label=f"{reason.replace('_', ' ')} ({sum(counts):,})",
            )
        ax.axvline(summary["warmup_hours"] / 24, color="grey", linestyle=":", linewidth=1)
        ax.set_ylabel(f"preemptions\nper {step} h")
        ax.set_title(f"{LABELS.get(p, p)}: preemptions by reason (dotted: end of the warm-up)")
        ax.legend(fontsize=8, loc="upper left")
    axes[-1][0].set_xlabel("day")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        for written in render(name):
            print(f"wrote {written}")
