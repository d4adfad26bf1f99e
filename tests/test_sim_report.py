"""The report (JSON, table, goals, plots) and the command line, on a small generated workload."""

from __future__ import annotations

import copy
import json

import pytest

from broker.sim.cli import main
from broker.sim.engine import simulate
from broker.sim.policies import POLICIES
from broker.sim.report import (
    LABELS,
    comparison,
    fmt_duration,
    goals,
    render,
    table,
    write_report,
)
from broker.sim.workloads import GeneratorConfig, generate

SMALL = GeneratorConfig(days=1, slices=150, users=12, projects=3, programs=1, load=2.0)


@pytest.fixture(scope="module")
def runs():
    w = generate(SMALL, seed=2)
    return w, [simulate(w, factory(w.accounts)) for factory in POLICIES.values()]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "–"),
        (0, "0 s"),
        (42.4, "42 s"),
        (600, "10.0 min"),
        (7200, "2.0 h"),
        (4 * 86400, "4.0 d"),
    ],
)
def test_durations_read_at_a_glance(seconds, text):
    assert fmt_duration(seconds) == text


def test_table_has_a_column_per_policy_and_the_goals_are_judged(runs):
    w, results = runs
    data = comparison(w, results)
    text = table(data)
    assert text.count("\n") > 20
    for label in ("FIFO", "strict priority", "Slurm-like", "ours", "debug wait p90", "occupancy"):
        assert label in text
    for label in ("goodput (of occupancy)", "preemptions per 1,000 GPU-h", "debug within cap"):
        assert label in text
    judged = {goal: met for goal, met, _ in goals(data)}
    assert set(judged) >= {
        "debug p90 wait ≤ 30 s",
        "debug p90 wait ≤ 30 s within the per-user cap",
        "occupancy ≥ 98%",
        "occupancy ≥ 98% while demand exceeds capacity",
        "goodput ≥ 95% of occupancy",
        "no job preempted more than 3 times",
        "≤ 1 preemption per 10 completed jobs",
        "≥ 95% of owed GPU-hours hour by hour",
        "owed GPU-hours hour by hour ≥ every baseline's",
        "multi-node p90 wait ≤ best baseline's",
        "zero interventions for drains",
    }
    assert all(met in (True, False, None) for met in judged.values())
    assert json.loads(json.dumps(data))["workload"]["jobs"] == len(w.jobs)


def _judged(data) -> dict[str, tuple[bool | None, str]]:
    return {goal: (met, detail) for goal, met, detail in goals(data)}


def test_churn_and_delivery_goals_judge_the_figures(runs):
    data = copy.deepcopy(comparison(*runs))  # the runs' summaries are shared by the module
    ours = data["policies"]["fairshare"]["summary"]
    ours |= {"preemptions_per_job_max": 3, "jobs_preempted_more_than_3": 0}
    ours |= {"preemptions_total": 10, "completed": 100, "preemptions_per_completed_job": 0.1}
    ours["owed_delivered_hourly"] = 0.96
    data["policies"]["slurm"]["summary"]["owed_delivered_hourly"] = 0.97
    judged = _judged(data)
    assert judged["no job preempted more than 3 times"] == (True, "max 3; 0 jobs more than 3 times")
    assert judged["≤ 1 preemption per 10 completed jobs"][0] is True
    assert judged["≥ 95% of owed GPU-hours hour by hour"] == (True, "96.0%")
    assert judged["owed GPU-hours hour by hour ≥ every baseline's"] == (
        False,
        "96.0% vs 97.0% (Slurm-like multifactor)",
    )
    ours["preemptions_per_job_max"], ours["preemptions_per_completed_job"] = 4, 0.11
    judged = _judged(data)
    assert judged["no job preempted more than 3 times"][0] is False
    assert judged["≤ 1 preemption per 10 completed jobs"][0] is False


def test_without_jobs_above_a_quarter_of_the_cluster_large_jobs_are_judged_on_what_there_is(
    runs,
):
    data = copy.deepcopy(comparison(*runs))
    for entry in data["policies"].values():
        entry["summary"]["waits"].pop("batch large", None)
    judged = _judged(data)
    quarter = data["workload"]["gpus"] / 4
    met, detail = judged[f"large jobs (> a quarter of the cluster, {quarter:g} GPUs)"]
    assert met is None and detail.startswith("none in the trace: judged on")
    assert "large-job p90 wait ≤ strict priority's" not in judged
    fallback = [g for g in judged if g in ("≥ 32 GPUs p90 wait ≤ strict priority's",
                                           "multi-node p90 wait ≤ strict priority's")]  # fmt: skip
    assert len(fallback) == 1 and "–" not in judged[fallback[0]][1]


def test_write_report_writes_json_markdown_and_plots(runs, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the 'sim' extra (matplotlib)")
    w, results = runs
    written = write_report(tmp_path, w, results)
    names = sorted(p.name for p in written)
    assert names == [
        "generated-occupancy.png",
        "generated-owed.png",
        "generated-preemptions.png",
        "generated-waits.png",
        "generated.json",
        "generated.md",
    ]
    assert all(p.stat().st_size > 0 for p in written)
    assert "![generated-waits.png](generated-waits.png)" in (tmp_path / "generated.md").read_text()
    # the Markdown and plots can be made again from the JSON alone
    (tmp_path / "generated.md").unlink()
    again = render(tmp_path / "generated.json")
    assert sorted(p.name for p in again) == [n for n in names if not n.endswith(".json")]


def test_the_occupancy_plot_explains_only_the_lines_it_draws(runs):
    plt = pytest.importorskip("matplotlib.pyplot", reason="plots need the 'sim' extra")
    from broker.sim.report import _plot_occupancy

    data = copy.deepcopy(comparison(*runs))
    for entry in data["policies"].values():
        hourly = entry["summary"]["hourly"]
        hourly["idle_gpus"] = [0.0] * len(hourly["idle_gpus"])
        hourly["wasted_gpus"] = [0.0] * len(hourly["wasted_gpus"])
    fig = _plot_occupancy(plt, data)
    top = fig.axes[0]
    assert top.get_ylabel() == "occupancy (%)"
    assert all(line.get_linestyle() == "-" for line in top.get_lines())
    plt.close(fig)
    data["policies"]["fairshare"]["summary"]["hourly"]["idle_gpus"][5] = 2.0
    fig = _plot_occupancy(plt, data)
    assert "dashed: held idle" in fig.axes[0].get_ylabel()
    assert "dotted" not in fig.axes[0].get_ylabel()
    plt.close(fig)


def test_cli_runs_a_comparison_and_writes_the_report(tmp_path, capsys):
    status = main(
        [
            "generate",
            "--days", "0.5", "--slices", "60", "--users", "8",
            "--policies", "fairshare,fifo",
            "--report", str(tmp_path), "--no-plots", "--json", str(tmp_path / "out.json"),
        ]
    )  # fmt: skip
    assert status == 0
    out = capsys.readouterr().out
    assert "| debug wait p90 |" in out and "goal" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert list(data["policies"]) == ["fairshare", "fifo"]
    assert (tmp_path / "generated.md").is_file()


def generated_summary(tmp_path, *extra: str, days: str = "0.5", slices: str = "60") -> dict:
    """Our policy's summary of a small generated workload simulated with ``extra``."""
    out = tmp_path / "out.json"
    argv = ["generate", "--days", days, "--slices", slices, "--users", "8", "--no-failures"]
    assert main([*argv, "--policies", "fairshare", "--quiet", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())["policies"]["fairshare"]["summary"]


def test_cli_charges_restarts_unless_told_not_to(tmp_path, capsys):
    def wasted(*extra: str) -> dict:
        return generated_summary(tmp_path, *extra)["wasted_by_cause"]

    charged = wasted()["preemption"]
    assert charged["restart"] > 0 and charged["since checkpoint"] > 0
    free = wasted("--restart-cost", "0", "--checkpoint-interval", "0")["preemption"]
    assert free == {"restart": 0.0, "since checkpoint": 0.0, "rerun": 0.0}
    capsys.readouterr()


def test_cli_hands_the_reservation_bound_to_the_policy(tmp_path, capsys):
    default = generated_summary(tmp_path)
    assert generated_summary(tmp_path, "--max-reservations", "8") == default  # the default
    # Without reservations the blocked requests that had them wait differently.
    assert generated_summary(tmp_path, "--max-reservations", "0")["waits"] != default["waits"]
    capsys.readouterr()


def test_cli_hands_the_debug_preemption_delay_to_the_policy(tmp_path, capsys):
    def preemptions(*extra: str) -> dict:
        return generated_summary(tmp_path, *extra, days="1", slices="300")["preemptions"]

    assert preemptions()["debug_lane"] > 0  # the policy's default: no delay
    # Debug sessions that wait a day for releases before preempting never do here.
    assert "debug_lane" not in preemptions("--debug-preemption-delay", "86400")
    capsys.readouterr()


def test_cli_runs_once_per_seed_and_shows_each_figure_with_its_mean(tmp_path, capsys):
    small = ["generate", "--days", "0.5", "--slices", "60", "--users", "8", "--quiet"]
    out = tmp_path / "seeds.json"
    assert main([*small, "--policies", "fairshare,fifo", "--seeds", "3,4", "--json", str(out)]) == 0
    table_ = capsys.readouterr().out
    runs = json.loads(out.read_text())["seeds"]
    assert list(runs) == ["3", "4"] and list(runs["3"]["policies"]) == ["fairshare", "fifo"]
    # Each seed's run is the run that --seed gives.
    single = tmp_path / "single.json"
    assert main([*small, "--policies", "fairshare,fifo", "--seed", "4", "--json", str(single)]) == 0
    capsys.readouterr()
    alone = json.loads(single.read_text())["policies"]
    assert {p: alone[p]["summary"] for p in alone} == {
        p: runs["4"]["policies"][p]["summary"] for p in alone
    }
    # --jobs spreads the seeds over processes: the same runs.
    spread = tmp_path / "spread.json"
    argv = [*small, "--policies", "fairshare,fifo", "--seeds", "3,4", "--jobs", "2"]
    assert main([*argv, "--json", str(spread)]) == 0
    assert capsys.readouterr().out == table_
    apart = json.loads(spread.read_text())["seeds"]
    assert {s: {p: apart[s]["policies"][p]["summary"] for p in alone} for s in apart} == {
        s: {p: runs[s]["policies"][p]["summary"] for p in alone} for s in runs
    }
    worst = [runs[s]["policies"]["fairshare"]["summary"]["worst_project_delivered"] for s in "34"]
    assert worst[0] != worst[1]  # the seeds give other workloads
    cells = [f"{100 * v:.1f}%" for v in (*worst, sum(worst) / 2)]
    assert f"| worst project | {LABELS['fairshare']} | {' | '.join(cells)} |" in table_


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--seeds", "1,1"], "--seeds takes distinct seeds"),
        (["generate", "--seeds", "1,x"], "--seeds takes distinct seeds"),
        (["generate", "--seeds", "1,2", "--report", "out"], "--report writes one run"),
        (["helios", "--trace", "no/such/trace.csv"], "Helios trace not found"),
        (["alibaba", "--trace", "no/such/pods.csv"], "Alibaba pod list not found"),
        (["generate", "--policies", "lottery"], "unknown policy lottery"),
        (["csv"], "csv needs --trace"),
        (["helios"], "helios needs --trace"),
        (["alibaba"], "alibaba needs --trace"),
        (["generate", "--debug-headroom", "-1"], "--debug-headroom takes a number of GPUs"),
        (["generate", "--preemption-backoff", "0.5"], "--preemption-backoff takes a factor"),
        (["generate", "--max-reservations", "-1"], "--max-reservations takes a count"),
        (["generate", "--preemption-budget", "-2"], "--preemption-budget takes a count"),
        (["generate", "--debug-preemption-delay", "-1"], "--debug-preemption-delay takes seconds"),
        (["generate", "--fair-share-margin", "2"], "--fair-share-margin takes shares"),
        (["generate", "--restart-cost", "-5"], "--restart-cost takes seconds, 0 or more"),
        (["generate", "--checkpoint-interval", "nan"], "--checkpoint-interval takes seconds"),
        (["generate", "--tick", "0"], "--tick takes seconds, above 0"),  # the clock stood still
        (["generate", "--quantum", "-1"], "--quantum takes seconds, above 0"),
        (["generate", "--days", "0"], "--days takes days, above 0"),
        (["generate", "--slices", "-5"], "--slices takes a count, above 0"),
        (["helios", "--trace", "t.csv", "--load", "0"], "--load takes a factor, above 0"),
        (["helios", "--trace", "t.csv", "--limit", "-1"], "--limit takes a count, above 0"),
        (["generate", "--jobs", "0"], "--jobs takes a count, above 0"),
        (["generate", "--warmup", "-1"], "--warmup takes hours, 0 or more"),
        (["generate", "--preemption-backoff", "nan"], "--preemption-backoff takes a factor"),
    ],
)
def test_cli_errors_are_one_line_and_status_2(argv, message, capsys):
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_plugs_into_a_slicebroker_style_parser():
    import argparse

    from broker.sim.cli import add_parser, run

    parser = argparse.ArgumentParser(prog="slicebroker")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "generate", "--slices", "10"])
    assert args.handler is run and args.slices == 10
