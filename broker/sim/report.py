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
    entry = summary["waits"].get(cls)
    return None if entry is None else entry[q]


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
    row("interactive wait p90", lambda s, _: fmt_duration(_wait(s, "interactive", "p90")))
    classes = [c for c in _all_classes(data) if c.startswith("batch")]
    for cls in classes:
        row(f"{cls} wait p50", lambda s, _, c=cls: fmt_duration(_wait(s, c, "p50")))
        row(f"{cls} wait p90", lambda s, _, c=cls: fmt_duration(_wait(s, c, "p90")))
    row(
        "requests never started",
        lambda s, _: str(sum(v["not_started"] for v in s["waits"].values())),
    )
    row("occupancy", lambda s, _: _pct(s["occupancy"]))
    row("owed GPU-h delivered", lambda s, _: _pct(s["owed_delivered"]))
    row(
        "projects ≥ 95% of owed",
        lambda s, _: f"{s['projects_at_95']}/{s['projects_owed']}",
    )
    row("worst project", lambda s, _: _pct(s["worst_project_delivered"]))
    row("owed delivered hour by hour", lambda s, _: _pct(s["owed_delivered_hourly"]))
    row("squatter idle GPU-h", lambda s, _: f"{s['squatter_idle_gpu_hours']:,.0f}")
    row("preemptions", lambda s, _: f"{s['preemptions_total']:,}")
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


def _size_label(cls: str) -> str:
    size = cls.removeprefix("batch ")
    labels = {"1": "1 GPU", "multi-node": "multi-node", "large": "large (> 1/4 cluster)"}
    return labels.get(size, f"{size} GPUs")


def _daily(hourly: Sequence[float]) -> list[float]:
    return [sum(hourly[i : i + 24]) for i in range(0, len(hourly), 24)]


def _h(hours: float | None) -> float | None:
    return None if hours is None else hours * 3600


def _all_classes(data: Mapping[str, Any]) -> list[str]:
    from .metrics import _class_order

    seen = {c for p in data["policies"].values() for c in p["summary"]["waits"]}
    return sorted(seen, key=_class_order)


# ---- goals (issue #5) -------------------------------------------------------------------


def goals(data: Mapping[str, Any]) -> list[tuple[str, bool | None, str]]:
    """``(goal, met, detail)`` for our policy; ``met`` is None when it cannot be judged."""
    policies = data["policies"]
    if OURS not in policies:
        return []
    ours = policies[OURS]["summary"]
    out: list[tuple[str, bool | None, str]] = []
    p90 = _wait(ours, "debug", "p90")
    out.append(
        ("debug p90 wait ≤ 30 s", None if p90 is None else p90 <= 30, f"{fmt_duration(p90)}")
    )
    owed = ours["owed_delivered"]
    out.append(
        ("≥ 98% of owed GPU-hours overall", None if owed is None else owed >= 0.98, _pct(owed))
    )
    worst = ours["worst_project_delivered"]
    out.append(
        (
            "≥ 95% of owed GPU-hours for every project",
            None if worst is None else worst >= 0.95,
            f"worst {_pct(worst)}; {ours['projects_at_95']}/{ours['projects_owed']} at ≥ 95%",
        )
    )
    occ = ours["occupancy"]
    out.append(("occupancy ≥ 98%", occ >= 0.98, _pct(occ)))
    large = _wait(ours, "batch large", "p90")
    if "priority" in policies:
        theirs = _wait(policies["priority"]["summary"], "batch large", "p90")
        met = None if large is None or theirs is None else large <= theirs
        detail = f"{fmt_duration(large)} vs {fmt_duration(theirs)}"
        out.append(("large-job p90 wait ≤ strict priority's", met, detail))
    out.append(
        ("zero interventions for drains", ours["interventions"] == 0, str(ours["interventions"]))
    )
    return out


def goals_markdown(data: Mapping[str, Any]) -> str:
    lines = ["| goal | met | ours |", "|---|:---:|---:|"]
    for goal, met, detail in goals(data):
        mark = "–" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {goal} | {mark} | {detail} |")
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
    """Three figures: wait distributions, owed GPU-hours per project, occupancy over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = data["workload"]["name"]
    policies = list(data["policies"])
    written = []

    # 1. waits: debug CDF, and p90 by batch size class
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in policies:
        sample = data["policies"][p]["summary"]["wait_samples"].get("debug", [])
        if sample:
            ys = [(i + 1) / len(sample) for i in range(len(sample))]
            left.step([max(v, 0.5) for v in sample], ys, where="post", label=LABELS.get(p, p))
    left.set_xscale("log")
    left.axvline(30, color="grey", linestyle=":", linewidth=1)
    left.set_xlabel("debug session wait (s, log; dotted: 30 s goal)")
    left.set_ylabel("fraction of sessions")
    left.set_title("Debug sessions: time to a GPU")
    left.legend(fontsize=8)
    classes = [c for c in _all_classes(data) if c.startswith("batch")]
    width = 0.8 / max(1, len(policies))
    for i, p in enumerate(policies):
        s = data["policies"][p]["summary"]
        values = [max((_wait(s, c, "p90") or 0) / 3600, 1e-3) for c in classes]
        xs = [x + i * width for x in range(len(classes))]
        right.bar(xs, values, width, label=LABELS.get(p, p))
        for x, value, c in zip(xs, values, classes, strict=True):
            entry = s["waits"].get(c)
            if entry and entry["not_started"]:
                share = 100 * entry["not_started"] / entry["count"]
                right.annotate(f"{share:.0f}%", (x, value), ha="center", va="bottom", fontsize=6)
    right.set_xticks([x + width * (len(policies) - 1) / 2 for x in range(len(classes))])
    right.set_xticklabels([_size_label(c) for c in classes])  # colours as on the left
    right.set_yscale("log")
    right.set_ylabel("p90 wait (hours, log)")
    right.set_title("Batch jobs: p90 wait by size (above a bar: share never started)")
    fig.tight_layout()
    path = directory / f"{name}-waits.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # 2. owed GPU-hours delivered per project
    fig, ax = plt.subplots(figsize=(12, 4.5))
    first = data["policies"][policies[0]]["summary"]["projects"]
    projects = sorted(first)
    for i, p in enumerate(policies):
        per = data["policies"][p]["summary"]["projects"]
        values = [100 * (per[x]["delivered_fraction"] or 0) for x in projects]
        ax.bar([k + i * width for k in range(len(projects))], values, width, label=LABELS.get(p, p))
    ax.axhline(95, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks([k + width * (len(policies) - 1) / 2 for k in range(len(projects))])
    ax.set_xticklabels(
        [f"{x}\n{100 * first[x]['entitlement']:.1f}%" for x in projects],
        fontsize=8,
    )
    ax.set_ylabel("owed GPU-hours delivered (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Owed GPU-hours delivered per project (entitlement below the name; dotted: 95%)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = directory / f"{name}-owed.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # 3. occupancy over time, by day
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    for p in policies:
        hourly = data["policies"][p]["summary"]["hourly"]
        held, cap, idle = (_daily(hourly[k]) for k in ("held_gpus", "capacity_gpus", "idle_gpus"))
        days = [d + 0.5 for d in range(len(held))]
        (line,) = top.plot(
            days,
            [100 * h / c if c else 0 for h, c in zip(held, cap, strict=True)],
            linewidth=1.2,
            marker=".",
            label=LABELS.get(p, p),
        )
        if any(idle):
            top.plot(
                days,
                [100 * i / c if c else 0 for i, c in zip(idle, cap, strict=True)],
                linewidth=0.8,
                linestyle="--",
                color=line.get_color(),
            )
        hours = range(len(hourly["pending_gpus"]))
        bottom.plot([h / 24 for h in hours], hourly["pending_gpus"], linewidth=0.8)
    top.set_ylabel("occupancy (%)\n(dashed: held idle)")
    top.set_ylim(0, 102)
    top.legend(fontsize=8, loc="center right")
    top.set_title("GPUs held over usable GPUs, day by day")
    bottom.set_ylabel("GPUs asked by\npending requests")
    bottom.set_yscale("symlog", linthresh=10)
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("day")
    fig.tight_layout()
    path = directory / f"{name}-occupancy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        for written in render(name):
            print(f"wrote {written}")
