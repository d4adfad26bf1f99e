"""The report (JSON, table, goals, plots) and the command line, on a small generated workload."""

from __future__ import annotations

import json

import pytest

from broker.sim.cli import main
from broker.sim.engine import simulate
from broker.sim.policies import POLICIES
from broker.sim.report import comparison, fmt_duration, goals, render, table, write_report
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
    judged = {goal: met for goal, met, _ in goals(data)}
    assert set(judged) >= {
        "debug p90 wait ≤ 30 s",
        "occupancy ≥ 98%",
        "zero interventions for drains",
    }
    assert json.loads(json.dumps(data))["workload"]["jobs"] == len(w.jobs)


def test_write_report_writes_json_markdown_and_plots(runs, tmp_path):
    pytest.importorskip("matplotlib", reason="plots need the 'sim' extra (matplotlib)")
    w, results = runs
    written = write_report(tmp_path, w, results)
    names = sorted(p.name for p in written)
    assert names == [
        "generated-occupancy.png",
        "generated-owed.png",
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["helios", "--trace", "no/such/trace.csv"], "Helios trace not found"),
        (["generate", "--policies", "lottery"], "unknown policy lottery"),
        (["csv"], "csv needs --trace"),
        (["generate", "--debug-headroom", "-1"], "--debug-headroom takes a number of GPUs"),
        (["generate", "--restart-cost", "-5"], "--restart-cost takes seconds, 0 or more"),
        (["generate", "--checkpoint-interval", "nan"], "--checkpoint-interval takes seconds"),
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
